"""What the reproduction scripts share: the paper settings they run (``configs/experiment/``), the store of finished
runs (a sweep resumes), the per-round curve figure, the mean ± std cell of a results table, the step-size search of
``--tune`` and the runner of ``--jobs``."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

QUIET_CPU = [
    "logger=none",
    "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu",
    "checkpoint=null",
    "callbacks.progress_bar=null",
    "num_threads=1",
]
"""Overrides of every reproduction run: no logger, bar or checkpoint, the CPU, one thread."""


@cache
def composed(*overrides: str) -> Any:
    """The config ``overrides`` compose to (no checks, no run folder), e.g. ``composed("experiment=pfedfbe_lasso1")``:
    where a script reads a setting's values (its step size, its rounds) from the experiment that holds them."""
    from flx.config import compose_run

    return compose_run(list(overrides), check=False)


def config_key(overrides: Sequence[str]) -> str:
    """A short hash of the resolved config ``overrides`` compose to, its run folder and name left out: what a run
    store keys a run by, so that two command lines of the same run (``experiment=whale_digits`` or its keys spelled
    out) find one stored result."""
    import hashlib

    from omegaconf import OmegaConf

    cfg = composed(*overrides, "paths.output_dir=/flx-run-store").copy()
    OmegaConf.set_struct(cfg, False)
    del cfg["hydra"]
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for key in ("paths", "task_name"):
        resolved.pop(key)
    return hashlib.sha256(json.dumps(_floats(resolved), sort_keys=True).encode()).hexdigest()[:16]


def stored_run(
    store: Path,
    overrides: Sequence[str],
    train_missing: bool = True,
    keep: Callable[[str], bool] | None = None,
    keep_failures: bool = False,
) -> dict | None:
    """One training run of ``overrides``, kept in ``store/<key>.json`` under its resolved config
    (:func:`config_key`) as ``{"overrides", "final", "curves"}``; a later call of the same run reads it back, so a
    killed sweep resumes where it stopped and several processes can fill one store (each file is written whole, then
    renamed into place). ``train_missing`` False: None for a run not in the store (nothing trains). ``keep``: which
    curves (by metric key) to store (default: all). ``keep_failures``: a run that raises (a divergence: a result of
    the sweep, not an accident) is stored as ``{"overrides", "failed": "<its one line>"}`` and not trained again;
    otherwise the error propagates and nothing is stored."""
    import tempfile

    key = config_key(overrides)
    path = store / f"{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    if not train_missing:
        return None
    from flx.config import precheck
    from flx.run import train

    try:
        with tempfile.TemporaryDirectory() as out:
            final = train(precheck([*overrides, f"paths.output_dir={out}"]))
            curves = json.loads((Path(out) / "curves.json").read_text())
    except Exception as e:  # noqa: BLE001 - kept as the run's result when asked, re-raised otherwise
        if not keep_failures:
            raise
        record: dict = {"overrides": list(overrides), "failed": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    else:
        record = {
            "overrides": list(overrides),
            "final": {k: float(v) for k, v in final.items()},
            "curves": {k: v for k, v in curves.items() if keep is None or keep(k)},
        }
    store.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)
    return record


def _floats(value: Any) -> Any:
    """``value`` with every integer a float: ``data.val_fraction=0`` and ``0.0`` are one run."""
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def own(algo: str, keys: Sequence[str]) -> list[str]:
    """Overrides that give ``algo`` its own config's values of ``algo.<key>`` for each of ``keys``.

    An experiment's values of some keys belong to its paper's method (pFedFBE's lambda 2000 is not pFedMe's lambda):
    a baseline run in the experiment (``experiment=pfedfbe_lasso1 algo=pfedme``) takes its own instead; a key its
    config lacks is removed (``~algo.lam``). A node (``regularizer``) is restored leaf by leaf."""
    from omegaconf import OmegaConf

    config = composed(f"algo={algo}").algo
    out = []
    for key in keys:
        if OmegaConf.select(config, key, default=_ABSENT) is _ABSENT:
            out.append(f"~algo.{key}")
            continue
        value = OmegaConf.to_container(config, resolve=False)
        for part in key.split("."):
            value = value[part]
        out += [f"algo.{k}={_literal(v)}" for k, v in _leaves(key, value)]
    return out


_ABSENT = object()


def _leaves(key: str, value: Any) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every leaf of ``value`` (a scalar or a list is one leaf)."""
    if not isinstance(value, dict):
        return [(key, value)]
    return [leaf for k, v in value.items() for leaf in _leaves(f"{key}.{k}", v)]


def _literal(value: Any) -> str:
    """``value`` in Hydra's override syntax (strings quoted, interpolations kept)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_literal(v) for v in value) + "]"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def mean_std(values: Sequence[float], scale: float = 1.0, digits: int | None = None) -> str:
    """``mean ± std`` over seeds of ``values * scale`` (one seed: std 0); ``n/a`` if a value is missing, ``diverged``
    if one is infinite or huge. ``digits`` None: 4 below 10, else 2."""
    if any(not math.isfinite(v) for v in values):
        return "diverged" if any(math.isinf(v) or abs(v) > 1e12 for v in values) else "n/a"
    values = [v * scale for v in values]
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    mean = statistics.mean(values)
    d = digits if digits is not None else (4 if abs(mean) < 10 else 2)
    return f"{mean:.{d}f} ± {std:.{d}f}"


def plot_curves(
    path: Path,
    title: str,
    curves: dict[str, dict],
    keys: Sequence[str],
    log: Sequence[str] = (),
    xlabel: str = "communication round",
) -> None:
    """One panel per metric of ``keys`` (its ``(x, value)`` curve for each method of ``curves``, x the round unless
    the caller mapped it, e.g. to simulated time, and says so in ``xlabel``; keys in ``log`` on a log scale), saved
    to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.7 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for name, curve in curves.items():
            if curve.get(key):
                ax.plot(*zip(*curve[key]), label=name, linewidth=1.2)
        if key in log:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title(f"{key} (seed 0)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def data_available(setting: str, overrides: Sequence[str]) -> bool:
    """Whether the data of a run with ``overrides`` load (the embedded ``digits`` always do); prints why not."""
    if setting == "digits":
        return True
    from hydra.utils import instantiate

    from flx.config import precheck
    from flx.errors import ConfigError

    try:
        cfg = precheck([*overrides, "paths.output_dir=/tmp/flx_data_probe"])
        instantiate(cfg.data.loader)()
        return True
    except (ConfigError, FileNotFoundError, OSError, RuntimeError) as e:
        print(f"skipping {setting}: {str(e).splitlines()[0]}", flush=True)
        return False


TUNE_SEED = 1000
"""The seed of every tuning run: none of the evaluation seeds (0, 1, 2, ...), so a tuned step size is not selected on
the runs it is then reported with."""


def tune(
    grid: Sequence[float],
    score: Callable[[float], float],
    maximize: bool = False,
    name: str = "step size",
    prefer: float | None = None,
) -> tuple[float, dict[float, float]]:
    """The value of ``grid`` with the best ``score`` (a run's value of the selection metric: the lowest, or the
    highest with ``maximize``), and every score. A run that diverged or failed (an exception, a nan or an infinite
    score) ranks last: its score is recorded as ``inf`` (``-inf`` with ``maximize``). Ties go to ``prefer`` (e.g. the
    paper's value) if it is among them, else to the first in ``grid``; a grid on which every run diverged raises.
    ``name``: what the grid holds, for the messages."""
    worst = -math.inf if maximize else math.inf
    scores: dict[float, float] = {}
    for value in grid:
        try:
            got = float(score(value))
        except Exception as e:  # noqa: BLE001 - a diverged or failed run ranks last, whatever stopped it
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"  {name} {value:g}: failed ({why})", flush=True)
            got = worst
        scores[value] = got if math.isfinite(got) else worst
    top = (max if maximize else min)(scores.values())
    if not math.isfinite(top):
        raise RuntimeError(f"every {name} of the grid {list(grid)} diverged")
    tied = [v for v in grid if scores[v] == top]
    return (prefer if prefer in tied else tied[0]), scores


def save_tuned(path: Path, tuned: dict) -> None:
    """Writes the tuned values (e.g. ``{setting: {method: {"lr", "scores", "seed", "rounds", "metric"}}}``) next to
    the table, so that a reader sees what was searched and what each candidate scored."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(tuned, indent=1, sort_keys=True) + "\n")


class InlineExecutor(Executor):
    """Runs each submitted call at once, in this process (``--jobs 1``): the same code path as a pool, in order."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - kept in the future, raised by .result() as a pool's would be
            future.set_exception(e)
        return future


def executor(jobs: int) -> Executor:
    """Where the runs of a reproduction go: this process (``jobs`` <= 1) or ``jobs`` fresh worker processes (spawned:
    no torch state forked; each run's randomness comes from its own seed, so the results do not depend on ``jobs``).
    Use one job per free core: every run is one thread (``num_threads=1``)."""
    if jobs <= 1:
        return InlineExecutor()
    return ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
