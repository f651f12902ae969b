"""Round-boundary checkpoints: crash-safe by default, a best-validation copy on request, SLURM requeue.

At the end of a round (after the server step, validation and every part's epoch-end hook) the whole run state is
written: the global model, Lightning's loop progress, every part's ``state_dict``, the server optimizer and the
per-client state store (``checkpoint["flx"]``). A checkpoint is due every ``every_rounds`` rounds and when
``every_seconds`` have passed since the last one, but not sooner than ``min_seconds`` after the last one (or after the
start of training): when rounds are short, a round's due checkpoint is skipped until that much wall time has passed,
so checkpoints cost at most one write every ``min_seconds``. Times are rank 0's clock at the round boundaries, which
every rank takes with the round's signal (:attr:`flx.loop.FederatedFitLoop.clock`): the ranks agree without a
collective of their own. A kill then redoes at most the rounds of ``min_seconds``
plus the round that ended the wait and the round in progress, to the same final model (resume is exact from any round
file). The floor never delays the checkpoint of the last round, of a round after which the run stops
(``trainer.should_stop``: early stopping, a signal) or of a requeue. Files are
``round_NNNNN.ckpt`` (the state after NNNNN rounds), written atomically (:mod:`flx.checkpoint_io`); ``last.ckpt`` is
a hard link to the newest, so a run killed at any instant resumes from ``checkpoints/last.ckpt``. Only the newest
``keep_last`` round files are kept. With client state on disk (``state_store.backend=disk``) a checkpoint holds a
table of the store's files, and after each save the files that no kept checkpoint (the ``keep_last`` round files,
``best.ckpt``) refers to are removed behind it (:meth:`flx.state.ClientStateStore.retain`).

With ``monitor`` set (e.g. ``val/acc``), ``best.ckpt`` holds the round whose validation value of that metric is the
best so far (``mode`` max or min), judged on rounds where validation ran.

Signals (:mod:`flx.signals`): on SIGTERM, SIGINT, SIGUSR1 or SIGUSR2 the run finishes the current round, writes its
checkpoint (due or not) and stops. In a SLURM job (``requeue``) the ``requeue_signal`` (``sbatch --signal=USR1@120``,
sent to the job's tasks) also asks SLURM to requeue the job (``scontrol requeue``); the requeued job resumes with
``ckpt_path=auto`` (``scripts/slurm/train.sbatch``), or starts afresh when the signal came before the first round.
Lightning's own handler is not used because it writes a checkpoint in the middle of a round, whose partial aggregate
cannot be resumed exactly.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from typing_extensions import override

from flx import signals
from flx.checkpoint_io import (
    LAST,
    AtomicCheckpointIO,
    RoundFiles,
    after_write,
    atomic_link,
    remove_files,
    wait_for_writes,
)
from flx.checkpoint_spec import check_checkpoint
from flx.errors import ConfigError, bad_value
from flx.launch import slurm_job_id
from flx.wandb_logging import close_runs

log = logging.getLogger(__name__)
BEST = "best.ckpt"


def _io(trainer: pl.Trainer) -> Any:
    """The run's checkpoint IO (flx's :class:`~flx.checkpoint_io.AtomicCheckpointIO` writes in the background)."""
    return trainer.strategy.checkpoint_io


def _signal(trainer: pl.Trainer) -> int:
    """The signal the run stops on, as every rank took it (:class:`flx.loop.FederatedFitLoop`), or 0."""
    return int(getattr(trainer.fit_loop, "signal", 0))


def _agreed_clock(trainer: pl.Trainer) -> float | None:
    """Rank 0's ``time.monotonic()`` at this round boundary, taken by every rank with the signal
    (:attr:`flx.loop.FederatedFitLoop.clock`), or None outside flx's fit loop."""
    return getattr(trainer.fit_loop, "clock", None)


class RoundCheckpoint(Checkpoint):
    """Writes round-boundary checkpoints (see the module docstring).

    Args:
        dirpath: folder of the checkpoint files.
        every_rounds: a checkpoint every that many rounds (None: only by time).
        every_seconds: also a checkpoint at the first round end this many seconds after the last one (None: off).
        min_seconds: the least wall time between two checkpoints that ``every_rounds`` or ``every_seconds`` make due
            (0 or None: every due round is written); the last round, a stop and a requeue are always written.
        keep_last: how many ``round_*.ckpt`` files to keep (None: all).
        monitor: metric that selects ``best.ckpt`` (None: no best copy).
        mode: ``max`` or ``min``: which values of ``monitor`` are better.
        requeue: ``auto`` (when running in a SLURM job), ``true`` or ``false``.
        requeue_signal: the signal that asks for a requeue.
        background: write the files in a background thread while training goes on (serialised at the round
            boundary; :mod:`flx.checkpoint_io`), or in the training thread.
    """

    def __init__(
        self,
        dirpath: str,
        every_rounds: int | None = 1,
        every_seconds: float | None = None,
        min_seconds: float | None = None,
        keep_last: int | None = 2,
        monitor: str | None = None,
        mode: str = "max",
        requeue: str | bool = "auto",
        requeue_signal: str = "SIGUSR1",
        background: bool = True,
    ) -> None:
        check_checkpoint(every_rounds, every_seconds, keep_last, mode, requeue, requeue_signal, min_seconds)
        self.dirpath, self.every_rounds, self.every_seconds = str(dirpath), every_rounds, every_seconds
        self.min_seconds = float(min_seconds or 0)
        self.keep_last, self.monitor, self.mode = keep_last, monitor, mode
        self.files = RoundFiles(self.dirpath, keep_last)
        self.requeue = slurm_job_id() is not None if str(requeue).lower() == "auto" else str(requeue).lower() == "true"
        self.requeue_signal = getattr(signal, str(requeue_signal))
        if not isinstance(background, bool):
            raise bad_value("checkpoint.background", background, "allowed: true, false")
        self.background = background
        self.best_score: float | None = None
        self.best_model_path = self.last_model_path = ""
        self.best_round: int | None = None
        self.requeued = False
        self._validated_epoch = -1
        self._last_time = time.monotonic()

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(_io(trainer), AtomicCheckpointIO):
            _io(trainer).background = self.background
        if stage == "fit" and trainer.is_global_zero and (partial := self.files.remove_partial_writes()):
            log.warning("flx: removed %d partly written checkpoint file(s) of an interrupted run: %s", len(partial),
                        ", ".join(partial))  # fmt: skip
        if stage == "fit" and self.requeue:  # train.py catches it from the process start; another caller, from here
            signals.install((self.requeue_signal,))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_time = self._now(trainer)  # the clocks of every_seconds and min_seconds start with the rounds
        signum = _signal(trainer)  # before the first round: nothing to save; requeue at once
        if signum and signals.requeues(signum, self.requeue, self.requeue_signal):
            self._requeue(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_epoch = trainer.current_epoch

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.fast_dev_run or trainer.sanity_checking:
            return
        rounds = trainer.current_epoch + 1
        signum = _signal(trainer)  # the run stops after this round (flx.signals): save it, due or not
        best = self.monitor is not None and self._validated_epoch == trainer.current_epoch and self._improved(trainer)
        if signum or self._due(trainer, rounds):
            self._save_round(trainer, rounds)
            if best and trainer.is_global_zero:
                after_write(_io(trainer), atomic_link, self.last_model_path, self.best_model_path)
            self._release_client_state(trainer)
        elif best:
            trainer.save_checkpoint(self.best_model_path, weights_only=False)
            self._release_client_state(trainer)
        if signum:
            self._stop(trainer, signum)

    # ------------------------------------------------------------------ saving
    def _agree(self, trainer: pl.Trainer, flag: bool) -> bool:
        """Rank 0's decision on every rank (a save is collective: all ranks must take the same branch)."""
        return bool(trainer.strategy.broadcast(flag, src=0)) if trainer.world_size > 1 else flag

    def _now(self, trainer: pl.Trainer) -> float:
        """The clock of the schedule: rank 0's at this round boundary, as every rank took it with the signal
        (:func:`_agreed_clock`), else this process's ``time.monotonic()``."""
        agreed = _agreed_clock(trainer)
        return time.monotonic() if agreed is None else agreed

    def _due(self, trainer: pl.Trainer, rounds: int) -> bool:
        """Whether round ``rounds`` gets a checkpoint (the module docstring's rule). The clock is rank 0's, which
        every rank took at the round boundary with the signal, so the verdict is the same everywhere at no extra
        collective; outside flx's fit loop rank 0's verdict is broadcast in the rounds where the clock decides."""
        if rounds == trainer.max_epochs or trainer.should_stop:
            return True
        scheduled = self.every_rounds is not None and rounds % self.every_rounds == 0
        if not scheduled and self.every_seconds is None:
            return False
        if scheduled and not self.min_seconds:
            return True
        due = self.clock_due(self._now(trainer) - self._last_time, scheduled)
        return due if _agreed_clock(trainer) is not None else self._agree(trainer, due)

    def clock_due(self, elapsed: float, scheduled: bool) -> bool:
        """Whether a round that ends ``elapsed`` seconds after the last checkpoint gets one (``scheduled``: due by
        ``every_rounds``); a pure function of the settings, the rule of :meth:`_due` once the clock is read."""
        timed = self.every_seconds is not None and elapsed >= self.every_seconds
        return (scheduled or timed) and elapsed >= self.min_seconds

    def _save_round(self, trainer: pl.Trainer, rounds: int) -> None:
        path = self.last_model_path = self.files.add(rounds)
        # every rank takes part; rank 0 writes (atomically, flx.checkpoint_io). weights_only=False: the whole training
        # state (loops, parts, server); Lightning logs a line at every save when it is left unset
        trainer.save_checkpoint(path, weights_only=False)
        self._last_time = self._now(trainer)  # the round boundary's (agreed) clock: the next floor counts from there
        old = self.files.prune()
        if trainer.is_global_zero:  # after the file is on disk (the writer runs jobs in order)
            after_write(_io(trainer), self.files.publish, path, old)

    def _release_client_state(self, trainer: pl.Trainer) -> None:
        """A disk state store's files that no kept checkpoint refers to are removed once the checkpoint just written
        and the links to it (``last.ckpt``, ``best.ckpt``) are on disk (:meth:`flx.state.ClientStateStore.retain`);
        on every rank, each in its own folder."""
        store = getattr(getattr(trainer.lightning_module, "federation", None), "store", None)
        if store is None or (self.best_model_path and self.best_round is None):  # a best file of unknown round
            return
        kept = self.files.rounds() | ({self.best_round} if self.best_model_path else set())
        doomed = store.retain(kept)
        if doomed:
            after_write(_io(trainer), remove_files, doomed)

    def _improved(self, trainer: pl.Trainer) -> bool:
        """Whether this round's ``monitor`` value is the best so far; if so it is recorded (before the save, so the
        checkpoint written now carries it)."""
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            logged = ", ".join(sorted(k for k in trainer.callback_metrics if k.startswith(("val/", "train/"))))
            raise ConfigError(f"checkpoint.monitor={self.monitor!r}: not logged by this run; logged: {logged}")
        value = float(value)
        if math.isnan(value) or not (
            self.best_score is None or (value > self.best_score if self.mode == "max" else value < self.best_score)
        ):
            return False
        self.best_score, self.best_model_path = value, os.path.join(self.dirpath, BEST)
        self.best_round = trainer.current_epoch + 1
        return True

    def _stop(self, trainer: pl.Trainer, signum: int) -> None:
        """After the round's save for a signal: requeue, or record where the round is for the stop's line."""
        stop = signals.stopped()
        if stop is not None:
            stop.saved = os.path.join(self.dirpath, LAST)
        if signals.requeues(signum, self.requeue, self.requeue_signal):
            self._requeue(trainer)
        else:
            wait_for_writes(_io(trainer))  # the line says the round is saved: on disk before it is printed

    def _requeue(self, trainer: pl.Trainer) -> None:
        self.requeued, trainer.should_stop = True, True
        wait_for_writes(_io(trainer))  # SLURM stops the job soon after the requeue: the checkpoint on disk first
        close_runs(trainer, preempting=True)  # and the W&B run finished, with this round's rows
        job = slurm_job_id()
        stop = signals.stopped()
        if stop is not None:
            stop.requeued = True  # a SIGTERM from SLURM now ends the process at once, silently
            # printed before `scontrol requeue`: SLURM kills the job step soon after it, and a line printed after
            # fit returns would often be lost
            signals.say(stop)
        if trainer.is_global_zero:
            signals.requeue_job(job)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "best_score": self.best_score,
            "best_model_path": self.best_model_path,
            "best_round": self.best_round,
            "last_model_path": self.last_model_path,
            "saved": list(self.files.saved),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best_score = state_dict.get("best_score")
        self.best_model_path = state_dict.get("best_model_path", "")
        self.best_round = state_dict.get("best_round")
        self.last_model_path = state_dict.get("last_model_path", "")
        self.files.saved = list(state_dict.get("saved", []))
