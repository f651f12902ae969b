"""The Lightning loop override: one Lightning epoch is one federated round, and its one "batch" is the round's clients.

``trainer.fit`` runs the whole federated training. Lightning's fit loop and epoch loop are subclassed
(installed by :func:`install`) so that

* before ``on_train_epoch_start`` the round's cohort is sampled and sharded,
* the round's single training "batch" is this rank's shard of client ids, trained one after the other by
  ``training_step`` (manual optimization) without Lightning's per-batch machinery between two clients (its hooks,
  logger and progress bookkeeping cost as much as several local steps of a small model),
* after that batch, and before Lightning's validation check, the round is reduced and the server step runs (every
  rank, even one with no client this round),

while callbacks, loggers, checkpointing, precision and the validation loop run unchanged.

Signals are flx's (:mod:`flx.signals`): at fit start and at each round boundary every rank takes rank 0's pending
signal (one broadcast per round, in place of the one Lightning's epoch loop makes for its own SIGTERM flag) and the
run stops there, after the round's checkpoint. Lightning's signal connector is switched off (:class:`NoSignals`).
Tested against Lightning 2.6 (pinned in ``pyproject.toml``).
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from typing_extensions import override

from flx import signals
from flx.datamodules.round_loader import RoundLoader
from flx.hooks import RoundRefused
from flx.launch import expect_exit

if TYPE_CHECKING:
    from flx.federation import Federation


def _federation(trainer: pl.Trainer) -> Federation:
    fed = getattr(trainer.lightning_module, "federation", None)
    if fed is None:
        raise TypeError("flx loops need a LightningModule with a `federation` attribute (flx.module.FederatedModule)")
    return fed


def client_limit(limit: int | float, shard_len: int) -> int:
    """How many of a shard's ``shard_len`` clients a round trains under ``trainer.limit_train_batches``: an int caps
    the clients per rank and round, a fraction keeps that share (at least one)."""
    if isinstance(limit, int):
        return min(shard_len, limit)
    return min(shard_len, max(1, int(shard_len * limit))) if shard_len else 0


class FederatedFitLoop(_FitLoop):
    """Fit loop whose epochs are rounds: samples the round before the epoch-start hooks run.

    ``client_limit`` (``trainer.limit_train_batches`` of the config, None: all): at most that many clients per rank
    and round (an int) or that share of the shard (a float). Without it the Trainer's own ``limit_train_batches``
    applies the same way (``fast_dev_run`` sets it to 1).
    """

    def __init__(self, *args: Any, client_limit: int | float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.client_limit = client_limit
        self.signal = 0  # rank 0's signal, taken by every rank (flx.signals); the run stops on it
        self.clock: float | None = None  # rank 0's time.monotonic() at the last round boundary, the same on every rank
        self.refused: RoundRefused | None = None  # a part refused the next round (a privacy budget): fit ended there

    @override
    def on_run_start(self) -> None:
        # before the on_train_start hooks, which see it: a signal of the start-up's last steps stops the run before
        # its first round, with nothing to save
        if self._take_signal():
            signals.stopping(signals.Stop(self.signal))
        super().on_run_start()

    @override
    def on_advance_end(self) -> None:
        # after the round's validation, before its epoch-end hooks: RoundCheckpoint saves the round when it is set
        if self._take_signal():
            signals.stopping(signals.Stop(self.signal, rounds=self.trainer.current_epoch + 1))
        elif self.trainer.current_epoch + 1 < (self.trainer.max_epochs or 0):
            self._look_ahead(_federation(self.trainer))
        super().on_advance_end()
        # the round's row (Reporter.log_round, joined by what Lightning logged at the round's end) is written
        # now, whether or not Lightning had a row of its own to write
        for logger in self.trainer.loggers:
            logger.save()

    def _take_signal(self) -> int:
        """Rank 0's pending signal on every rank (a collective: all ranks must stop at the same round), once; with it
        rank 0's clock (:attr:`clock`), so that what the round boundary decides by the wall time (the checkpoint's
        schedule) is decided alike on every rank without a second collective."""
        if not self.signal:
            mine = (signals.pending(), time.monotonic())
            signum, self.clock = self.trainer.strategy.broadcast(mine, src=0) if self.trainer.world_size > 1 else mine
            self.signal = int(signum)
            self.trainer.should_stop = self.trainer.should_stop or bool(self.signal)
        return self.signal

    @override
    def on_advance_start(self) -> None:
        self.setup_data()
        loader = self._combined_loader.flattened[0] if self._combined_loader is not None else None
        if not isinstance(loader, RoundLoader):
            raise TypeError(
                "flx needs the train dataloader to be a flx.datamodules.round_loader.RoundLoader"
                " (use FederatedDataModule)"
            )
        try:
            rnd = _federation(self.trainer).begin_round(self.trainer.current_epoch)
        except RoundRefused as refusal:  # every rank refuses alike (the same draws and ledger): fit ends before it
            self._refuse(refusal)
            raise StopIteration from None
        loader.clients = rnd.shard[: client_limit(self.limit, len(rnd.shard))]
        self.max_batches = 1
        super().on_advance_start()

    def _look_ahead(self, fed: Federation) -> None:
        """A part that refuses the next round stops the run now, so the epoch-end hooks save this round as a stop
        (:class:`flx.callbacks.checkpoint.RoundCheckpoint`); the round a run starts with is asked in ``begin_round``."""
        line = fed.refusal(self.trainer.current_epoch + 1)
        if line is not None:
            self._refuse(RoundRefused(line))

    def _refuse(self, refusal: RoundRefused) -> None:
        """Ends fit before the refused round (its epoch never starts: no hooks, no checkpoint of it); rank 0 says why
        at once, and the other ranks' exit with its status is expected (:func:`flx.launch.expect_exit`)."""
        self.refused = refusal
        self.trainer.should_stop = True
        expect_exit(RoundRefused.status)
        if self.trainer.is_global_zero:
            print(f"flx: {refusal}; exit status {RoundRefused.status}", file=sys.stderr, flush=True)

    @property
    def limit(self) -> int | float:
        """The cap on the clients per rank and round in force (see the class docstring)."""
        return self.client_limit if self.client_limit is not None else self.trainer.limit_train_batches


class FederatedEpochLoop(_TrainingEpochLoop):
    """Epoch loop with one batch, the round's clients; ends the round before Lightning's validation check."""

    @override
    def on_run_start(self, data_fetcher: Any) -> None:
        iter(data_fetcher)  # a fresh iterator over this round's shard (sampled in the fit loop)
        data_fetcher.fetched += self.batch_progress.current.ready
        data_fetcher._start_profiler = self._on_before_fetch
        data_fetcher._stop_profiler = self._on_after_fetch

    @override
    def on_advance_end(self, data_fetcher: Any) -> None:
        if self._num_ready_batches_reached():
            _federation(self.trainer).end_round()
        super().on_advance_end(data_fetcher)

    @override
    def _broadcast_sigterm_tensor(self) -> None:
        pass  # Lightning's SIGTERM flag is never set (NoSignals); FederatedFitLoop takes flx's at the round's end


class NoSignals(_SignalConnector):
    """Lightning's signal connector, switched off: flx handles the signals (:mod:`flx.signals`). Lightning's would
    put its SIGTERM handler in front of flx's; that handler broadcasts from inside the signal handler on one rank (a
    collective the other ranks do not join), and the ``SIGTERMException`` it raises at the epoch's end ends fit with
    exit status 0 and without the round's checkpoint."""

    @override
    def register_signal_handlers(self) -> None:
        pass

    @override
    def teardown(self) -> None:
        pass


class FederatedDDPStrategy(DDPStrategy):
    """DDP process group without the DDP model wrapper.

    Ranks train different clients, so gradients must not be all-reduced per step; the federation does
    one explicit reduce per round instead (``strategy.reduce``).
    """

    strategy_name = "flx_ddp"

    @override
    def configure_ddp(self) -> None:
        pass  # keep the bare LightningModule: no per-step gradient sync


def install(trainer: pl.Trainer, client_limit: int | float | None = None) -> pl.Trainer:
    """Replaces the trainer's fit and epoch loops with the federated ones (before ``fit``) and Lightning's signal
    connector with :class:`NoSignals`; ``client_limit``: see :class:`FederatedFitLoop`."""
    old = trainer.fit_loop
    fit_loop = FederatedFitLoop(
        trainer, min_epochs=old.min_epochs, max_epochs=old.max_epochs, client_limit=client_limit
    )
    fit_loop.epoch_loop = FederatedEpochLoop(trainer, min_steps=old.epoch_loop.min_steps, max_steps=old.max_steps)
    trainer.fit_loop = fit_loop
    trainer._signal_connector = NoSignals(trainer)
    return trainer
