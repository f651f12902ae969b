"""The console of a run: one bar over the rounds, one over this rank's clients of the round, or one line per
evaluation round.

``mode`` (``callbacks.progress_bar.mode``):

- ``bar``: a bar over the rounds (from the resumed round after a resume) whose postfix holds the round's training loss
  and the latest evaluation's headline metrics (:mod:`flx.console`), ``loss=0.412 val/acc=0.912``; under it a bar
  over this rank's clients of the round, redrawn at most every ``refresh_seconds`` (tqdm's ``mininterval``), so a
  client costs a counter increment and a clock read, not a redraw;
- ``lines``: one plain line on stdout per evaluation round and at the last round, ``round 7/30  loss=0.412
  val/acc=0.912  12.3 s`` (seconds since training started): no carriage returns, nothing per client (SLURM logs);
- ``off``: nothing;
- ``auto`` (default): ``bar`` when stderr is a terminal, else ``lines``.

It subclasses Lightning's ``ProgressBar`` base, so Lightning adds no bar of its own, and draws nothing for
validation, test or the sanity check. Only global rank zero draws. A round is reported once its values are logged:
``train/loss`` is published by the module's ``on_train_epoch_end``, after this callback's, so the report of round ``r``
is made when round ``r + 1`` starts or training ends.
"""

from __future__ import annotations

import sys
import time

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar
from tqdm import tqdm
from typing_extensions import override

from flx.console import headline, present
from flx.errors import bad_value

MODES = ("auto", "bar", "lines", "off")
LOSS = "train/loss"


def _fmt(values: dict[str, float]) -> str:
    return "  ".join(f"{key.removeprefix('train/')}={value:.4g}" for key, value in values.items())


class RoundProgressBar(ProgressBar):
    """Rounds and clients on a terminal, or one line per evaluation round in a log (see the module docstring).

    Args:
        mode: ``auto`` | ``bar`` | ``lines`` | ``off``.
        refresh_seconds: the least time between two redraws of a bar.
    """

    def __init__(self, mode: str = "auto", refresh_seconds: float = 0.2) -> None:
        super().__init__()
        if mode not in MODES:
            raise bad_value("callbacks.progress_bar.mode", mode, f"allowed: {', '.join(MODES)}")
        if not refresh_seconds >= 0:
            raise bad_value("callbacks.progress_bar.refresh_seconds", refresh_seconds, "must be >= 0")
        self.mode, self.refresh_seconds = mode, float(refresh_seconds)
        self._enabled = mode != "off"
        self.rounds: tqdm | None = None
        self.clients: tqdm | None = None
        self._names: tuple[str, ...] = ()
        self._pending: int | None = None  # the finished round not reported yet (1-based)
        self._evaluated = False  # whether that round ran the validation loop
        self._start = 0.0

    @property
    def drawing(self) -> str:
        """What is drawn now: ``bar``, ``lines`` or ``off`` (``auto`` resolved)."""
        if not self._enabled:
            return "off"
        if self.mode == "auto":
            return "bar" if sys.stderr.isatty() else "lines"
        return self.mode

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = self.mode != "off"

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._names = headline(getattr(pl_module, "task", None), trainer.callbacks)
        self._start, self._pending = time.monotonic(), None
        if self.drawing == "bar":
            bar = {"file": sys.stderr, "dynamic_ncols": True, "mininterval": self.refresh_seconds}
            total = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
            self.rounds = tqdm(total=total, initial=trainer.current_epoch, desc="round", unit="round", **bar)
            self.clients = tqdm(total=0, desc="clients", unit="client", position=1, leave=False, **bar)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)
        if self.clients is not None:
            self.clients.reset(total=len(getattr(trainer.train_dataloader, "clients", ())))

    def on_train_client_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, cid: int) -> None:
        """After each trained client (called by ``FederatedModule.training_step``: a round is one Lightning batch)."""
        if self.clients is not None:
            self.clients.update()  # redraws only when refresh_seconds have passed

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluated = self._evaluated or not trainer.sanity_checking

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending = trainer.current_epoch + 1

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)
        self._close()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    # ------------------------------------------------------------------ drawing
    def _report(self, trainer: pl.Trainer) -> None:
        """The finished round's loss and, if it was evaluated, its headline metrics: the bar's postfix or a line."""
        done, evaluated = self._pending, self._evaluated
        self._pending, self._evaluated = None, False
        if done is None or self.drawing == "off":
            return
        metrics = trainer.callback_metrics
        values = {LOSS: float(metrics[LOSS])} if LOSS in metrics else {}
        if self.rounds is not None:
            self.rounds.set_postfix_str(_fmt(values | present(metrics, self._names, ("val", "test"))), refresh=False)
            self.rounds.n = done
            self.rounds.refresh()  # once a round, whatever refresh_seconds: the postfix is always the latest
        elif self.drawing == "lines" and (evaluated or done == trainer.max_epochs):
            values |= present(metrics, self._names, ("val", "test")) if evaluated else {}
            fields = [f"round {done}/{trainer.max_epochs}", _fmt(values), f"{time.monotonic() - self._start:.1f} s"]
            print("  ".join(f for f in fields if f), flush=True)

    def _close(self) -> None:
        for bar in (self.clients, self.rounds):
            if bar is not None:
                bar.close()
        self.clients = self.rounds = None
