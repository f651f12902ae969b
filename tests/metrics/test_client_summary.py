"""Per-client summaries: the mean loss and row count of each client against a direct per-client evaluation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flx.metrics.client_summary import ClientCells, PerClientAccuracy, PerClientLoss, PerClientMSE


def test_per_client_loss_is_each_clients_mean_loss_over_batches() -> None:
    """Client c's value is ``mean_{rows of c} loss`` whatever the batches (its rows split across two here), NaN and 0
    rows for a client with no rows; the batch-mean loss is applied to each client's run of rows."""
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(10, 3, generator=g), torch.randint(0, 3, (10,), generator=g)
    owner = torch.tensor([0, 0, 0, 2, 2, 2, 2, 3, 3, 3])
    metric = PerClientLoss(5)
    for rows in (slice(0, 5), slice(5, 10)):  # client 2 spans both batches
        metric.update(F.cross_entropy, logits[rows], target[rows], owner[rows])
    loss, rows = metric.compute()
    per_row = F.cross_entropy(logits, target, reduction="none")
    for c in (0, 2, 3):
        torch.testing.assert_close(loss[c], per_row[owner == c].mean().double())
    assert rows.tolist() == [3, 0, 4, 3, 0] and loss[1].isnan() and loss[4].isnan()


def _cells_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """12 rows in 3 cells (labels 0, 1, 2 with 3, 4, 5 rows); client 0 holds cells {0, 1}, client 1 {1, 2}, client 2
    {2}, client 3 none."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 3, generator=g)
    cell = torch.tensor([0, 1, 2, 1, 0, 2, 2, 1, 0, 1, 2, 2])
    return logits, cell, cell.clone(), [torch.tensor([0, 1]), torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([])]


def test_cells_count_each_row_for_every_client_that_holds_its_cell() -> None:
    """Client c's accuracy is ``sum_{k in L_c} correct_k / sum_{k in L_c} n_k`` and its mean loss the row mean over its
    cells' rows: the same as evaluating every client on a copy of its rows (the duplicated rows), whatever the batches;
    a client without cells gets NaN and 0 rows."""
    logits, target, cell, held = _cells_case()
    cells = ClientCells.from_lists(held, num_cells=3)
    acc, loss = PerClientAccuracy(4), PerClientLoss(4)
    for rows in (slice(0, 5), slice(5, 12)):
        acc.update(logits[rows], target[rows], cell[rows], cells)
        loss.update(F.cross_entropy, logits[rows], target[rows], cell[rows], cells)
    hit, per_row = (logits.argmax(-1) == target).double(), F.cross_entropy(logits, target, reduction="none").double()
    for c, labels in enumerate(held[:3]):
        mine = torch.isin(cell, labels)
        assert float(acc.compute()[c]) == pytest.approx(float(hit[mine].mean()))
        torch.testing.assert_close(loss.compute()[0][c], per_row[mine].mean())
    assert loss.compute()[1].tolist() == [3 + 4, 4 + 5, 5, 0] and acc.compute()[3].isnan()

    copies = PerClientAccuracy(4)  # the duplicated-rows evaluation: client c's rows, each with owner c
    for c, labels in enumerate(held):
        mine = torch.isin(cell, labels)
        copies.update(logits[mine], target[mine], torch.full((int(mine.sum()),), c))
    assert torch.equal(copies.correct, acc.correct) and torch.equal(copies.total, acc.total)


def test_mse_with_cells_pools_the_sums() -> None:
    """``sse_c = sum_{k in L_c} sse_k``, ``n_c = sum_{k in L_c} n_k`` (two target columns: 2 values a row)."""
    g = torch.Generator().manual_seed(2)
    preds, target = torch.randn(12, 2, generator=g), torch.randn(12, 2, generator=g)
    _, _, cell, held = _cells_case()
    metric = PerClientMSE(4)
    metric.update(preds, target, cell, ClientCells.from_lists(held, 3))
    sq = (preds - target).double().square()
    for c, labels in enumerate(held[:3]):
        torch.testing.assert_close(metric.compute()[c], sq[torch.isin(cell, labels)].mean())
    assert metric.total.tolist() == [2 * (3 + 4), 2 * (4 + 5), 2 * 5, 0]


def test_identity_cells_are_owner_ids() -> None:
    """With every client its own cell, rows with cells are rows with owners."""
    logits, target, cell, _ = _cells_case()
    a, b = PerClientAccuracy(3), PerClientAccuracy(3)
    a.update(logits, target, cell)
    b.update(logits, target, cell, ClientCells.identity(3))
    assert torch.equal(a.correct, b.correct) and torch.equal(a.total, b.total)
    assert ClientCells.identity(3).of(2).tolist() == [2]
