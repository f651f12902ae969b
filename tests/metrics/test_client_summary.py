"""Per-client summaries: the mean loss and row count of each client against a direct per-client evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flx.metrics.client_summary import PerClientLoss


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
