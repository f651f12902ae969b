"""The Structure part: support and rank metrics of the global and personalised models against hand counts."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import make_fed, toy_data

from flx.hooks import FederatedCallback
from flx.parts.measures.structure import Structure

f64 = torch.float64


class Bump(FederatedCallback):
    """Client c's personalised model sets weight entry c to 1."""

    def personalize(self, fed, cid):
        @contextlib.contextmanager
        def bumped():
            with torch.no_grad():
                fed.net.weight[0, cid] = 1.0
            yield

        return bumped()


def _fed(parts, dim: int):
    net = torch.nn.Linear(dim, 1, bias=True).to(f64)
    with torch.no_grad():
        net.weight.zero_()
        net.weight[0, :2] = torch.tensor([0.5, 0.005])  # entry 1 is below the 0.01 threshold
    return make_fed(
        net, toy_data([3, 3, 3], dim=dim, dtype=f64), parts, loss_fn=lambda o, y: o.sum(), clients_per_round=3
    )


def test_support_of_the_global_and_personalised_models() -> None:
    part = Structure()
    part.truths = torch.tensor([[1.0, 0, 0, 0], [1.0, 1.0, 0, 0], [0, 0, 1.0, 0]], dtype=f64)
    fed = _fed([Bump(), part], dim=4)
    m = part.values(fed)
    # global support {0}: F1 against each truth 2*1/(1+1), 2*1/(1+2), 0 -> mean; density 1/4
    assert m["support_f1"] == pytest.approx((1 + 2 / 3 + 0) / 3)
    assert m["support_precision"] == pytest.approx((1 + 1 + 0) / 3) and m["density"] == pytest.approx(0.25)
    # personalised: client c adds entry c -> supports {0}, {0, 1}, {0, 2}
    assert m["personal_support_f1_mean"] == pytest.approx((1 + 1 + 2 * 1 / (2 + 1)) / 3)
    assert m["personal_density_mean"] == pytest.approx((1 + 2 + 2) / 3 / 4)
    assert float(fed.net.weight[0, 2]) == 0.0  # the global model is back


def test_rank_and_recovery_error_of_a_matrix_truth() -> None:
    part = Structure()
    truth = torch.diag(torch.tensor([1.0, 0.0], dtype=f64))
    part.truths = truth.expand(3, 2, 2).clone()
    fed = _fed([part], dim=4)  # weight (1, 4) -> [[0.5, 0.005], [0, 0]]: rank 1 (0.005 < 0.01 is not a direction)
    m = part.values(fed)
    assert m["rank"] == 1.0 and m["personal_rank_mean"] == 1.0
    err = float(torch.linalg.vector_norm(torch.tensor([0.5 - 1.0, 0.005, 0.0, 0.0], dtype=f64)))
    assert m["recovery_error"] == pytest.approx(err) and m["personal_recovery_error_mean"] == pytest.approx(err)


def test_param_pattern_must_match_one_parameter() -> None:
    part = Structure(param="*")
    part.truths = torch.zeros(3, 4, dtype=f64)
    with pytest.raises(Exception, match="algo.parts.structure.param"):
        part.values(_fed([part], dim=4))
