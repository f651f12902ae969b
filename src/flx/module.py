"""``FederatedModule``: the LightningModule of a federated run.

It owns the single reused net, the :class:`~flx.federation.Federation` and the task (:mod:`flx.tasks`: the loss the
local steps minimise and the evaluation metrics). ``training_step`` receives a client id (one "batch" = one client)
and trains that client; evaluation of the global model runs in Lightning's validation/test loops: ``val/*`` on the
validation split (``data.val_fraction`` of the training rows), ``test/*`` on the test split (also inside the
validation loop with ``eval_test``). Metric keys (the task's): classification ``val/acc``, ``val/loss``,
``val/client_acc_{mean,worst,std}``, binary tasks also ``val/auroc``, ``val/pauc_0.3``, ``val/pauc_0.5``; regression
``val/loss``, ``val/mse``, ``val/rmse``, ``val/client_mse_{mean,worst,std}``; ``test/*`` likewise, round-level keys
under ``fl/`` (``round``: communication rounds so far, ``local_steps``: local iterations per client so far,
``cohort``, ``samples``), simulated time under ``sim/`` (``round_time``, ``clock``: seconds, with a ``system``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import WandbLogger
from torch import Tensor, nn
from typing_extensions import override

from flx.faults import Diverged
from flx.federation import Federation, FederationSpec
from flx.hooks import FederatedCallback, overrides
from flx.metrics.client_summary import SPREAD, spread, summarize
from flx.metrics.dtype import logged_dtype
from flx.metrics.sync import reduce_sums, summed
from flx.tasks import Classification, Task
from flx.wandb_logging import ROUND, log_wandb, wandb_loggers


def metric_names(task: Task, parts: list[Any], datamodule: Any, simulated: bool) -> tuple[str, ...]:
    """Every key a run of this module logs into Lightning's metrics during fit (``trainer.callback_metrics``: what
    ``checkpoint.monitor`` may name), known at build time: ``train/loss``, ``fl/round``, ``sim/round_time`` and
    ``sim/clock`` (``simulated``: a ``system``), each evaluated split's task metrics (:meth:`Task.metric_names`) and
    personalised summaries (``{split}/personal_<key>_{mean,worst,p10}`` with a part that personalises), and the parts'
    own (``traits.metrics``; ``{split}`` expanded, ``*`` patterns kept).

    Args:
        task: the run's task.
        parts: the algorithm's parts (others are skipped).
        datamodule: the set-up :class:`~flx.datamodules.datamodule.FederatedDataModule`.
        simulated: whether the run has a simulated system (``system=``).
    """
    fed_parts = [p for p in parts if isinstance(p, FederatedCallback)]
    names = ["train/loss", ROUND, *(("sim/round_time", "sim/clock") if simulated else ())]
    personal = any(overrides(p, "personalize") for p in fed_parts)
    splits = list(dict.fromkeys(loader.split for loader in datamodule.eval_plan("val")))
    for split in splits:
        rows = datamodule.has_client_rows(split)
        names += [f"{split}/{n}" for n in task.metric_names(datamodule.data.num_classes, rows)]
        names += [f"{split}/personal_{task.client_key}_{k}" for k in SPREAD] if personal and rows else []
    for part in fed_parts:
        for name in part.traits.metrics:
            names += [name.format(split=s) for s in splits] if "{split}" in name else [name]
    return tuple(dict.fromkeys(names))


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
            ``test``): 0 for a split without per-client evaluation rows, whose per-client metrics are never updated
            (no ``C``-sized counters for a million clients that nothing measures).
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
        sizes = num_clients if isinstance(num_clients, Mapping) else dict.fromkeys(("val", "test"), num_clients)
        self.metrics = nn.ModuleDict({s: self.task.metrics(num_classes, sizes[s]) for s in ("val", "test")})
        # the dtype of logged values and of the metrics' results: float64 in a float64 run (set in setup)
        self.logged_dtype = torch.float32

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
        # the round's scalars: the mean local loss of the round's aggregated clients, summed over ranks in the round's
        # one all-reduce (Federation.train_loss), so it is the same on every rank and costs no collective of its own,
        # and the simulated seconds (docs/systems.md; published even without a logger, for the curves)
        values = {}
        loss = self.federation.train_loss
        if loss is not None:
            values["train/loss"] = loss
        clock = self.federation.clock
        if clock is not None:
            values |= {"sim/round_time": clock.round_time, "sim/clock": clock.elapsed}
        published = self.publish(values)
        if not self.loggers:
            return
        rnd = self.federation.rnd
        samples = sum(self.federation.num_samples(c) for c in rnd.cohort)
        faults = self.federation.faults
        counts = {"fl/round": float(rnd.round + 1), "fl/cohort": float(len(rnd.cohort)), "fl/samples": float(samples)}
        counts |= {"fl/dropped_clients": float(len(faults.dropped)), "fl/skipped_clients": float(len(faults.skipped))}
        if self.federation.cfg.local_epochs is None:  # local iterations so far, per client (AFL: one per round)
            counts["fl/local_steps"] = float((rnd.round + 1) * self.federation.cfg.local_steps)
        self.log_round({**published, **counts})

    def publish(self, values: Mapping[str, float]) -> dict[str, float]:
        """Puts round-level scalars into ``trainer.callback_metrics`` (what the bar, the curves, ``checkpoint.monitor``
        and Lightning's monitoring callbacks read) as ``self.log(name, value, on_epoch=True)`` would at the round's
        end: scalars of :attr:`logged_dtype` (float32; float64 in a float64 run), after the plain callbacks' and
        before the monitoring callbacks' ``on_train_epoch_end``. Not through ``self.log``: Lightning's result
        collection moves the whole metric object to the value's device at every call, a tenth of the overhead of a
        small model's round (docs/performance.md); the loggers get the values from :meth:`log_round`.
        Returns the values as the loggers write them (rounded to :attr:`logged_dtype` on the host: no device sync)."""
        host = {k: torch.tensor(v, dtype=self.logged_dtype) for k, v in values.items()}
        self.trainer.callback_metrics.update({k: t.to(self.device) for k, t in host.items()})
        return {k: t.item() for k, t in host.items()}

    def log_round(self, values: dict[str, float]) -> None:
        """Sends round-level scalars to every logger, in one row per round: at the step of the round's last batch,
        ``trainer.global_step - 1`` (the 0-based round: a round is one step), plus ``epoch``, as Lightning logs
        epoch-end metrics. Identical on every rank (rank zero writes). One logger call, not a ``self.log`` per key.
        Values the parts log with ``self.log`` at the round's end join the row (``flx.loggers.CSVLogger`` merges a
        step's calls until it writes); :meth:`flx.loop.FederatedFitLoop.on_advance_end` writes the row.
        """
        for logger in self.loggers:
            logger.log_metrics({**values, "epoch": self.current_epoch}, step=self.trainer.global_step - 1)

    # ------------------------------------------------------------------ evaluation of the global model
    def _eval_step(self, stage: str, batch: tuple[Tensor, ...], dataloader_idx: int) -> None:
        # which split (val: the validation rows, test: the test split) this loader is and what it feeds: see eval_plan
        dm = self.trainer.datamodule
        split, overall, per_client = dm.eval_plan(stage)[dataloader_idx]
        x = batch[0]
        if x.is_floating_point():  # integer token ids stay int64
            x = x.to(next(self.net.parameters()).dtype)
        outputs = self.net(x)
        if overall:
            self.metrics[split].update(outputs, batch[1])
        if per_client:  # the batch's last tensor: each row's cell, counted for every client that holds it
            self.metrics[split].update_clients(outputs, batch[1], batch[-1], dm.client_cells(split))

    def validation_step(self, batch: tuple[Tensor, ...], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step("val", batch, dataloader_idx)

    def test_step(self, batch: tuple[Tensor, ...], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step("test", batch, dataloader_idx)

    def _eval_epoch_end(self, stage: str) -> None:
        dm = self.trainer.datamodule
        if self.loggers:  # the round the evaluated model comes from: the x-axis of the evaluation's metrics
            self.log(ROUND, float(self.federation.server.round), add_dataloader_idx=False)
        splits = list(dict.fromkeys(loader.split for loader in dm.eval_plan(stage)))
        if self.trainer.world_size > 1:  # each rank evaluated a share of the rows: one all-reduce adds them up
            summed_metrics = [m for split in splits for m in summed(self.metrics[split])]
            reduce_sums(summed_metrics, lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"))
        for split in splits:
            if stage == "val":
                self._check_finite(split)
            self._log_split(split, dm.has_client_rows(split))
            if dm.has_client_rows(split) and self.federation.parts_with("personalize"):
                self._log_personal(split)

    def log_personal_metrics(self, stage: str, name: str) -> None:
        """:meth:`_log_personal` under ``name`` on every split of ``stage`` (``val`` / ``test``) that has per-client
        rows: for a part that evaluates a second personalisation (``Adapt``'s ``also_steps``), from its own
        ``on_{validation,test}_epoch_end``."""
        dm = self.trainer.datamodule
        for split in dict.fromkeys(loader.split for loader in dm.eval_plan(stage)):
            if dm.has_client_rows(split):
                self._log_personal(split, name)

    def _log_personal(self, split: str, name: str = "personal") -> None:
        """Each client's personalised model (the parts' ``personalize``) on its own evaluation rows of ``split``:
        ``{split}/<name>_<key>_{mean,worst,p10}`` (``<key>``: the task's per-client metric), and on W&B the
        per-client table and bar chart."""
        data = self.trainer.datamodule.client_eval_data(split).to(self.device, next(self.net.parameters()).dtype)
        per_client = self.federation.evaluate_clients(data, self.task.client_metric)
        key = self.task.client_key
        for k, v in spread(per_client, self.task.higher_is_better).items():
            self.log(f"{split}/{name}_{key}_{k}", v.to(self.logged_dtype), add_dataloader_idx=False)
        self._log_client_table(split, {f"{name}_{key}": per_client})

    def _check_finite(self, split: str) -> None:
        """A non-finite loss of the global model during fit: the run stops as diverged (never ends with it)."""
        if not torch.isfinite(self.metrics[split].loss.compute()):
            raise Diverged(
                f"diverged in round {self.federation.server.round}: the global model's {split} loss is not finite; "
                f"{self.federation.divergence_cause()}"
            )

    def _log_split(self, split: str, per_client_rows: bool) -> None:
        metrics = self.metrics[split]
        for key, value in metrics.values().items():
            self.log(f"{split}/{key}", value, add_dataloader_idx=False)
        if per_client_rows and metrics.client_key is not None:
            per_client, key = metrics.client_values(), metrics.client_key
            for k, v in summarize(per_client, metrics.higher_is_better).items():
                self.log(f"{split}/client_{key}_{k}", v, add_dataloader_idx=False)
            columns = {key: per_client}
            loss_rows = metrics.client_loss_values()
            if loss_rows is not None:
                columns |= {"loss": loss_rows[0], "samples": loss_rows[1]}
            self._log_client_table(split, columns)

    def on_validation_epoch_start(self) -> None:
        for metrics in self.metrics.values():  # after Lightning moved the module: see SplitMetrics.set_value_dtype
            metrics.set_value_dtype(self.logged_dtype)

    def on_test_epoch_start(self) -> None:
        self.on_validation_epoch_start()

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def _log_client_table(self, split: str, columns: dict[str, Tensor]) -> None:
        """W&B, rank zero: the table ``{split}/client_<key>_table``, with ``<key>`` the first column's name, and a bar
        chart of that column, ``{split}/client_<key>_bar``. One row per client with evaluation rows: ``client``, the
        ``columns`` (the global model's: the task's per-client metric, ``loss``, ``samples``: its evaluation rows),
        ``train_samples`` (its training rows) and ``sampled`` (in the cohort of the round the model comes from)."""
        loggers = wandb_loggers(self.trainer)
        if not loggers:
            return
        import wandb

        key, fed = next(iter(columns)), self.federation
        cohort, values = set(fed.cohort), {k: v.tolist() for k, v in columns.items()}
        rows = [
            [c, *(v[c] for v in values.values()), fed.num_samples(c) if c < fed.num_clients else 0, c in cohort]
            for c, a in enumerate(values[key])
            if not math.isnan(a)
        ]
        table = wandb.Table(columns=["client", *columns, "train_samples", "sampled"], data=rows)
        model = "the personalised models" if key.startswith("personal_") else "the global model"
        title = f"{split}: {'accuracy' if key == 'acc' else key} of {model} per client"
        bar = wandb.plot.bar(table, "client", key, title=title)
        tables = {f"{split}/client_{key}_table": table, f"{split}/client_{key}_bar": bar}
        log_wandb(self.trainer, tables | {ROUND: float(fed.server.round)})  # in the round's row, with the round

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
