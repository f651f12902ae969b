"""The global model's evaluation in Lightning's validation/test loops, for :class:`~flx.module.FederatedModule`:
``val/*`` on the validation split (``data.val_fraction`` of the training rows), ``test/*`` on the test split (also
inside the validation loop with ``eval_test``), each loader feeding the split's overall and per-client metrics as the
datamodule's ``eval_plan`` says; at the loop's end the ranks' sums are added up, a non-finite validation loss stops the
run as diverged, and with a part that personalises each client's personalised model is measured on its own rows
(:func:`flx.evaluation.evaluate_clients`). With unseen clients (``partition.unseen_clients``) the test split brings two
side splits of training-store rows, ``participating/*`` and ``unseen/*`` (and the unseen clients' personalised models,
``unseen/personal_*``). What is logged, and under which keys: :mod:`flx.module_logging`.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor

from flx.faults import Diverged
from flx.metrics.sync import reduce_sums, summed


class Evaluator:
    """The module's validation/test steps and epoch ends.

    Args:
        module: the :class:`~flx.module.FederatedModule` whose net, metrics, federation and reporter it uses.
    """

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module

    def step(self, stage: str, batch: tuple[Tensor, ...], dataloader_idx: int) -> None:
        """One batch of ``stage``'s (``val`` / ``test``) loader ``dataloader_idx`` through the global model."""
        # which split (val: the validation rows, test: the test split) this loader is and what it feeds: see eval_plan
        module = self.module
        dm = module.trainer.datamodule
        split, overall, per_client = dm.eval_plan(stage)[dataloader_idx]
        x = batch[0]
        if x.is_floating_point():  # integer token ids stay int64
            x = x.to(next(module.net.parameters()).dtype)
        outputs = module.net(x)
        if overall:
            module.metrics[split].update(outputs, batch[1])
        if per_client:  # the batch's last tensor: each row's cell, counted for every client that holds it
            module.metrics[split].update_clients(outputs, batch[1], batch[-1], dm.client_cells(split))

    def epoch_start(self) -> None:
        # after Lightning moved the module: see SplitMetrics.set_value_dtype
        for metrics in self.module.metrics.values():
            metrics.set_value_dtype(self.module.logged_dtype)

    def epoch_end(self, stage: str) -> None:
        """The splits ``stage`` evaluated: their sums added up over the ranks, checked (``val``) and logged, and the
        personalised models measured where a part personalises and the split has per-client rows."""
        module = self.module
        dm, reporter = module.trainer.datamodule, module.reporter
        reporter.eval_round()
        splits = list(dict.fromkeys(loader.split for loader in dm.eval_plan(stage)))
        if module.trainer.world_size > 1:  # each rank evaluated a share of the rows: one all-reduce adds them up
            summed_metrics = [m for split in splits for m in summed(module.metrics[split])]
            reduce_sums(summed_metrics, lambda t: module.trainer.strategy.reduce(t, reduce_op="sum"))
        for split in splits:
            if stage == "val":
                self.check_finite(split)
            reporter.log_split(split, dm.has_client_rows(split))
            if dm.has_personal_rows(split) and module.federation.parts_with("personalize"):
                self.personal(split)

    def personal_metrics(self, stage: str, name: str) -> None:
        """:meth:`personal` under ``name`` on every split of ``stage`` (``val`` / ``test``) that has per-client rows
        (``unseen``: the unseen clients' held-out rows)."""
        dm = self.module.trainer.datamodule
        for split in dict.fromkeys(loader.split for loader in dm.eval_plan(stage)):
            if dm.has_personal_rows(split):
                self.personal(split, name)

    def personal(self, split: str, name: str = "personal") -> None:
        """Each client's personalised model (the parts' ``personalize``) on its own evaluation rows of ``split``,
        logged under ``name`` (:meth:`flx.module_logging.Reporter.log_personal`)."""
        module = self.module
        data = module.trainer.datamodule.client_eval_data(split).to(module.device, next(module.net.parameters()).dtype)
        per_client = module.federation.evaluate_clients(data, module.task.client_metric)
        module.reporter.log_personal(split, name, per_client)

    def check_finite(self, split: str) -> None:
        """A non-finite loss of the global model during fit: the run stops as diverged (never ends with it)."""
        module = self.module
        if not torch.isfinite(module.metrics[split].loss.compute()):
            raise Diverged(
                f"diverged in round {module.federation.server.round}: the global model's {split} loss is not finite; "
                f"{module.federation.divergence_cause()}"
            )
