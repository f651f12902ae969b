"""What a checkpoint must agree with to be resumed: the config fingerprint stored in every flx checkpoint.

A checkpoint of another model, algorithm, set of parts, data, partition or seed cannot continue this run: resuming
it would fail deep inside ``load_state_dict`` or, worse, silently continue with the wrong state (a FedAdam or DRFA
checkpoint resumed as FedAvg). :func:`check_ckpt` compares the stored fingerprint with the config's before the run
starts and names the differences in one line. ``ckpt_path=auto`` in a folder whose ``last.ckpt`` is gone resumes from
its newest intact round file (:func:`newest_round_file`). Only ``omegaconf`` at import time: the pre-run check stays
light.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flx.errors import ConfigError, bad_value


def fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed under ``cfg``: the model, the algorithm and its parts, the
    server optimizer, the data and its partition, the seed, the task unless it is the default classification, the
    simulated system (``system``, whose clock the checkpoint continues) when there is one, and every ``privacy.*``
    setting when the run is private (its ledger: adding, removing or changing privacy on resume is refused).
    Hyper-parameters that may change on resume (rounds, learning rates, evaluation) and where files live are not part
    of it. Plain types only (weights-only loadable)."""

    def plain(key: str) -> Any:
        value = OmegaConf.select(cfg, key)
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value

    # data.experiments is advice to the user (flx.checks.check_experiments), not the data
    data = {k: v for k, v in (plain("data") or {}).items() if k not in ("eval_batch_size", "name", "experiments")}
    data.get("loader", {}).pop("root", None)  # the same files may move
    if not data.get("server_fraction"):  # no server split: as checkpoints written before the key existed
        data.pop("server_fraction", None)
    parts = plain("algo.parts") or {}
    task = plain("task")  # the loss: only when not the default, so that checkpoints written before tasks still match
    task = {} if task is None or task.get("_target_") == "flx.tasks.Classification" else {"task": task}
    aggregator = plain("algo.aggregator")  # likewise only when not the default weighted mean
    task |= {} if aggregator in (None, "mean") else {"algo.aggregator": aggregator}
    system = plain("system")  # the simulated devices and traces (the clock): only when set, likewise
    task |= {"system": system} if system else {}
    private = plain("privacy")  # the ledger's settings: a private run continues only under the same (or not at all)
    task |= {"privacy": private} if private else {}
    return {
        "model": plain("model"),
        "algo.name": plain("algo.name"),
        "algo.parts": {name: (p or {}).get("_target_") for name, p in parts.items() if p is not None},
        "algo.server.name": plain("algo.server.name"),
        "data.name": plain("data.name"),
        "data": data,
        "partition": plain("partition"),
        "seed": plain("seed"),
        **task,
    }


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as ``{"a.b.c": leaf}``."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out |= flatten(v, key) if isinstance(v, dict) and v else {key: v}
    return out


OLD_PARTS = "flx.callbacks."
"""Where the algorithm parts lived before ``flx.parts`` (checkpoints written then name them so)."""
PROCESS_CALLBACKS = ("checkpoint", "progress", "curves", "line_plots")


def moved_parts(saved: dict[str, Any]) -> dict[str, Any]:
    """A stored fingerprint with its parts named where they live now: a checkpoint written before the parts moved to
    ``flx.parts`` names ``flx.callbacks.<part>.<Class>``, which is the same part, so it still resumes."""
    parts = saved.get("algo.parts")
    if not isinstance(parts, dict):
        return saved

    def now(target: Any) -> Any:
        if not isinstance(target, str) or not target.startswith(OLD_PARTS):
            return target
        module = target[len(OLD_PARTS) :].split(".")[0]
        return target if module in PROCESS_CALLBACKS else "flx.parts." + target[len(OLD_PARTS) :]

    return {**saved, "algo.parts": {name: now(target) for name, target in parts.items()}}


PARTS = "flx.parts."
"""Where the parts live now; a part's ``_target_`` is compared by its class name alone (:func:`compared`)."""


def compared(flat: dict[str, Any]) -> dict[str, Any]:
    """A flattened fingerprint as :func:`check_ckpt` compares it: every ``flx.parts.<module path>.<Class>`` (the parts'
    and the privacy part's ``_target_``) as ``<Class>``, so that moving a part to another module or family of
    ``flx.parts`` leaves the checkpoints written before it resumable; a part of another class still differs, and a
    part outside ``flx.parts`` keeps its full path. Sound because the part classes of ``flx.parts`` have distinct
    names (tests/test_config.py)."""
    return {k: v.rsplit(".", 1)[-1] if isinstance(v, str) and v.startswith(PARTS) else v for k, v in flat.items()}


def read_fingerprint(path: str) -> dict[str, Any]:
    """The config fingerprint stored in the flx checkpoint ``path``; a one-line :class:`ConfigError` unless the file is
    intact: loadable weights-only and a flx checkpoint with a fingerprint.

    Loaded memory-mapped: only the small ``flx.fingerprint`` entry is read.
    """
    import torch  # only here: keeps the pre-run check free of the torch import when no checkpoint is given

    try:
        ckpt = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise bad_value("ckpt_path", path, f"not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or not isinstance(ckpt.get("flx"), dict):
        raise bad_value("ckpt_path", path, "not a flx Lightning checkpoint (no 'state_dict'/'flx' entries)")
    saved = ckpt["flx"].get("fingerprint")
    if not saved:
        raise bad_value("ckpt_path", path, "written by an older flx without a config fingerprint: cannot check it")
    return saved


def check_ckpt(cfg: DictConfig, path: str, saved: dict[str, Any] | None = None) -> None:
    """Raises a one-line :class:`ConfigError` unless ``path`` is a flx checkpoint written for this config
    (``saved``: its fingerprint, when already read by :func:`read_fingerprint`)."""
    saved = read_fingerprint(path) if saved is None else saved
    mine, theirs = flatten(fingerprint(cfg)), flatten(moved_parts(saved))
    same_mine, same_theirs = compared(mine), compared(theirs)  # a part's module path may differ, its class may not
    diff = [k for k in sorted(set(mine) | set(theirs)) if same_mine.get(k) != same_theirs.get(k)]
    if any(k.startswith("privacy.") for k in diff):
        raise bad_value("ckpt_path", path, _privacy_change(mine, theirs, diff))
    if diff:
        shown = "; ".join(
            f"{k} is {theirs.get(k)!r} in the checkpoint, {mine.get(k)!r} in the config" for k in diff[:2]
        )
        more = f" (and {len(diff) - 2} more)" if len(diff) > 2 else ""
        raise bad_value("ckpt_path", path, f"written for another run: {shown}{more}; resume with the same settings")


def _privacy_change(mine: dict[str, Any], theirs: dict[str, Any], diff: list[str]) -> str:
    """Why a checkpoint cannot continue under other privacy settings: its rounds were (not) private, and a ledger holds
    only for the settings it was kept under (``diff``: the keys that differ, as :func:`check_ckpt` compares them)."""
    keys = [k for k in diff if k.startswith("privacy.")]
    if not any(k.startswith("privacy.") for k in theirs):
        return "its rounds ran without privacy: a private run cannot continue them (start a new run)"
    if not any(k.startswith("privacy.") for k in mine):
        return "its rounds ran under privacy: continue it with the same privacy=... settings, or start a new run"
    shown = "; ".join(f"{k} is {theirs.get(k)!r} in the checkpoint, {mine.get(k)!r} in the config" for k in keys[:2])
    return f"its privacy ledger was kept under other settings: {shown}; resume with the same privacy settings"


def newest_round_file(cfg: DictConfig, dirpath: str) -> str | None:
    """What ``ckpt_path=auto`` resumes from when ``<dirpath>/last.ckpt`` is gone: the newest intact round file
    (:func:`read_fingerprint`) of this run (:func:`check_ckpt`), never a silent restart from round 1.

    Newer files that are not intact are skipped, and the choice is said on stderr (one line, by the first process).
    None when ``dirpath`` holds no round file (a fresh start); one line when none of them is intact.
    """
    from flx.checkpoint_io import ROUND_FILE  # torch: only when a run resumes

    found = [m for f in os.listdir(dirpath) if (m := ROUND_FILE.fullmatch(f))] if os.path.isdir(dirpath) else []
    skipped = []
    for name in (m.group(0) for m in sorted(found, key=lambda m: -int(m.group(1)))):  # the newest round first
        path = os.path.join(dirpath, name)
        try:
            saved = read_fingerprint(path)
        except ConfigError:
            skipped.append(name)
            continue
        check_ckpt(cfg, path, saved)
        _say(f"flx: ckpt_path=auto: {dirpath} has no last.ckpt; resuming from {name}" + _skipped(skipped))
        return path
    if skipped:
        why = f"{dirpath} has no last.ckpt and none of its round files is an intact flx checkpoint"
        raise bad_value("ckpt_path", "auto", f"{why} ({', '.join(skipped)}); resume from another with ckpt_path=<file>")
    return None


def _skipped(names: list[str]) -> str:
    return f" (skipped {', '.join(names)}: not intact)" if names else ""


def _say(line: str) -> None:
    """A line on stderr from the run's first process (every rank resolves ``ckpt_path=auto`` alike)."""
    from flx.launch import process_rank

    if process_rank() == 0:
        print(line, file=sys.stderr, flush=True)
