"""Per-client evaluation rows, held as cells so that each row is evaluated once.

What client ``c`` is measured on (``client_eval``, :class:`~flx.datamodules.datamodule.FederatedDataModule`) is a union
of *cells* of rows (:class:`~flx.metrics.client_summary.ClientCells`):

* the validation or test rows of the labels it trains on: one cell per label (``holdout`` on the validation split,
  ``test_labels``); clients that share a label share its cell;
* the rows of its sample group: one cell per group (``test_group``);
* its own held-out training rows (``holdout`` on the test split): one cell per client.

In the first two cases the cells partition the split itself, so the split's loader carries each row's cell and one
forward pass serves the split's metrics and every client's (:attr:`EvalRows.shared`); evaluating the rows once per
client instead costs clients x rows (100 clients that hold every label: 100 passes over the validation split).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from flx.datamodules.ragged import Ragged
from flx.metrics.client_summary import ClientCells


class ClientRows(Sequence[tuple[Tensor, Tensor]]):
    """Each client's evaluation rows of one split: ``rows[c]`` indexes ``x`` and ``y``; item ``c`` is
    ``(x[rows[c]], y[rows[c]])``. ``rows`` may compute an entry when asked (:class:`_CellRows`)."""

    def __init__(self, x: Tensor, y: Tensor, rows: Sequence[Tensor]) -> None:
        self.x, self.y, self.rows = x, y, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, cid: int) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        if not 0 <= cid < len(self):
            raise IndexError(cid)
        rows = self.rows[cid]
        return self.x[rows], self.y[rows]

    def to(self, device: torch.device, dtype: torch.dtype) -> ClientRows:
        """On ``device``, float inputs cast to ``dtype`` (integer token ids stay int64); the row indices stay put."""
        x = self.x.to(device, dtype) if self.x.is_floating_point() else self.x.to(device)
        return ClientRows(x, self.y.to(device), self.rows)


class _CellRows(Sequence[Tensor]):
    """Client ``c``'s rows: those whose cell is one of ``c``'s, ascending (computed on access)."""

    def __init__(self, cell: Tensor, cells: ClientCells) -> None:
        self.cell, self.cells = cell, cells

    def __len__(self) -> int:
        return self.cells.num_clients

    def __getitem__(self, cid: int) -> Tensor:  # type: ignore[override]
        return torch.isin(self.cell, self.cells.of(cid)).nonzero().flatten()


@dataclass(frozen=True)
class EvalRows:
    """One split's per-client evaluation rows.

    Attributes:
        x, y: the ``R`` rows (the split's own tensors when ``shared``).
        cell: ``(R,)`` each row's cell.
        cells: which cells each client holds.
        shared: the rows are the split's rows in order, so the split's loader serves the per-client metrics too.
    """

    x: Tensor
    y: Tensor
    cell: Tensor
    cells: ClientCells
    shared: bool

    def counts(self) -> Tensor:
        """``(C,)`` each client's number of evaluation rows."""
        return self.cells.pool(torch.bincount(self.cell, minlength=self.cells.num_cells))

    def clients(self) -> ClientRows:
        """Each client's ``(x, y)``, for an evaluation that cannot share rows (the personalised models)."""
        return ClientRows(self.x, self.y, _CellRows(self.cell, self.cells))


def held_cells(rows: Ragged[Tensor], keys: Tensor) -> Ragged[Tensor]:
    """Each client's distinct non-negative ``keys`` (the labels or groups of its ``rows``), ascending: what
    ``keys[rows[c]].unique()`` gives, for every client in one ``unique`` of (client, key) pairs."""
    owner = torch.from_numpy(rows.owners())
    key = keys[torch.as_tensor(rows.values)].long()
    scale = int(key.max()) + 1 if len(key) else 1
    pairs = torch.unique(owner * scale + key)  # sorted: client-major, keys ascending within a client
    return Ragged.from_sizes(pairs % scale, torch.bincount(pairs // scale, minlength=len(rows)).numpy())


def _cells(per_client: Sequence[Tensor], num_cells: int) -> ClientCells:
    if isinstance(per_client, Ragged):  # already CSR: no per-client tensor
        return ClientCells(torch.from_numpy(per_client.offsets), torch.as_tensor(per_client.values).long(), num_cells)
    return ClientCells.from_lists(per_client, num_cells)


def by_cell(x: Tensor, y: Tensor, cell: Tensor, per_client: Sequence[Tensor]) -> EvalRows:
    """A split whose rows fall in cells (``cell``: each row's label or group); client ``c`` holds ``per_client[c]``
    (a :class:`~flx.datamodules.ragged.Ragged`, or a list of tensors)."""
    held = torch.as_tensor(per_client.values) if isinstance(per_client, Ragged) else torch.cat([*per_client, cell[:0]])
    every = torch.cat([cell.long(), held.long()])
    num_cells = int(every.max()) + 1 if len(every) else 0
    return EvalRows(x, y, cell.long(), _cells(per_client, num_cells), shared=True)


def holdout(x: Tensor, y: Tensor, per_client: Sequence[Tensor]) -> EvalRows:
    """Each client's own rows of the store ``(x, y)`` (``per_client[c]``; a :class:`~flx.datamodules.ragged.Ragged`
    or a list of tensors), one cell per client."""
    if isinstance(per_client, Ragged):
        rows, sizes = torch.as_tensor(per_client.values).long(), torch.from_numpy(per_client.sizes())
    else:
        rows = torch.cat(list(per_client)) if len(per_client) else torch.zeros(0, dtype=torch.long)
        sizes = torch.tensor([len(t) for t in per_client], dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(per_client)), sizes)
    return EvalRows(x[rows], y[rows], owner, ClientCells.identity(len(per_client)), shared=False)
