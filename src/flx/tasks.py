r"""Tasks: what the net's outputs are scored against, in training (the loss) and in evaluation (the metrics).

A task is the ``task=`` config group (``configs/task/``), built with Hydra's ``instantiate`` by :func:`flx.run.build`
and handed to :class:`~flx.module.FederatedModule`. It gives

- ``loss(outputs, target)``: the batch-mean loss. The federation's local steps minimise it (``loss_fn``, also
  ``Federation.eval_loss``) and evaluation logs its mean over a split's rows as ``{split}/loss``;
- optionally ``loss_rows(outputs, target)``: each row's loss, whose mean is ``loss`` (``Classification``): vectorised
  clients (``algo.vectorize``) then score the whole stack in one call;
- ``targets`` and ``target_dtype``: class labels (int64) or real values (float32 in the store, cast once to the
  net's dtype: :class:`~flx.datamodules.datamodule.ClientStore`);
- ``num_outputs(data, binary_head)``: the net's output columns;
- ``metrics(num_classes, num_clients)``: one split's evaluation metrics (:class:`SplitMetrics`);
- ``headline``: the names of the metrics a person looks at first (``acc``), shown by the progress bar and the final
  line (:mod:`flx.console`).

The shipped tasks (``task=``):

- ``Classification`` (default): softmax cross-entropy, BCE with logits on one output (:mod:`flx.models.heads`);
  logs ``{split}/loss``, ``acc``, ``client_acc_{mean,worst,std}``, with 2 classes also ``auroc``, ``pauc_0.3``,
  ``pauc_0.5``.
- ``Regression``: :math:`s \cdot \frac{1}{BK} \sum_{b,k} (\hat y_{bk} - y_{bk})^2` (``scale`` :math:`s`, 1: the MSE);
  logs ``loss``, ``mse``, ``rmse``, ``client_mse_{mean,worst,std}`` (worst: the largest).
- ``MaskedLM``: token targets ``(B, L)`` (``-100``: not scored) against logits ``(B, L, V)``: the mean cross-entropy
  over the scored positions; logs ``loss``, ``acc`` (token accuracy), ``ppl`` (``exp(loss)``), ``client_acc_*``, each
  a mean over the split's scored tokens (not its rows).
- ``Custom``: any ``fn(outputs, target)`` named by ``_target_``; logs ``loss``, and a ``task.metric`` by its name.

Real-valued targets are ``(B,)`` (one column, the net has one output) or ``(B, K)``; a regression loss sees the
outputs in the target's shape, so ``(B, 1)`` outputs never broadcast against ``(B,)`` targets.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric, MeanSquaredError, Metric
from torchmetrics.classification import MulticlassAccuracy

from flx.datamodules.store import TensorData
from flx.errors import bad_value
from flx.metrics.auc import AUROCs
from flx.metrics.client_summary import SUMMARY, ClientCells, PerClientAccuracy, PerClientLoss, PerClientMSE
from flx.metrics.sync import LOCAL
from flx.models import heads
from flx.task_spec import CLASSES, REAL, TARGETS, TOKENS, mismatch

LossFn = Callable[[Tensor, Tensor], Tensor]


def as_target(outputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Real-valued ``outputs`` reshaped to ``target``'s shape (``(B, 1)`` -> ``(B,)``), both in their promoted dtype
    (no copy when they agree, as in training: the store's targets are already in the net's dtype)."""
    dtype = torch.promote_types(outputs.dtype, target.dtype)
    return outputs.reshape(target.shape).to(dtype), target.to(dtype)


class SplitMetrics(nn.Module):
    """One split's evaluation metrics: the mean task loss over the split's rows and the task's own metrics, plus a
    per-client metric summarised over the clients (``client_key``, e.g. ``acc``: ``client_acc_{mean,worst,std}``).
    Sum-reduced metrics are built with :data:`~flx.metrics.sync.LOCAL`: on N processes they hold this rank's sums
    until :func:`~flx.metrics.sync.reduce_sums` adds them up (one collective for all of them).

    Args:
        loss_fn: the task's batch-mean loss.
    """

    client_key: str | None = None  # the per-client metric's name; None: no per-client summary
    higher_is_better = True  # of the per-client metric: its worst client is the min (else the max)
    # what the metrics compute in: float32, or float64 in a float64 run (set_value_dtype)
    value_dtype = torch.float32

    def __init__(self, loss_fn: LossFn, num_clients: int = 0) -> None:
        super().__init__()
        self.loss_fn, self.loss = loss_fn, MeanMetric(**LOCAL)
        self.client_loss = PerClientLoss(num_clients, **LOCAL) if num_clients else None
        # whether update_clients tracks each client's loss and rows: only W&B's per-client table reads them, so the
        # module switches it on with a W&B logger (on every rank alike)
        self.track_client_loss = False

    def set_value_dtype(self, dtype: torch.dtype) -> None:
        """Makes the metrics compute in ``dtype`` (:func:`flx.metrics.dtype.logged_dtype`): torchmetrics' own
        metrics get their states in it (``set_dtype``: casting the module leaves them as built, in float32), flx's
        per-client ones their result. Nothing changes for the float32 they were built in (counts stay integers).
        Called before every evaluation: moving a torchmetrics metric (``.to(device)``) resets the dtype it casts its
        inputs to back to float32, though its states stay float64."""
        if dtype == self.value_dtype == torch.float32:
            return
        self.value_dtype = dtype
        for metric in self.modules():
            if isinstance(metric, (MeanMetric, MeanSquaredError, MulticlassAccuracy)):
                metric.set_dtype(dtype)
            elif isinstance(metric, (PerClientAccuracy, AUROCs)):
                metric.value_dtype = dtype

    def update(self, outputs: Tensor, target: Tensor) -> None:
        """A batch of the split's rows: ``outputs`` of the net, ``target`` from the store."""
        self.loss.update(self.loss_fn(outputs, target), weight=len(target))

    def update_clients(self, outputs: Tensor, target: Tensor, client: Tensor, cells: ClientCells | None = None) -> None:
        """A batch of per-client rows (``client``: each row's client, or with ``cells`` its cell, which counts for
        every client holding it); here each client's loss and row count."""
        if self.client_loss is not None and self.track_client_loss:
            self.client_loss.update(self.loss_fn, outputs, target, client, cells)

    def client_loss_values(self) -> tuple[Tensor, Tensor] | None:
        """Each client's mean loss and number of evaluation rows (NaN and 0: no rows); resets them. None: the
        split's metrics track no clients' losses (``track_client_loss``)."""
        if self.client_loss is None or not self.track_client_loss:
            return None
        values = self.client_loss.compute()
        self.client_loss.reset()
        return values

    def values(self) -> dict[str, Metric | Tensor]:
        """What to log now as ``{split}/<name>``: Metric objects (Lightning computes and resets them) or tensors
        (computed here, their metrics reset)."""
        return {"loss": self.loss}

    def client_values(self) -> Tensor:
        """The per-client metric (NaN for a client without rows); resets it."""
        raise NotImplementedError

    def names(self) -> tuple[str, ...]:
        """The keys of :meth:`values` (without computing anything)."""
        return ("loss",)

    def client_names(self) -> tuple[str, ...]:
        """The per-client summaries logged where the split has per-client rows: ``client_<key>_{mean,worst,std}``
        (:func:`flx.metrics.client_summary.summarize`); none without a per-client metric."""
        return () if self.client_key is None else tuple(f"client_{self.client_key}_{k}" for k in SUMMARY)


class ClassificationMetrics(SplitMetrics):
    """``acc`` (micro), ``loss``; with 2 classes also AUROC and standardised pAUC (FPR <= 0.3, 0.5) of the margin
    :math:`z` (:func:`flx.models.heads.binary_margin`); per client: accuracy."""

    client_key = "acc"

    def __init__(self, loss_fn: LossFn, num_classes: int, num_clients: int) -> None:
        super().__init__(loss_fn, num_clients)
        self.acc = MulticlassAccuracy(num_classes, average="micro", **LOCAL)
        self.client = PerClientAccuracy(num_clients, **LOCAL)
        self.auc = AUROCs() if num_classes == 2 else None

    def update(self, outputs: Tensor, target: Tensor) -> None:
        self.acc.update(heads.predict(outputs), target)
        super().update(outputs, target)
        if self.auc is not None:
            self.auc.update(heads.binary_margin(outputs), target)

    def update_clients(self, outputs: Tensor, target: Tensor, client: Tensor, cells: ClientCells | None = None) -> None:
        super().update_clients(outputs, target, client, cells)
        self.client.update(heads.predict(outputs), target, client, cells)

    def values(self) -> dict[str, Metric | Tensor]:
        out: dict[str, Metric | Tensor] = {"acc": self.acc, "loss": self.loss}
        if self.auc is not None:
            out |= {key: value.to(self.value_dtype) for key, value in self.auc.compute().items()}
            self.auc.reset()
        return out

    def client_values(self) -> Tensor:
        per_client = self.client.compute()
        self.client.reset()
        return per_client

    def names(self) -> tuple[str, ...]:
        return ("acc", "loss", *(self.auc.keys() if self.auc is not None else ()))


class RegressionMetrics(SplitMetrics):
    """``loss``, ``mse`` and ``rmse`` (over every row and target column); per client: the MSE."""

    client_key, higher_is_better = "mse", False

    def __init__(self, loss_fn: LossFn, num_clients: int) -> None:
        super().__init__(loss_fn, num_clients)
        self.mse, self.client = MeanSquaredError(**LOCAL), PerClientMSE(num_clients, **LOCAL)

    def update(self, outputs: Tensor, target: Tensor) -> None:
        super().update(outputs, target)
        pred, target = as_target(outputs, target)
        self.mse.update(pred.reshape(-1), target.reshape(-1))

    def update_clients(self, outputs: Tensor, target: Tensor, client: Tensor, cells: ClientCells | None = None) -> None:
        super().update_clients(outputs, target, client, cells)
        self.client.update(*as_target(outputs, target), client, cells)

    def values(self) -> dict[str, Metric | Tensor]:
        mse = self.mse.compute()
        self.mse.reset()
        return {"loss": self.loss, "mse": mse, "rmse": mse.sqrt()}

    def names(self) -> tuple[str, ...]:
        return ("loss", "mse", "rmse")

    def client_values(self) -> Tensor:
        per_client = self.client.compute()
        self.client.reset()
        return per_client


class CustomMetrics(SplitMetrics):
    """``loss`` and, with a metric function, its batch means averaged over the rows as ``{split}/<name>``."""

    def __init__(self, loss_fn: LossFn, metric_name: str | None = None, metric_fn: LossFn | None = None) -> None:
        super().__init__(loss_fn)
        self.metric_name, self.metric_fn = metric_name, metric_fn
        self.metric = MeanMetric(**LOCAL) if metric_fn is not None else None

    def update(self, outputs: Tensor, target: Tensor) -> None:
        super().update(outputs, target)
        if self.metric is not None:
            self.metric.update(self.metric_fn(outputs, target), weight=len(target))

    def values(self) -> dict[str, Metric | Tensor]:
        return {"loss": self.loss} | ({self.metric_name: self.metric} if self.metric is not None else {})

    def names(self) -> tuple[str, ...]:
        return ("loss",) if self.metric is None else ("loss", self.metric_name)


class Task:
    """The interface (see the module docstring). ``targets``: ``classes`` (int64 labels) or ``real`` (floats)."""

    name = "task"
    targets = CLASSES
    client_key, higher_is_better = "loss", False  # the per-client metric of personalised evaluation
    # the run's headline metrics (logged names without the split): the progress bar and the final line show them
    headline: tuple[str, ...] = ("loss",)

    def client_metric(self, outputs: Tensor, target: Tensor) -> Tensor:
        """The batch mean of the per-client metric (:meth:`flx.federation.Federation.evaluate_clients`)."""
        return self.loss(outputs, target)

    @property
    def target_dtype(self) -> torch.dtype:
        """The store's dtype of the targets: int64 labels, float32 real values."""
        return torch.float32 if self.targets == REAL else torch.int64

    def loss(self, outputs: Tensor, target: Tensor) -> Tensor:
        """The batch-mean loss of ``outputs`` (the net's, ``(B, C)``) against ``target`` (the store's)."""
        raise NotImplementedError

    def num_outputs(self, data: TensorData, binary_head: str = "two_logits") -> int:
        """The net's output columns: per class (:func:`flx.models.heads.num_outputs`) or per target column."""
        if self.targets == REAL:
            return 1 if data.y_train.dim() == 1 else int(data.y_train.shape[1])
        return heads.num_outputs(binary_head, data.num_classes)

    def metrics(self, num_classes: int, num_clients: int) -> SplitMetrics:
        """A fresh set of one split's evaluation metrics."""
        return SplitMetrics(self.loss)

    def metric_names(self, num_classes: int, client_rows: bool) -> tuple[str, ...]:
        """The names (without the split) of what one evaluation of a split logs: the metrics of :meth:`metrics`
        (``loss``, ``acc``, ...) and, where the split has per-client rows (``client_rows``), their per-client
        summaries (``client_acc_mean``, ...). What ``checkpoint.monitor`` may name under ``val/``."""
        metrics = self.metrics(num_classes, 1)
        return metrics.names() + (metrics.client_names() if client_rows else ())

    def check_data(self, data: TensorData) -> None:
        """Raises a one-line :class:`~flx.errors.ConfigError` unless the data's targets are the task's kind."""
        has = REAL if data.real_targets else TOKENS if data.token_targets else CLASSES
        if has != self.targets:
            raise mismatch(self.name, self.targets, data.name or "?", has)


class Classification(Task):
    """Class labels, softmax cross-entropy (BCE with logits for ``model.binary_head=one_logit``): the default."""

    name = "classification"
    client_key, higher_is_better = "acc", True
    headline = ("acc",)

    def loss(self, outputs: Tensor, target: Tensor) -> Tensor:
        return heads.classification_loss(outputs, target)

    def loss_rows(self, outputs: Tensor, target: Tensor) -> Tensor:
        """Each row's loss, ``(B,)``: :meth:`loss` is their mean (``algo.vectorize`` scores a stack of clients in one
        call with it, :mod:`flx.vectorized`)."""
        if outputs.shape[-1] == 1:
            return F.binary_cross_entropy_with_logits(outputs[:, 0], target.to(outputs.dtype), reduction="none")
        return F.cross_entropy(outputs, target, reduction="none")

    def client_metric(self, outputs: Tensor, target: Tensor) -> Tensor:
        return (heads.predict(outputs) == target).double().mean()

    def metrics(self, num_classes: int, num_clients: int) -> SplitMetrics:
        return ClassificationMetrics(self.loss, num_classes, num_clients)


class Regression(Task):
    r"""Real-valued targets, mean squared error: :math:`\ell = s \cdot \frac{1}{BK} \sum_{b,k} (\hat y_{bk} -
    y_{bk})^2` (``K`` target columns).

    Args:
        scale: :math:`s`; 1 is the MSE, 0.5 the :math:`\frac{1}{2} r^2` convention (e.g. pFedFBE's Lasso, whose
            paper leaves the factor open, Sec. 4.1). ``{split}/mse`` is always unscaled.
    """

    name, targets = "regression", REAL
    client_key, headline = "mse", ("mse",)

    def client_metric(self, outputs: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(*as_target(outputs, target))

    def __init__(self, scale: float = 1.0) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise bad_value("task.scale", scale, "must be a number > 0")
        self.scale = float(scale)

    def loss(self, outputs: Tensor, target: Tensor) -> Tensor:
        mse = F.mse_loss(*as_target(outputs, target))
        return mse if self.scale == 1.0 else self.scale * mse

    def metrics(self, num_classes: int, num_clients: int) -> SplitMetrics:
        return RegressionMetrics(self.loss, num_clients)


IGNORE = -100
"""The token target of a position that is not scored (``F.cross_entropy``'s ``ignore_index``)."""


def token_nll(outputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    r"""Per position ``(-log softmax(o)_{y}) [y != -100]`` and the 0/1 scored mask, both ``target``'s shape.

    Written with ``gather`` rather than ``F.cross_entropy(ignore_index=...)`` so that it runs under ``torch.func.vmap``
    (the per-sample Fisher of :mod:`flx.parts.systems.whale_utility`)."""
    scored = target != IGNORE
    nll = -outputs.log_softmax(-1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)  # (B, L)
    return nll * scored, scored


class MaskedLMMetrics(SplitMetrics):
    r"""``loss``, ``acc`` and ``ppl`` over a split's scored tokens; per client: token accuracy.

    Each batch ``b`` with :math:`n_b` scored tokens adds its mean loss :math:`\bar\ell_b` and accuracy with weight
    :math:`n_b`, so the epoch values are token means, :math:`\sum_b n_b \bar\ell_b / \sum_b n_b`, whatever the batch
    split; ``ppl`` is :math:`\exp` of the epoch loss.
    """

    client_key = "acc"

    def __init__(self, loss_fn: LossFn, num_clients: int) -> None:
        super().__init__(loss_fn, num_clients)
        self.acc, self.client = MeanMetric(**LOCAL), PerClientAccuracy(num_clients, **LOCAL)

    def update(self, outputs: Tensor, target: Tensor) -> None:
        scored = target != IGNORE
        n = scored.sum()
        self.loss.update(self.loss_fn(outputs, target), weight=n)
        hits = ((outputs.argmax(-1) == target) & scored).sum()
        self.acc.update(hits / n.clamp_min(1), weight=n)

    def update_clients(self, outputs: Tensor, target: Tensor, client: Tensor, cells: ClientCells | None = None) -> None:
        super().update_clients(outputs, target, client, cells)
        scored = target != IGNORE  # (B, L); each scored token counts for its row's client (cell)
        self.client.update(outputs.argmax(-1)[scored], target[scored], client[:, None].expand_as(target)[scored], cells)

    def values(self) -> dict[str, Metric | Tensor]:
        return {"loss": self.loss, "acc": self.acc, "ppl": self.loss.compute().exp()}

    def names(self) -> tuple[str, ...]:
        return ("loss", "acc", "ppl")

    def client_values(self) -> Tensor:
        per_client = self.client.compute()
        self.client.reset()
        return per_client


class MaskedLM(Task):
    r"""A masked language model (BERT): logits ``(B, L, V)`` against token targets ``(B, L)`` that hold the original
    id at the scored positions and ``-100`` elsewhere (:mod:`flx.datamodules.wikitext`):

    .. math::
        \ell = \frac{1}{|S|} \sum_{(b, t) \in S} -\log \mathrm{softmax}(o_{bt})_{y_{bt}}, \qquad
        S = \{(b, t) : y_{bt} \ne -100\}

    (0 when nothing in the batch is scored). The per-client metric is the token accuracy over ``S``.
    """

    name, targets = "masked_lm", TOKENS
    client_key, higher_is_better = "acc", True
    headline = ("acc", "ppl")

    def loss(self, outputs: Tensor, target: Tensor) -> Tensor:
        nll, scored = token_nll(outputs, target)
        return nll.sum() / scored.sum().clamp_min(1)

    def client_metric(self, outputs: Tensor, target: Tensor) -> Tensor:
        scored = target != IGNORE
        return ((outputs.argmax(-1) == target) & scored).sum().double() / scored.sum().clamp_min(1)

    def num_outputs(self, data: TensorData, binary_head: str = "two_logits") -> int:
        """The vocabulary: ``data.num_classes`` logits per position."""
        return data.num_classes

    def metrics(self, num_classes: int, num_clients: int) -> SplitMetrics:
        return MaskedLMMetrics(self.loss, num_clients)


def _name_of(fn: Callable[..., Any]) -> str:
    """A callable's name (``functools.partial``: its function's), e.g. ``l1_loss``."""
    while isinstance(fn, partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


class Custom(Task):
    """Any batch-mean loss ``fn(outputs, target) -> Tensor`` given by ``_target_`` (``_partial_: true`` for a
    function with options), e.g. ``torch.nn.functional.l1_loss``.

    Args:
        loss: the loss function; also logged as ``{split}/loss``.
        metric: an optional second batch-mean function, logged as ``{split}/<metric_name>``.
        metric_name: its key; None: the function's name (``mse_loss``).
        targets: ``real`` (the functions get the outputs in the target's shape, in one dtype) or ``classes``
            (logits ``(B, C)`` and int64 labels, as given).
    """

    name = "custom"

    def __init__(
        self, loss: LossFn, metric: LossFn | None = None, metric_name: str | None = None, targets: str = REAL
    ) -> None:
        for key, fn in (("task.loss", loss), ("task.metric", metric)):
            if fn is not None and not callable(fn):
                why = "must be a callable fn(outputs, target) -> Tensor, e.g. {_target_: torch.nn.functional.l1_loss}"
                raise bad_value(key, fn, why)
        if loss is None:
            raise bad_value("task.loss", loss, "required: a loss fn(outputs, target) -> Tensor given by _target_")
        if targets not in TARGETS:
            raise bad_value("task.targets", targets, f"allowed: {', '.join(TARGETS)}")
        self.loss_fn, self.metric_fn, self.targets = loss, metric, targets
        self.metric_name = None if metric is None else metric_name or _name_of(metric)
        self.headline = ("loss",) if self.metric_name is None else (self.metric_name,)

    def _args(self, outputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
        return as_target(outputs, target) if self.targets == REAL else (outputs, target)

    def loss(self, outputs: Tensor, target: Tensor) -> Tensor:
        return self.loss_fn(*self._args(outputs, target))

    def metric(self, outputs: Tensor, target: Tensor) -> Tensor:
        """The batch mean of ``task.metric``."""
        return self.metric_fn(*self._args(outputs, target))

    def metrics(self, num_classes: int, num_clients: int) -> SplitMetrics:
        return CustomMetrics(self.loss, self.metric_name, self.metric if self.metric_fn is not None else None)
