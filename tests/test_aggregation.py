"""Aggregators against their closed forms."""

from __future__ import annotations

import pytest
import torch

from flx.aggregation import AdmmSum, CountMean, WeightedMean


def test_weighted_mean_closed_form_and_one_buffer() -> None:
    like = [torch.zeros(2, 3), torch.zeros(4)]
    agg = WeightedMean(like)
    clients = [([torch.full((2, 3), float(i)), torch.arange(4.0) * i], w) for i, w in ((1, 2.0), (2, 3.0), (5, 5.0))]
    for tensors, w in clients:
        agg.update(tensors, w)
    assert agg.total_weight == 10.0
    mean = agg.compute()
    expected = (2 * 1 + 3 * 2 + 5 * 5) / 10
    torch.testing.assert_close(mean[0], torch.full((2, 3), expected))
    torch.testing.assert_close(mean[1], torch.arange(4.0) * expected)


def test_weighted_mean_sync_sums_whole_buffer_once() -> None:
    agg = WeightedMean([torch.zeros(3)])
    agg.update([torch.ones(3)], 1.0)
    calls = []

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.numel())
        return t * 2  # as if a second rank contributed the same

    agg.sync(reduce_sum)
    assert calls == [4] and agg.total_weight == 2.0
    torch.testing.assert_close(agg.compute()[0], torch.ones(3))


def test_count_mean_averages_over_covering_clients_only() -> None:
    """Entry k: mean of the clients whose mask covers k; untouched entries keep the previous value."""
    prev = [torch.tensor([9.0, 9.0, 9.0, 9.0])]
    agg = CountMean(prev)
    agg.update([torch.tensor([1.0, 2.0, 0.0, 0.0])], 7.0, masks=[torch.tensor([1.0, 1.0, 0.0, 0.0])])
    agg.update([torch.tensor([3.0, 0.0, 5.0, 0.0])], 1.0, masks=[torch.tensor([1.0, 0.0, 1.0, 0.0])])
    out = agg.compute(prev)[0]
    torch.testing.assert_close(out, torch.tensor([2.0, 2.0, 5.0, 9.0]))


def test_count_mean_weighted_and_maskless() -> None:
    """``weighted=True``: entry k is sum_i p_i m_ik w_ik / sum_i p_i m_ik; a client without masks covers every entry."""
    prev = [torch.zeros(3)]
    agg = CountMean(prev, weighted=True)
    agg.update([torch.tensor([1.0, 1.0, 1.0])], 3.0)
    agg.update([torch.tensor([5.0, 5.0, 5.0])], 1.0, masks=[torch.tensor([1.0, 0.0, 1.0])])
    torch.testing.assert_close(agg.compute(prev)[0], torch.tensor([2.0, 1.0, 2.0]))


def test_admm_sum_adds_uploads_unweighted_and_divides_by_the_weight_sum() -> None:
    """AugFL Eq. 13 without the lambda G term: theta = sum_i (y_i + rho_i theta_i) / sum_i rho_i."""
    agg = AdmmSum([torch.zeros(2)], extra=1)
    ys, thetas, rhos = (
        [torch.tensor([1.0, -1.0]), torch.tensor([0.5, 2.0])],
        [torch.ones(2), torch.zeros(2)],
        [0.7, 1.3],
    )
    for y, theta, rho in zip(ys, thetas, rhos):
        agg.update([y + rho * theta], rho)
    agg.extra[0] += 4.0
    assert agg.total_weight == pytest.approx(2.0) and float(agg.extra[0]) == 4.0
    expected = (ys[0] + 0.7 * thetas[0] + ys[1] + 1.3 * thetas[1]) / 2.0
    torch.testing.assert_close(agg.compute()[0], expected)


def test_masks_need_the_count_mean() -> None:
    for agg in (WeightedMean([torch.zeros(2)]), AdmmSum([torch.zeros(2)])):
        with pytest.raises(ValueError, match="count_mean"):
            agg.update([torch.ones(2)], 1.0, masks=[torch.ones(2)])


def test_the_precheck_knows_every_aggregator() -> None:
    """checks.AGGREGATORS (torch-free, for the pre-run check; flx.choices) names exactly the aggregators there are."""
    from flx import aggregation, checks

    assert tuple(aggregation.AGGREGATORS) == checks.AGGREGATORS
