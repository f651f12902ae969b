"""What a run prints: its headline metrics, and the final line ``final test_acc=0.9123 test_auroc=0.8812``.

A run's headline metrics are named by the task (``Task.headline``: ``acc`` for classification, ``mse`` for
regression) and then by the algorithm's parts (``FederatedCallback.headline``: FeDXL's ``auroc`` and ``pauc_*``,
DRFA's ``client_acc_worst``), without the split: the progress bar shows them from the latest evaluation
(``val/<name>``) and the final line from the test (``test/<name>``). A name the run did not log is left out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def headline(task: Any, parts: Iterable[Any]) -> tuple[str, ...]:
    """The task's headline names, then each part's (list order), without repeats."""
    names = [*getattr(task, "headline", ())]
    for part in parts:
        names += getattr(part, "headline", ())
    return tuple(dict.fromkeys(names))


def present(metrics: Mapping[str, Any], names: Sequence[str], splits: Sequence[str]) -> dict[str, float]:
    """``{split/name: value}`` for each name, from the first of ``splits`` that has it; names no split has are left
    out."""
    out: dict[str, float] = {}
    for name in names:
        key = next((f"{s}/{name}" for s in splits if f"{s}/{name}" in metrics), None)
        if key is not None:
            out[key] = float(metrics[key])
    return out


def final_line(metrics: Mapping[str, float], names: Sequence[str], job: str | None = None) -> str | None:
    """``final test_<name>=<value> ...`` over the headline names the test logged (4 decimals), then ``(<job>)`` in a
    sweep; None when the test logged none of them.

    >>> final_line({"test/acc": 0.91234, "test/auroc": 0.8, "test/loss": 0.3}, ("acc", "auroc"), "job 1: algo.lr=0.1")
    'final test_acc=0.9123 test_auroc=0.8000 (job 1: algo.lr=0.1)'
    """
    values = present(metrics, names, ("test",))
    if not values:
        return None
    line = "final " + " ".join(f"{key.replace('/', '_')}={value:.4f}" for key, value in values.items())
    return f"{line} ({job})" if job else line


def sweep_job() -> str | None:
    """``job <n>: <overrides>`` inside a Hydra ``-m`` sweep, else None. The overrides are this job's values of the
    swept keys (those with sweep syntax in the sweep's ``multirun.yaml``); all its overrides where that file is
    missing (a launcher that writes none)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hc = HydraConfig.get()
    overrides = list(hc.overrides.task)
    swept = _swept_keys(os.path.join(str(hc.sweep.dir), "multirun.yaml"))
    if swept:
        overrides = [o for o in overrides if _key(o) in swept]
    return f"job {hc.job.num}: {' '.join(overrides)}".rstrip()


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _swept_keys(multirun_yaml: str) -> set[str]:
    """The keys that the sweep's command line varies (``algo.lr=0.05,0.1``, ``range(...)``, ``choice(...)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    if not os.path.isfile(multirun_yaml):
        return set()
    task = OmegaConf.load(multirun_yaml).hydra.overrides.task
    return {o.key_or_group for o in OverridesParser.create().parse_overrides(list(task)) if o.is_sweep_override()}
