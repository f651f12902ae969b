r"""pFedMe against hand computations on linear least squares (``least_squares``).

Local step on the full batch: :math:`K` inner steps
:math:`\theta \leftarrow \mathrm{prox}_{\nu h}(\theta - \nu(\nabla f(\theta) + \lambda(\theta - w)))` from the previous
:math:`\theta` (:math:`w^t` at the start), then :math:`w \leftarrow w - \eta\lambda(w - \theta)`; the server takes
:math:`(1 - \beta) w^t + \beta \bar w`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import linear, make_fed, raises_one_line, run_rounds
from least_squares import f64, flat, grad, l1, loss, mse, prox, regression

from flx.callbacks.pfedme import PFedMe
from flx.context import FederationConfig
from flx.errors import ConfigError
from flx.federation import Federation
from flx.server import ServerOptConfig


def _fed(data, part, **kw) -> Federation:
    kw = {"local_steps": 2, "batch_size": 64, "lr": 0.1, "weighting": "uniform"} | kw
    return make_fed(linear(data.x.shape[1], 1, dtype=f64), data, [part], loss_fn=mse, **kw)


def _local(x, y, w0, lam, nu, k, eta, steps, mu=0.0):
    """Client's full-batch pFedMe update from w0: returns (w_R, theta_R, mean loss of w before each step)."""
    w, theta, losses = w0.clone(), w0.clone(), []
    for _ in range(steps):
        losses.append(loss(x, y, w))
        for _ in range(k):
            theta = prox(theta - nu * (grad(x, y, theta) + lam * (theta - w)), nu * mu)
        w = w - eta * lam * (w - theta)
    return w, theta, sum(losses) / steps


@pytest.mark.parametrize("mu", [0.0, 0.3])
def test_one_round_matches_the_hand_computation(mu: float) -> None:
    """Two clients, two local steps, three inner steps, server beta = 0.5; the stored personal models are theta_R and
    personalize installs them (the global model is restored after each block)."""
    lam, nu, k, eta, beta = 2.0, 0.05, 3, 0.1, 0.5
    data = regression([6, 9])
    part = PFedMe(lam=lam, personal_lr=nu, inner_steps=k, regularizer=l1(mu) if mu else None)
    fed = _fed(data, part, clients_per_round=2, lr=eta, server=ServerOptConfig(lr=beta))
    w0 = flat(fed.params)
    run_rounds(fed, 1)
    results = [_local(data.x[r], data.y[r], w0, lam, nu, k, eta, 2, mu) for r in data.client_indices]
    mean = sum(w for w, _, _ in results) / 2
    torch.testing.assert_close(flat(fed.params), (1 - beta) * w0 + beta * mean, rtol=0, atol=1e-12)
    assert fed.train_loss == pytest.approx(sum(loss for _, _, loss in results) / 2, rel=1e-12)
    w1 = flat(fed.params)
    for cid, (_, theta, _) in enumerate(results):
        with fed.personalize(cid):
            torch.testing.assert_close(flat(fed.params), theta, rtol=0, atol=1e-12)
        assert torch.equal(flat(fed.params), w1)


def test_a_client_never_sampled_is_evaluated_with_the_global_model() -> None:
    data = regression([5, 6, 7])
    fed = _fed(data, PFedMe(), clients_per_round=1, seed=0)
    run_rounds(fed, 1)
    (unseen,) = [c for c in range(3) if c not in fed.store][:1]
    w = flat(fed.params)
    with fed.personalize(unseen):
        assert torch.equal(flat(fed.params), w)


def test_personal_solve_solves_the_inner_problem_from_the_current_global_model() -> None:
    lam, nu, k = 3.0, 0.04, 4
    data = regression([7, 5])
    fed = _fed(data, PFedMe(lam=lam, personal_lr=nu, inner_steps=k, personal="solve"), clients_per_round=2)
    run_rounds(fed, 1)
    w = flat(fed.params)
    for cid, rows in enumerate(data.client_indices):
        theta = w.clone()
        for _ in range(k):
            theta = theta - nu * (grad(data.x[rows], data.y[rows], theta) + lam * (theta - w))
        with fed.personalize(cid):
            torch.testing.assert_close(flat(fed.params), theta, rtol=0, atol=1e-12)


def test_state_lives_in_the_store_on_the_cpu() -> None:
    data = regression([6, 9])
    fed = _fed(data, PFedMe(), clients_per_round=2)
    run_rounds(fed, 1)
    state = fed.store.get(0)
    assert sorted(state) == ["pfedme/theta/0", "pfedme/theta/1"] and all(t.device.type == "cpu" for t in state.values())


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"lam": 0}, "algo.lam"), ({"personal_lr": 0}, "algo.personal_lr"), ({"inner_steps": 0}, "algo.inner_steps")]
    + [({"personal": "fresh"}, "algo.personal")],
)
def test_bad_options_stop_with_one_line(kwargs: dict, key: str) -> None:
    raises_one_line(PFedMe, match=key, **kwargs)


def test_momentum_is_refused_before_the_run() -> None:
    with pytest.raises(ConfigError, match="algo.momentum"):
        PFedMe().check_setup(None, FederationConfig(momentum=0.9))
