"""Per-client accuracy (classification) or mean squared error (regression) of the global model, and their summary
(mean, worst, std over clients).

torchmetrics ``Metric``s: per-client counts and sums are declared states reduced by sum, so a summary computed on N
processes equals the one on 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torchmetrics import Metric


class PerClientAccuracy(Metric):
    """Accuracy of each client's test samples.

    Args:
        num_clients: number of clients (size of the count vectors).
    """

    full_state_update = False

    def __init__(self, num_clients: int) -> None:
        super().__init__()
        self.add_state("correct", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor, client: Tensor) -> None:
        """``preds``: predicted classes ``(B,)`` (``flx.models.heads.predict``), or logits ``(B, C)`` (argmax)."""
        preds = preds.argmax(-1) if preds.dim() > 1 else preds
        self.correct.index_add_(0, client, (preds == target).long())
        self.total.index_add_(0, client, torch.ones_like(client))

    def compute(self) -> Tensor:
        """Accuracy per client; NaN for a client without test samples."""
        return self.correct.float() / self.total.float()


class PerClientMSE(Metric):
    """Mean squared error of each client's test samples (averaged over samples and target columns).

    Args:
        num_clients: number of clients (size of the sum vectors).
    """

    full_state_update = False

    def __init__(self, num_clients: int) -> None:
        super().__init__()
        self.add_state("sse", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor, client: Tensor) -> None:
        """``preds`` and ``target``: ``(B,)`` or ``(B, K)`` real values; ``client``: ``(B,)`` owner ids."""
        sq = (preds.double() - target.double()).square().reshape(len(client), -1)
        self.sse.index_add_(0, client, sq.sum(1))
        self.total.index_add_(0, client, torch.full_like(client, sq.shape[1]))

    def compute(self) -> Tensor:
        """MSE per client; NaN for a client without test samples."""
        return self.sse / self.total.double()


class PerClientLoss(Metric):
    """Mean loss of each client's evaluation rows, and their number.

    The rows of one client come in runs (the per-client loader concatenates each client's rows); each run adds the
    task's batch-mean loss times its rows, so a client's value is its row-weighted mean loss (exact for per-row
    losses; a masked language model's token mean is weighted by rows, not tokens, across batches).

    Args:
        num_clients: number of clients (size of the sum vectors).
    """

    full_state_update = False

    def __init__(self, num_clients: int) -> None:
        super().__init__()
        self.add_state("loss_sum", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rows", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self, loss_fn: Callable[[Tensor, Tensor], Tensor], outputs: Tensor, target: Tensor, client: Tensor
    ) -> None:
        """``loss_fn``: the task's batch-mean loss; ``client``: ``(B,)`` owner ids of the rows."""
        ids, counts = torch.unique_consecutive(client, return_counts=True)
        sizes = counts.tolist()
        for cid, out, tgt, n in zip(ids.tolist(), outputs.split(sizes), target.split(sizes), sizes):
            self.loss_sum[cid] += loss_fn(out, tgt).double() * n
            self.rows[cid] += n

    def compute(self) -> tuple[Tensor, Tensor]:
        """Mean loss per client (NaN: no rows) and rows per client."""
        return self.loss_sum / self.rows.double(), self.rows.clone()


def summarize(values: Tensor, higher_is_better: bool = True) -> dict[str, Tensor]:
    """Mean, worst (min, or max when lower is better: errors) and std (population) over the clients that have
    test samples."""
    values = values[~torch.isnan(values)]
    worst = values.min() if higher_is_better else values.max()
    return {"mean": values.mean(), "worst": worst, "std": values.std(unbiased=False)}


def spread(values: Tensor, higher_is_better: bool = True) -> dict[str, Tensor]:
    """Mean, worst and the 10th percentile counted from the worst side (``p10``: 10% of the clients do worse; for an
    error, lower is better, it is the 90th percentile) over the clients with evaluation rows (linear interpolation,
    ``torch.quantile``)."""
    values = values[~torch.isnan(values)].double()
    worst = values.min() if higher_is_better else values.max()
    p10 = torch.quantile(values, 0.1 if higher_is_better else 0.9)
    return {"mean": values.mean(), "worst": worst, "p10": p10}
