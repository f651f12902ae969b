"""Loggers that never delete what an earlier run wrote.

Lightning's ``CSVLogger`` removes an existing ``metrics.csv`` when its folder is reused, so a run resumed into
its own output folder (``ckpt_path=auto`` after a crash or a SLURM requeue) would lose the rounds logged before
the crash. :class:`CSVLogger` appends instead: the earlier rows are kept, and new columns widen the file.
Values logged for one step in several calls before the file is written (a round's counters, sent straight to the
loggers by ``flx.module_logging.Reporter.log_round``, then Lightning's row of its epoch-end metrics) share one row.
A round that was logged, then replayed after resuming from an earlier checkpoint, appears twice, with the same
values (a resumed run recomputes it exactly). A file a kill cut in the middle of a row is first cut back to its last
whole row (:func:`repair_torn`, with a warning): appended rows never glue onto a broken line.
"""

from __future__ import annotations

import csv
import logging
import os
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from typing_extensions import override

log = logging.getLogger(__name__)


def repair_torn(path: str) -> int:
    """Cuts the CSV file ``path`` back to its last whole row, one a kill did not cut short (it ends in a newline; one
    that lost only the ``\\n`` of its ``\\r\\n`` gets it back). Returns the number of bytes removed."""
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return 0
        if data.endswith(b"\r"):
            f.write(b"\n")
            return 0
        keep = data.rfind(b"\n") + 1  # 0: not even the header is whole
        f.truncate(keep)
        return len(data) - keep


class AppendingExperimentWriter(ExperimentWriter):
    """Lightning's CSV writer without the deletion of an existing ``metrics.csv``; its header is adopted."""

    @override
    def _check_log_dir_exists(self) -> None:
        if os.path.isfile(self.metrics_file_path):
            if cut := repair_torn(self.metrics_file_path):
                log.warning("flx: %s ended in a row cut short (a killed run): removed its %d bytes before appending",
                            self.metrics_file_path, cut)  # fmt: skip
            with open(self.metrics_file_path, newline="") as f:
                self.metrics_keys = list(next(csv.reader(f), []))

    @override
    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        last = self.metrics[-1] if self.metrics else None
        super().log_metrics(metrics_dict, step)
        row = self.metrics[-1]
        if last is not None and last["step"] == row["step"] and all(last[k] == v for k, v in row.items() if k in last):
            last.update(self.metrics.pop())  # one row per step while it is not written yet


class CSVLogger(_LightningCSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that appends to an existing ``metrics.csv`` (see the module doc)."""

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> AppendingExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        # no flush every n steps: Lightning saves after each of its own calls, and a row still being merged (one step
        # logged in several calls) must not be written half
        if self._prefix:
            metrics = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        self.experiment.log_metrics(metrics, step)
