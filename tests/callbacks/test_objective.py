"""Objective: F(w) = (1/N) sum_i f_i(w) + h(w) of the global model (the composite objective of pFedFBE / FedMiD)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, run_rounds, toy_data

from flx.callbacks.objective import Objective, composite_objective
from flx.regularizers import make_regularizer


def test_objective_is_the_unweighted_client_mean_plus_mu_l1_of_the_weight() -> None:
    """Clients of 3, 8, 5 rows: f = (1/3) sum_i CE_i (one entry per client, not per row), h = mu sum |W_jk| over the
    weight only (the bias is not selected)."""
    data = toy_data([3, 8, 5], dtype=torch.float64)
    fed = make_fed(linear(dtype=torch.float64), data, clients_per_round=3, local_steps=2, batch_size=4, lr=0.5)
    run_rounds(fed, 1)
    h = make_regularizer({"name": "l1", "mu": 0.1, "params": ["weight"]})
    h.bind(fed.net)
    f, value = composite_objective(fed, h)
    with torch.no_grad():
        per_client = [F.cross_entropy(fed.net(data.x[i]), data.y[i]) for i in data.client_indices]
    assert f == pytest.approx(float(torch.stack(per_client).mean()), abs=1e-12)
    assert value == pytest.approx(0.1 * float(fed.net.weight.detach().abs().sum()), abs=1e-12)


def test_no_regulariser_gives_h_zero() -> None:
    assert Objective(None).h.identity and Objective({"name": "none"}).h.identity
