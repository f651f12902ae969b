"""Support recovery and numerical rank against hand counts."""

from __future__ import annotations

import pytest
import torch

from flx.metrics.sparse import numerical_rank, recovery_error, support_scores


def test_support_scores_hand_count() -> None:
    truth = torch.tensor([1.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    w = torch.tensor([0.9, 0.0, 0.02, 0.005, -0.3, 0.0])  # claims {0, 2, 4}; 0.005 is below the threshold
    s = support_scores(w, truth)
    assert s == pytest.approx({"precision": 2 / 3, "recall": 2 / 3, "f1": 2 * 2 / (3 + 3), "density": 3 / 6})
    assert support_scores(truth, truth)["f1"] == 1.0
    assert support_scores(torch.zeros(4), torch.zeros(4)) == {
        "precision": 1.0,
        "recall": 1.0,
        "f1": 1.0,
        "density": 0.0,
    }


def test_numerical_rank_and_recovery_error() -> None:
    g = torch.Generator().manual_seed(0)
    u, v = torch.randn(32, 5, generator=g, dtype=torch.float64), torch.randn(5, 32, generator=g, dtype=torch.float64)
    assert numerical_rank(u @ v) == 5
    assert numerical_rank(torch.diag(torch.tensor([1.0, 0.25, 0.009]))) == 2  # 0.009 < 0.01
    a, b = torch.zeros(2, 2), torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    assert recovery_error(a, b) == pytest.approx(5.0)
