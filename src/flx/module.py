"""``FederatedModule``: the LightningModule of a federated run, and its build.

It owns the single reused net, the :class:`~flx.federation.Federation` and the task (:mod:`flx.tasks`: the loss the
local steps minimise and the evaluation metrics). ``training_step`` receives a round's shard of client ids (the
round is one Lightning batch) and trains them; evaluation of the global model runs in Lightning's validation/test
loops. This file holds the build (the federation, whole, when a fit or a lone validate / test starts), the training
hooks and the checkpoint hooks; the module delegates the rest, each concern to one place:

- :mod:`flx.module_eval` (:class:`~flx.module_eval.Evaluator`): the validation/test steps and epoch ends, the
  divergence check, the personalised models' evaluation;
- :mod:`flx.module_logging` (:class:`~flx.module_logging.Reporter`, :func:`~flx.module_logging.metric_names`): what
  is logged and under which keys: the round's row, the evaluation's metrics, W&B's per-client tables.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import WandbLogger
from torch import Tensor, nn
from typing_extensions import override

from flx.federation import Federation, FederationSpec
from flx.hooks import FederatedCallback
from flx.metrics.dtype import logged_dtype
from flx.module_eval import Evaluator
from flx.module_logging import Reporter
from flx.module_logging import metric_names as metric_names  # re-exported: flx.run and the tests import it from here
from flx.tasks import Classification, Task


def _all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled through the process group)."""
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


class FederatedModule(pl.LightningModule):
    """Task wrapper.

    Args:
        net: the model (maps ``(B, *input_shape)`` to the task's outputs: logits ``(B, C)``, a binary task may use
            one logit ``(B, 1)``, see :mod:`flx.models.heads`; a regression task one column per target).
        federation: what the round protocol is built from (:class:`~flx.federation.FederationSpec`); the
            :class:`~flx.federation.Federation` itself is built, whole, when the fit starts (``self.federation``).
        num_classes: number of classes ``C`` (0 for real-valued targets).
        num_clients: number of clients (the size of the per-client metrics), or one such size per split (``val``,
            ``test``, and the side splits of unseen clients, ``participating`` and ``unseen``): 0 for a split without
            per-client evaluation rows, whose per-client metrics are never updated (no ``C``-sized counters for a
            million clients that nothing measures).
        fingerprint: what a checkpoint of this run must agree with to be resumed (:func:`flx.resume.fingerprint`);
            saved in every checkpoint.
        task: the loss and the metrics (:mod:`flx.tasks`); default :class:`~flx.tasks.Classification`.
    """

    def __init__(
        self,
        net: nn.Module,
        federation: FederationSpec,
        num_classes: int,
        num_clients: int | Mapping[str, int],
        fingerprint: dict[str, Any] | None = None,
        task: Task | None = None,
    ) -> None:
        super().__init__()
        self.net, self.spec, self.fingerprint = net, federation, dict(fingerprint or {})
        self.federation: Federation | None = None  # built, whole, when a fit (or a lone validate / test) starts
        self._restored: dict[str, Any] | None = None  # a checkpoint's federation state, loaded into it when built
        self._part_states: dict[str, Any] = {}  # a checkpoint's part states, loaded once the parts are attached
        self.task = task if task is not None else Classification()
        self.automatic_optimization = False
        sizes = dict.fromkeys(("val", "test"), 0 if isinstance(num_clients, Mapping) else num_clients)
        sizes |= num_clients if isinstance(num_clients, Mapping) else {}  # with unseen clients: their side splits too
        self.metrics = nn.ModuleDict({s: self.task.metrics(num_classes, n) for s, n in sizes.items()})
        # the dtype of logged values and of the metrics' results: float64 in a float64 run (set in setup)
        self.logged_dtype = torch.float32
        self.reporter = Reporter(self)  # what is logged: the round's row, the evaluation's metrics, W&B tables
        self.evaluator = Evaluator(self)  # the validation/test steps and epoch ends

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def loss_fn(self, outputs: Tensor, target: Tensor) -> Tensor:
        """The task's batch-mean loss: what the local steps minimise."""
        return self.task.loss(outputs, target)

    def configure_optimizers(self) -> None:
        return None  # local optimizers live in the federation, the server optimizer too

    def setup(self, stage: str) -> None:
        # each client's evaluation loss and rows feed only W&B's per-client table: without W&B they are not computed
        # (a per-client loss per batch and a sync per evaluation); the loggers are the same on every rank
        tracked = any(isinstance(lg, WandbLogger) for lg in self.trainer.loggers)
        self.logged_dtype = logged_dtype(self.trainer)
        for metrics in self.metrics.values():
            metrics.track_client_loss = tracked
        # before Lightning restores a checkpoint (after setup, before on_fit_start): a disk store must load it into
        # this rank's folder
        self.spec.store.bind_rank(self.trainer.global_rank, self.trainer.world_size)

    @override
    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """Lightning's ``log``, except that in a float64 run a Python number is logged as a float64 tensor:
        Lightning would make it one of the default dtype, float32 in the epoch-end hooks (:mod:`flx.metrics.dtype`).
        The parts' ``log`` and ``log_dict`` calls come through here too."""
        if self.logged_dtype == torch.float64 and isinstance(value, numbers.Number):
            value = torch.tensor(value, dtype=torch.float64, device=self.device)
        super().log(name, value, *args, **kwargs)

    # ------------------------------------------------------------------ federated training
    def on_fit_start(self) -> None:
        self._build_federation()

    def on_validation_start(self) -> None:
        if self.federation is None:  # trainer.validate without a fit: the model as built, or as a checkpoint has it
            self._build_federation()

    def on_test_start(self) -> None:
        if self.federation is None:
            self._build_federation()

    def _build_federation(self) -> None:
        """The federation, whole: the spec with the net, the client store on the net's device, the parts and the
        process group; a checkpoint's federation state restored before it existed is loaded into it."""
        trainer, dm = self.trainer, self.trainer.datamodule
        dtype = next(self.net.parameters()).dtype
        parts = [cb for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
        self.federation = Federation(
            self.spec,
            self.net,
            dm.clients.to(self.device, dtype),
            self.task.loss,
            parts=parts,
            reduce_sum=lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
            gather=_all_gather_object,
            broadcast=trainer.strategy.broadcast,
            resources=getattr(dm, "server_resources", None),
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            step_context=trainer.precision_plugin.train_step_context,
        )
        if self._restored is not None:
            self.federation.load_state_dict(self._restored)
            self._restored = None
        for part in parts:  # attached first (on_attach made its fresh state), then restored: the state replaces it
            state = self._part_states.pop(part.state_key, None)
            if state:
                part.load_state_dict(state)

    def on_train_start(self) -> None:
        # Lightning callbacks that want a tick per trained client (the progress bar's client bar): the round is one
        # Lightning batch, so on_train_batch_end comes once a round
        hook = "on_train_client_end"
        self._client_listeners = [cb for cb in self.trainer.callbacks if callable(getattr(cb, hook, None))]

    def training_step(self, shard: tuple[int, ...], batch_idx: int) -> None:
        """Trains this rank's clients of the round (``shard``, the round's one batch)."""
        # a round counts as one Lightning optimisation step: trainer.global_step is the rounds done (loggers' step,
        # ModelCheckpoint's every_n_train_steps), the same on every rank
        steps = self.trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        steps.increment_ready()
        steps.increment_completed()
        listeners = getattr(self, "_client_listeners", ())
        after = None
        if listeners:
            trainer = self.trainer

            def after(cid: int) -> None:
                for cb in listeners:
                    cb.on_train_client_end(trainer, self, cid)

        self.federation.train_clients(shard, after)

    def on_train_epoch_end(self) -> None:
        self.reporter.round_end()

    # ------------------------------------------------------------------ evaluation of the global model
    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.evaluator.step("val", batch, dataloader_idx)

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.evaluator.step("test", batch, dataloader_idx)

    def on_validation_epoch_start(self) -> None:
        self.evaluator.epoch_start()

    def on_test_epoch_start(self) -> None:
        self.evaluator.epoch_start()

    def on_validation_epoch_end(self) -> None:
        self.evaluator.epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self.evaluator.epoch_end("test")

    def log_personal_metrics(self, stage: str, name: str) -> None:
        """Each client's personalised model under ``name`` on every split of ``stage`` (``val`` / ``test``) that has
        per-client rows: for a part that evaluates a second personalisation (``Adapt``'s ``also_steps``), from its own
        ``on_{validation,test}_epoch_end``."""
        self.evaluator.personal_metrics(stage, name)

    # ------------------------------------------------------------------ checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["flx"] = {**self.federation.state_dict(), "fingerprint": self.fingerprint}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keeps the federation's state and the parts' for when the federation is built: Lightning restores the
        module (here) before the callbacks, and both before ``on_fit_start``; a part's state taken out of
        ``checkpoint["callbacks"]`` here is loaded after its ``on_attach`` (docs/round_protocol.md, the hook table)."""
        states = checkpoint.get("callbacks") or {}
        for part in (cb for cb in self.trainer.callbacks if isinstance(cb, FederatedCallback)):
            if part.state_key in states:
                state = states.pop(part.state_key)
                if self.federation is None:
                    self._part_states[part.state_key] = state
                elif state:
                    part.load_state_dict(state)
        if "flx" not in checkpoint:
            return
        if self.federation is None:  # Lightning restores the module before on_fit_start builds the federation
            self._restored = checkpoint["flx"]
        else:
            self.federation.load_state_dict(checkpoint["flx"])
