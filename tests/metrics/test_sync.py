"""One all-reduce for a split's sum-reduced metrics: two ranks' states added up equal one rank fed every row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flx.metrics.sync import reduce_sums, summed
from flx.tasks import Classification


def test_two_ranks_reduced_in_one_call_equal_one_rank() -> None:
    """Rows 0..19 split over two ranks by parity, then ``reduce_sums`` with a stand-in all-reduce (the sum of the two
    ranks' packed vectors, one call per rank): loss, accuracy and per-client accuracy equal a single metric fed all
    20 rows; AUROC's concatenated scores are left to torchmetrics' own sync."""
    g = torch.Generator().manual_seed(0)
    logits, y, owner = torch.randn(20, 2, generator=g), torch.randint(0, 2, (20,), generator=g), torch.arange(20) % 3
    one, ranks = Classification().metrics(2, 3), [Classification().metrics(2, 3) for _ in range(2)]
    for metrics, rows in [(one, slice(None)), (ranks[0], slice(0, None, 2)), (ranks[1], slice(1, None, 2))]:
        metrics.update(logits[rows], y[rows])
        metrics.update_clients(logits[rows], y[rows], owner[rows])
    packed = [torch.cat([s.reshape(-1).double() for m in summed(r) for s in m.metric_state.values()]) for r in ranks]
    calls = []

    def all_reduce(flat: torch.Tensor) -> torch.Tensor:
        calls.append(len(flat))
        return packed[0] + packed[1]

    for r in ranks:
        reduce_sums(summed(r), all_reduce)
    assert calls == [len(packed[0])] * 2  # one call per rank for every state
    assert all(m is not one.auc for m in summed(one)) and one.acc in summed(one)
    expected_loss = float(F.cross_entropy(logits, y))
    for r in ranks:
        assert float(r.loss.compute()) == pytest.approx(expected_loss, rel=1e-6)
        assert float(r.acc.compute()) == float(one.acc.compute())
        assert torch.equal(r.client.correct, one.client.correct) and torch.equal(r.client.total, one.client.total)
