"""Per-client accuracy (classification) or mean squared error (regression) of the global model, and their summary
(mean, worst, std over clients).

torchmetrics ``Metric``s: per-client counts and sums are declared states reduced by sum, so a summary computed on N
processes equals the one on 1. A row comes with its client, or with its *cell* and a :class:`ClientCells` map: clients
that share evaluation rows (the validation rows of the labels each trains on, the test rows of its group) share cells,
and each row is evaluated once and counted for every client that holds its cell.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


class ClientCells:
    """Client ``c``'s evaluation rows are the rows of its cells ``of(c)``; a cell may belong to many clients.

    Args:
        offsets: ``(C + 1,)``: client ``c``'s cells are ``cells[offsets[c]:offsets[c + 1]]`` (CSR).
        cells: ``(P,)`` cell ids in ``[0, num_cells)``.
        num_cells: ``K``.
    """

    def __init__(self, offsets: Tensor, cells: Tensor, num_cells: int) -> None:
        self.offsets, self.cells, self.num_cells = offsets, cells, num_cells
        self.owner = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets.diff())  # (P,) client of each cell
        self._on: dict[torch.device, tuple[Tensor, Tensor]] = {}

    @classmethod
    def from_lists(cls, per_client: Sequence[Tensor], num_cells: int) -> ClientCells:
        """``per_client[c]``: client ``c``'s cell ids."""
        sizes = torch.tensor([0, *(len(t) for t in per_client)])
        cells = torch.cat([t.long() for t in per_client]) if per_client else torch.zeros(0, dtype=torch.long)
        return cls(sizes.cumsum(0), cells, num_cells)

    @classmethod
    def identity(cls, num_clients: int) -> ClientCells:
        """Every client its own cell (rows owned by one client each, e.g. its held-out rows)."""
        return cls(torch.arange(num_clients + 1), torch.arange(num_clients), num_clients)

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    def of(self, cid: int) -> Tensor:
        return self.cells[self.offsets[cid] : self.offsets[cid + 1]]

    def pairs(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(owner, cells)`` on ``device`` (copied there once)."""
        if device not in self._on:
            self._on[device] = (self.owner.to(device), self.cells.to(device))
        return self._on[device]

    def pool(self, per_cell: Tensor) -> Tensor:
        """``(K, ...)`` sums per cell to ``(C, ...)`` sums per client: the sum over each client's cells."""
        owner, cells = self.pairs(per_cell.device)
        return per_cell.new_zeros((self.num_clients, *per_cell.shape[1:])).index_add_(0, owner, per_cell[cells])


def add_per_client(state: Tensor, index: Tensor, values: Tensor, cells: ClientCells | None = None) -> None:
    """``state[c] +=`` the sum of ``values`` over client ``c``'s rows: ``index`` is each row's client, or with
    ``cells`` each row's cell (summed per cell first, then over each client's cells)."""
    if cells is None:
        state.index_add_(0, index, values)
    else:
        state += cells.pool(values.new_zeros((cells.num_cells, *values.shape[1:])).index_add_(0, index, values))


class PerClientAccuracy(Metric):
    """Accuracy of each client's test samples.

    Args:
        num_clients: number of clients (size of the count vectors).
        kwargs: torchmetrics' ``Metric`` arguments.
    """

    full_state_update = False

    def __init__(self, num_clients: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("correct", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")
        self.value_dtype = torch.float32  # of compute's result: float64 in a float64 run (the counts stay integers)

    def update(self, preds: Tensor, target: Tensor, client: Tensor, cells: ClientCells | None = None) -> None:
        """``preds``: predicted classes ``(B,)`` (``flx.models.heads.predict``), or logits ``(B, C)`` (argmax);
        ``client``: each row's client, or with ``cells`` its cell."""
        preds = preds.argmax(-1) if preds.dim() > 1 else preds
        add_per_client(self.correct, client, (preds == target).long(), cells)
        add_per_client(self.total, client, torch.ones_like(client), cells)

    def compute(self) -> Tensor:
        """Accuracy per client, in :attr:`value_dtype`; NaN for a client without test samples."""
        return self.correct.to(self.value_dtype) / self.total.to(self.value_dtype)


class PerClientMSE(Metric):
    """Mean squared error of each client's test samples (averaged over samples and target columns).

    Args:
        num_clients: number of clients (size of the sum vectors).
        kwargs: torchmetrics' ``Metric`` arguments.
    """

    full_state_update = False

    def __init__(self, num_clients: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("sse", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor, client: Tensor, cells: ClientCells | None = None) -> None:
        """``preds`` and ``target``: ``(B,)`` or ``(B, K)`` real values; ``client``: ``(B,)`` each row's client, or
        with ``cells`` its cell."""
        sq = (preds.double() - target.double()).square().reshape(len(client), -1)
        add_per_client(self.sse, client, sq.sum(1), cells)
        add_per_client(self.total, client, torch.full_like(client, sq.shape[1]), cells)

    def compute(self) -> Tensor:
        """MSE per client; NaN for a client without test samples."""
        return self.sse / self.total.double()


class PerClientLoss(Metric):
    """Mean loss of each client's evaluation rows, and their number.

    The rows of a batch are grouped by client (or cell); each group adds the task's batch-mean loss times its rows, so
    a client's value is its row-weighted mean loss (exact for per-row losses; a masked language model's token mean is
    weighted by rows, not tokens, across groups).

    Args:
        num_clients: number of clients (size of the sum vectors).
        kwargs: torchmetrics' ``Metric`` arguments.
    """

    full_state_update = False

    def __init__(self, num_clients: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("loss_sum", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rows", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        outputs: Tensor,
        target: Tensor,
        client: Tensor,
        cells: ClientCells | None = None,
    ) -> None:
        """``loss_fn``: the task's batch-mean loss; ``client``: ``(B,)`` each row's client, or with ``cells`` its
        cell."""
        order = client.argsort(stable=True)  # one loss call per client (cell) of the batch
        ids, counts = torch.unique_consecutive(client[order], return_counts=True)
        sizes = counts.tolist()
        losses = [
            loss_fn(o, t).double() * n
            for o, t, n in zip(outputs[order].split(sizes), target[order].split(sizes), sizes)
        ]
        add_per_client(self.loss_sum, ids, torch.stack(losses), cells)
        add_per_client(self.rows, ids, counts, cells)

    def compute(self) -> tuple[Tensor, Tensor]:
        """Mean loss per client (NaN: no rows) and rows per client."""
        return self.loss_sum / self.rows.double(), self.rows.clone()


SUMMARY = ("mean", "worst", "std")
"""The keys of :func:`summarize`."""
SPREAD = ("mean", "worst", "p10")
"""The keys of :func:`spread`."""


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
