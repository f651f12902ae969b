"""The Lightning loop override: one Lightning epoch is one federated round, one "batch" is one client.

``trainer.fit`` runs the whole federated training. Lightning's fit loop and epoch loop are subclassed
(installed by :func:`install`) so that

* before ``on_train_epoch_start`` the round's cohort is sampled and sharded (so the progress bar's total
  is this rank's number of clients in the round),
* each training "batch" is a client id, trained by ``training_step`` (manual optimization),
* after the round's last client, and before Lightning's validation check, the round is reduced and the
  server step runs (every rank, even one that finished its clients early),

while callbacks, loggers, checkpointing, precision and the validation loop run unchanged.
Tested against Lightning 2.6 (pinned in ``pyproject.toml``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

if TYPE_CHECKING:
    from flx.federation import Federation


IDLE = -1  # a padding slot: the rank has no client left this round but keeps step with the others


class RoundLoader:
    """The train "dataloader": yields this rank's client ids of the current round.

    Every rank yields the same number of items (shorter shards are padded with :data:`IDLE`), because
    Lightning runs collectives per batch in DDP; an idle slot trains nothing. It has no ``__len__`` on
    purpose: the loop sets ``max_batches`` itself at each round start.
    """

    def __init__(self) -> None:
        self.clients: tuple[int, ...] = ()

    def __iter__(self) -> Iterator[int]:
        return iter(self.clients)


def _federation(trainer: pl.Trainer) -> Federation:
    fed = getattr(trainer.lightning_module, "federation", None)
    if fed is None:
        raise TypeError("flx loops need a LightningModule with a `federation` attribute (flx.models.FederatedModule)")
    return fed


class FederatedFitLoop(_FitLoop):
    """Fit loop whose epochs are rounds: samples the round before the epoch-start hooks run."""

    @override
    def on_advance_start(self) -> None:
        self.setup_data()
        loader = self._combined_loader.flattened[0] if self._combined_loader is not None else None
        if not isinstance(loader, RoundLoader):
            raise TypeError("flx needs the train dataloader to be a flx.loop.RoundLoader (use FederatedDataModule)")
        rnd = _federation(self.trainer).begin_round(self.trainer.current_epoch)
        loader.clients = rnd.shard + (IDLE,) * (rnd.slots - len(rnd.shard))
        limit = self.trainer.limit_train_batches
        n = rnd.slots
        self.max_batches = min(n, limit) if isinstance(limit, int) else max(1, int(n * limit))
        super().on_advance_start()


class FederatedEpochLoop(_TrainingEpochLoop):
    """Epoch loop whose batches are clients; ends the round before Lightning's validation check."""

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


class FederatedDDPStrategy(DDPStrategy):
    """DDP process group without the DDP model wrapper.

    Ranks train different clients, so gradients must not be all-reduced per step; the federation does
    one explicit reduce per round instead (``strategy.reduce``).
    """

    strategy_name = "flx_ddp"

    @override
    def configure_ddp(self) -> None:
        pass  # keep the bare LightningModule: no per-step gradient sync


def install(trainer: pl.Trainer) -> pl.Trainer:
    """Replaces the trainer's fit and epoch loops with the federated ones (before ``fit``)."""
    old = trainer.fit_loop
    fit_loop = FederatedFitLoop(trainer, min_epochs=old.min_epochs, max_epochs=old.max_epochs)
    fit_loop.epoch_loop = FederatedEpochLoop(trainer, min_steps=old.epoch_loop.min_steps, max_steps=old.max_steps)
    trainer.fit_loop = fit_loop
    return trainer
