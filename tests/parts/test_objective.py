"""Objective: F(w) = (1/N) sum_i f_i(w) + h(w) of the global model (the composite objective of pFedFBE / FedMiD)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, run_rounds, toy_data
from least_squares import f64, flat, grad, l1, loss, mse, prox, regression

from flx.datamodules.client_eval import ClientRows
from flx.parts.measures.objective import (
    Objective,
    composite_objective,
    personal_objective,
    personal_terms,
    split_objective,
)
from flx.parts.personalisation.fbe import FBE
from flx.parts.personalisation.personal_model import PersonalModel
from flx.parts.robustness.client_loss import client_train_losses
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


# ---------------------------------------------------------------------- the personalised objective
def test_personal_objective_of_pfedfbe_is_the_hand_mean_over_its_one_step_models() -> None:
    """pFedFBE's theta_j = prox_{h/lam}(w - grad f_j(w)/lam) (one prox-gradient step on all of client j's rows), so
    train/personal_objective = (1/N) sum_j [f_j(theta_j) + mu ||theta_j weight||_1], written out by hand; the
    split form on hand-made evaluation rows (a client without rows left out) likewise with f_j on those rows."""
    lam, mu = 2.5, 0.3
    data = regression([5, 8, 6])
    fed = make_fed(
        linear(3, 1, dtype=f64),
        data,
        [FBE(lam=lam, regularizer=l1(mu))],
        loss_fn=mse,
        clients_per_round=2,
        local_steps=2,
    )
    run_rounds(fed, 1)
    h = make_regularizer(l1(mu))
    h.bind(fed.net)
    w = flat(fed.params)
    thetas = [prox(w - grad(data.x[r], data.y[r], w) / lam, mu / lam) for r in data.client_indices]
    hand = [loss(data.x[r], data.y[r], t) + mu * float(t[:-1].abs().sum()) for r, t in zip(data.client_indices, thetas)]
    f = client_train_losses(fed)
    value, h_j = personal_objective(fed, h, f, float(h.value([p.detach() for p in fed.params])))
    assert value == pytest.approx(sum(hand) / 3, abs=1e-12)
    torch.testing.assert_close(h_j, torch.tensor([mu * float(t[:-1].abs().sum()) for t in thetas], dtype=f64))
    rows = [data.client_indices[0][:3], torch.zeros(0, dtype=torch.long), data.client_indices[2][2:]]
    split = split_objective(fed, ClientRows(data.x, data.y, rows), h_j)
    expected = [loss(data.x[r], data.y[r], thetas[j]) + float(h_j[j]) for j, r in ((0, rows[0]), (2, rows[2]))]
    assert split == pytest.approx(sum(expected) / 2, abs=1e-12)


def test_personal_objective_of_the_global_model_is_the_objective() -> None:
    """fedavg_personal (PersonalModel(model=global)) and a run without personalisation: theta_j = w for every j."""
    data = regression([5, 8, 6])
    h = make_regularizer(l1(0.2))
    for parts in ([PersonalModel("global")], []):
        fed = make_fed(linear(3, 1, dtype=f64), data, parts, loss_fn=mse, clients_per_round=2, local_steps=2)
        run_rounds(fed, 1)
        h.bind(fed.net)
        f, h_w = composite_objective(fed, h)
        value, _ = personal_objective(fed, h, client_train_losses(fed), h_w)
        assert value == pytest.approx(f + h_w, abs=1e-14)


def test_two_ranks_give_the_one_rank_personal_objective() -> None:
    """Ranks 0 and 1 each personalise their clients (j mod 2); the simulated all-reduce adds the two (N, 3) tables."""
    data = regression([5, 8, 6, 4, 7])
    parts = lambda: [FBE(lam=3.0, regularizer=l1(0.1))]  # noqa: E731
    one = make_fed(linear(3, 1, dtype=f64), data, parts(), loss_fn=mse)
    h = make_regularizer(l1(0.1))
    h.bind(one.net)
    expected = personal_terms(one, h)
    partial = [
        personal_terms(make_fed(linear(3, 1, dtype=f64), data, parts(), loss_fn=mse, rank=r, world_size=2), h)
        for r in (0, 1)
    ]
    assert all(float(partial[r][j].abs().sum()) == 0 for r in (0, 1) for j in range(5) if j % 2 != r)
    torch.testing.assert_close(partial[0] + partial[1], expected, rtol=0, atol=0)
