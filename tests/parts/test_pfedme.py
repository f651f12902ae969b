r"""pFedMe against hand computations on linear least squares (``least_squares``).

Local step on the full batch: :math:`K` inner steps
:math:`\theta \leftarrow \mathrm{prox}_{\nu h}(\theta - \nu(\nabla f(\theta) + \lambda(\theta - w)))` from the previous
:math:`\theta` (:math:`w^t` at the start), then :math:`w \leftarrow w - \eta\lambda(w - \theta)`; the server takes
:math:`(1 - \beta) w^t + \beta \bar w`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import build_of, linear, make_fed, raises_one_line, run_rounds
from least_squares import f64, flat, grad, l1, loss, mse, prox, regression, xt

from flx.context import FederationConfig
from flx.errors import ConfigError
from flx.federation import Federation
from flx.parts.personalisation.pfedme import PFedMe
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
    part = PFedMe(lam=lam, personal_lr=nu, inner_steps=k, regularizer=l1(mu) if mu else None, personal="stored")
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
    fed = _fed(data, PFedMe(personal="stored"), clients_per_round=1, seed=0)
    run_rounds(fed, 1)
    (unseen,) = [c for c in range(3) if c not in fed.store][:1]
    w = flat(fed.params)
    with fed.personalize(unseen):
        assert torch.equal(flat(fed.params), w)


def test_personal_steps_runs_k_inner_steps_from_the_current_global_model() -> None:
    """``personal=steps`` (named ``solve`` before the ``optimum`` mode existed): K full-batch inner steps from w."""
    lam, nu, k = 3.0, 0.04, 4
    data = regression([7, 5])
    fed = _fed(data, PFedMe(lam=lam, personal_lr=nu, inner_steps=k, personal="steps"), clients_per_round=2)
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
    + [({"personal": "fresh"}, "algo.personal"), ({"personal_tol": 0}, "algo.personal_tol")]
    + [({"personal_tol": 1.5}, "algo.personal_tol"), ({"personal_max_steps": 0}, "algo.personal_max_steps")],
)
def test_bad_options_stop_with_one_line(kwargs: dict, key: str) -> None:
    raises_one_line(PFedMe, match=key, **kwargs)


def test_the_former_solve_names_its_new_name() -> None:
    assert "'solve' is now 'steps'" in raises_one_line(
        PFedMe, match="allowed: optimum, stored, steps", personal="solve"
    )


def test_momentum_is_refused_before_the_run() -> None:
    with pytest.raises(ConfigError, match="algo.momentum"):
        PFedMe().check(build_of([], FederationConfig(momentum=0.9)))


# ---------------------------------------------------------------------- personal=optimum
def _closed_form(x, y, w, lam):
    """argmin (1/n)||X~ theta - y||^2 + lam/2 ||theta - w||^2: (2/n X~^T X~ + lam I) theta = 2/n X~^T y + lam w."""
    a, n = xt(x), len(x)
    return torch.linalg.solve(
        2 / n * a.T @ a + lam * torch.eye(a.shape[1], dtype=f64), 2 / n * a.T @ y.reshape(-1) + lam * w
    )


def test_optimum_is_the_closed_form_minimiser_at_the_current_global_model() -> None:
    """h = 0 (pFedMe's Eqs. 2-3): theta_i(w) is the ridge solution around w, to float64 precision with the default
    tolerance; the memo is dropped when w changes (round 2 gives the new w's solution)."""
    lam = 2.0
    data = regression([7, 30, 12], dim=4)
    fed = _fed(data, PFedMe(lam=lam, personal_lr=0.05, inner_steps=3), clients_per_round=2)
    for rnd in range(2):
        run_rounds(fed, 1, start=rnd)
        w = flat(fed.params)
        for cid, rows in enumerate(data.client_indices):
            expected = _closed_form(data.x[rows], data.y[rows], w, lam)
            for _ in range(2):  # the second from the memo
                with fed.personalize(cid):
                    torch.testing.assert_close(flat(fed.params), expected, rtol=0, atol=1e-10)
            assert torch.equal(flat(fed.params), w)


def test_optimum_with_l1_satisfies_the_optimality_condition() -> None:
    """h = mu ||weight||_1: 0 in grad f(theta) + lam (theta - w) + mu d||.||_1(theta), i.e. per weight entry
    r_k = -mu sign(theta_k) where theta_k != 0 and |r_k| <= mu where theta_k = 0 (r = grad f + lam (theta - w)), and
    r = 0 on the bias; some entries are exactly 0 and some are not."""
    lam, mu = 1.0, 0.8
    data = regression([20, 15], dim=6)
    fed = _fed(data, PFedMe(lam=lam, regularizer=l1(mu)), clients_per_round=2)
    run_rounds(fed, 1)
    w = flat(fed.params)
    for cid, rows in enumerate(data.client_indices):
        with fed.personalize(cid):
            theta = flat(fed.params)
        r = grad(data.x[rows], data.y[rows], theta) + lam * (theta - w)
        zero = theta[:-1] == 0
        assert 0 < int(zero.sum()) < len(zero)
        torch.testing.assert_close(r[:-1][~zero], -mu * torch.sign(theta[:-1][~zero]), rtol=0, atol=1e-10)
        assert float(r[:-1][zero].abs().max()) <= mu + 1e-10
        assert abs(float(r[-1])) <= 1e-10


def test_the_step_cap_warns_once_and_still_installs_the_last_iterate(caplog: pytest.LogCaptureFixture) -> None:
    """One iteration: the model is one backtracked step from w, neither w nor the minimiser; one warning for both
    clients."""
    lam = 0.5
    data = regression([7, 9])
    fed = _fed(data, PFedMe(lam=lam, personal_max_steps=1), clients_per_round=2)
    w = flat(fed.params)
    with caplog.at_level("WARNING", logger="flx.parts.personalisation.pfedme"):
        for cid, rows in enumerate(data.client_indices):
            with fed.personalize(cid):
                theta = flat(fed.params)
            assert float((theta - w).abs().max()) > 1e-3
            assert float((theta - _closed_form(data.x[rows], data.y[rows], w, lam)).abs().max()) > 1e-6
    assert len([r for r in caplog.records if "algo.personal_max_steps=1" in r.getMessage()]) == 1
