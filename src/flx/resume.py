"""What a checkpoint must agree with to be resumed: the config fingerprint stored in every flx checkpoint.

A checkpoint of another model, algorithm, set of parts, data, partition or seed cannot continue this run: resuming
it would fail deep inside ``load_state_dict`` or, worse, silently continue with the wrong state (a FedAdam or DRFA
checkpoint resumed as FedAvg). :func:`check_ckpt` compares the stored fingerprint with the config's before the run
starts and names the differences in one line. Only ``omegaconf`` at import time: the pre-run check stays light.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from flx.errors import bad_value


def fingerprint(cfg: DictConfig) -> dict[str, Any]:
    """What a checkpoint must agree with to be resumed under ``cfg``: the model, the algorithm and its parts, the
    server optimizer, the data and its partition, the seed, the task unless it is the default classification, and the
    simulated system (``system``, whose clock the checkpoint continues) when there is one.
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


def check_ckpt(cfg: DictConfig, path: str) -> None:
    """Raises a one-line :class:`ConfigError` unless ``path`` is a flx checkpoint written for this config.

    Loaded weights-only and memory-mapped: only the small ``flx.fingerprint`` entry is read.
    """
    import torch  # only here: keeps the pre-run check free of the torch import when no checkpoint is given

    try:
        ckpt = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise bad_value("ckpt_path", path, f"not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "flx" not in ckpt:
        raise bad_value("ckpt_path", path, "not a flx Lightning checkpoint (no 'state_dict'/'flx' entries)")
    saved = ckpt["flx"].get("fingerprint")
    if not saved:
        raise bad_value("ckpt_path", path, "written by an older flx without a config fingerprint: cannot check it")
    mine, theirs = flatten(fingerprint(cfg)), flatten(moved_parts(saved))
    diff = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if diff:
        shown = "; ".join(
            f"{k} is {theirs.get(k)!r} in the checkpoint, {mine.get(k)!r} in the config" for k in diff[:2]
        )
        more = f" (and {len(diff) - 2} more)" if len(diff) > 2 else ""
        raise bad_value("ckpt_path", path, f"written for another run: {shown}{more}; resume with the same settings")
