"""A callback for the benchmark's whole-process runs: writes when the rounds start and end (rank zero), as JSON.

Added to a ``train.py`` command line by ``run.py`` (``+callbacks.bench_marks._target_=marks.Marks``, with this
folder on ``PYTHONPATH``); it does nothing during the rounds.
"""

from __future__ import annotations

import json
import time

import lightning.pytorch as pl


class Marks(pl.Callback):
    """``{"train_start": t0, "train_end": t1}`` (epoch seconds) written to ``out`` by global rank zero."""

    def __init__(self, out: str) -> None:
        self.out, self.marks = out, {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.marks["train_start"] = time.time()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.marks["train_end"] = time.time()
        if trainer.is_global_zero:
            with open(self.out, "w") as f:
                json.dump(self.marks, f)
