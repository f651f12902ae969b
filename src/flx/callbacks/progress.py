"""Progress bar that speaks in rounds and clients: ``Round 3/30: 4/10 clients``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class RoundProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar; the outer counter is the round, the inner one the clients of this rank."""

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(f"Round {trainer.current_epoch + 1}/{trainer.max_epochs}")
        self.train_progress_bar.unit = "client"
