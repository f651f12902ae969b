r"""AugFL's client and server steps against hand computations on linear least squares (``least_squares``).

Quadratic losses make every quantity explicit: :math:`\nabla L(w; R) = \frac{2}{n} \tilde X_R^\top(\tilde X_R w - y_R)`,
:math:`\nabla^2 L(\cdot; S) = H_S` (the central difference of Eq. 10 is exact on a quadratic up to rounding) and,
with ``rh=l2``, :math:`\nabla R_h = 2 (\theta - \theta_p)`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import linear, make_fed, raises_one_line, run_rounds
from least_squares import f64, flat, grad, hess, mse, regression
from least_squares import loss as ls_loss
from torch import nn

from flx.datamodules.datamodule import ClientStore
from flx.parts.meta_learning.adapt import Adapt
from flx.parts.meta_learning.meta_update import _Y, MetaUpdate, maml_gradient
from flx.parts.meta_learning.per_fedavg import PerFedAvg
from flx.parts.meta_learning.pm_regularizer import PMRegularizer
from flx.resources import ServerResources

SIZES = [8, 6, 10]
ALPHA, RHO = 0.05, 2.0


def few_shot(sizes=SIZES, seed: int = 0, heldout: int = 0) -> ClientStore:
    """Regression clients; the first half of each client's rows is its support set, the rest its query set; the last
    ``heldout`` clients are evaluation-only."""
    data = regression(sizes, seed=seed)
    support = [rows[: len(rows) // 2] for rows in data.client_indices]
    return ClientStore(data.x, data.y, data.client_indices, len(sizes) - heldout, support)


def _fed(data, parts, resources=None, **kw):
    kw = {"clients_per_round": 3, "local_steps": 0, "aggregator": "admm_sum", "weighting": "uniform", "lr": 1.0} | kw
    return make_fed(linear(3, 1, dtype=f64), data, parts, loss_fn=mse, resources=resources, **kw)


def _pm(seed: int = 5) -> nn.Linear:
    pm = linear(3, 1, seed=seed, dtype=f64)
    pm.requires_grad_(False)
    return pm


def _rows(data: ClientStore, cid: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = data.client_indices[cid]
    return rows[: len(rows) // 2], rows[len(rows) // 2 :]


def _g_hat(data: ClientStore, cid: int, theta: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    s, q = _rows(data, cid)
    phi = theta - alpha * grad(data.x[s], data.y[s], theta)
    r = grad(data.x[q], data.y[q], phi)
    return r - alpha * hess(data.x[s]) @ r


# ---------------------------------------------------------------------- the client step
@pytest.mark.parametrize("mode", ["fd", "exact"])
def test_maml_gradient_matches_the_closed_form(mode: str) -> None:
    data = few_shot()
    fed = _fed(data, [])
    theta = [q.detach() for q in fed.params]
    s, q = _rows(data, 1)
    loss, g_hat = maml_gradient(fed, theta, s, q, ALPHA, mode, delta=1e-3)
    torch.testing.assert_close(flat(g_hat), _g_hat(data, 1, flat(theta)), rtol=0, atol=1e-9)
    phi = flat(theta) - ALPHA * grad(data.x[s], data.y[s], flat(theta))
    assert float(loss) == pytest.approx(ls_loss(data.x[q], data.y[q], phi))


def test_the_finite_difference_matches_double_backward_on_a_smooth_net() -> None:
    """Eq. 10 with delta_t = 1/(10 t + 100) against the exact Hessian-vector product on a tanh MLP (not quadratic):
    the central difference's error is O(delta^2), so the first rounds' radius 1/110 agrees to ~1e-4 relative."""
    data = few_shot([12, 9])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(f64)
    fed = make_fed(net, data, [], loss_fn=mse)
    theta = [q.detach() for q in fed.params]
    s, q = _rows(data, 0)
    _, fd = maml_gradient(fed, theta, s, q, 0.3, "fd", delta=1 / 110)
    _, exact = maml_gradient(fed, theta, s, q, 0.3, "exact", delta=1 / 110)
    err = (flat(fd) - flat(exact)).norm() / flat(exact).norm()
    assert 0 < float(err) < 1e-4


def test_admm_iterates_match_the_hand_computation_with_l2_to_the_pm() -> None:
    """Three rounds of Alg. 1 (all clients): theta_i = theta - (y_i + w_i g_i) / rho, y_i += rho (theta_i - theta),
    theta <- (sum (y_i + rho theta_i) - lam 2 (theta - theta_p)) / (N rho), with w_i = D_i / sum D and the identity
    y_i = -w_i g_i (Eqs. 11-12; the paper's Eq. 83) after every round."""
    data, lam, pm = few_shot(), 0.3, _pm()
    resources = ServerResources(torch.empty(0, dtype=torch.long), {"pm": pm})
    parts = [MetaUpdate(alpha=ALPHA, rho=RHO), PMRegularizer(lam=lam, rh="l2")]
    fed = _fed(data, parts, resources=resources)
    theta, theta_p = flat(fed.params), flat(list(pm.parameters()))
    y = [torch.zeros_like(theta) for _ in SIZES]
    w = [n / sum(SIZES) for n in SIZES]
    for t in range(3):
        run_rounds(fed, 1, start=t)
        uploads = []
        for i in range(3):
            g = _g_hat(data, i, theta)
            theta_i = theta - (y[i] + w[i] * g) / RHO
            y[i] = y[i] + RHO * (theta_i - theta)
            torch.testing.assert_close(y[i], -w[i] * g, rtol=0, atol=1e-12)
            uploads.append(y[i] + RHO * theta_i)
        theta = (sum(uploads) - lam * 2 * (theta - theta_p)) / (3 * RHO)
        torch.testing.assert_close(flat(fed.params), theta, rtol=0, atol=1e-10)
        for i in range(3):
            stored = fed.store.get(i)
            torch.testing.assert_close(flat([stored[f"{_Y}{k}"] for k in range(2)]), y[i], rtol=0, atol=1e-12)


def test_full_participation_is_optimistic_gradient_descent() -> None:
    """Eqs. 11-13 with y_i = -w_i g_i: with every client, theta^{t+1} = theta^t - [sum_i w_i (2 g_i^t - g_i^{t-1})] /
    (N rho) (lam = 0)."""
    data = few_shot()
    fed = _fed(data, [MetaUpdate(alpha=ALPHA, rho=RHO)])
    theta = flat(fed.params)
    w = [n / sum(SIZES) for n in SIZES]
    prev = [torch.zeros_like(theta) for _ in SIZES]
    for t in range(3):
        run_rounds(fed, 1, start=t)
        g = [_g_hat(data, i, theta) for i in range(3)]
        theta = theta - sum(w[i] * (2 * g[i] - prev[i]) for i in range(3)) / (3 * RHO)
        prev = g
        torch.testing.assert_close(flat(fed.params), theta, rtol=0, atol=1e-10)


def test_delta_schedule_counts_each_clients_rounds() -> None:
    part = MetaUpdate(delta_index="client")
    assert part.delta(None, 1) == pytest.approx(1 / 110) and part.delta(None, 3) == pytest.approx(1 / 130)
    data = few_shot()
    fed = _fed(data, [part], clients_per_round=1)
    run_rounds(fed, 4)
    counts = {cid: int(fed.store.get(cid)["augfl/t"]) for cid in range(3) if cid in fed.store}
    assert sum(counts.values()) == 4  # one client a round, each counting its own rounds


def test_resumed_equals_uninterrupted() -> None:
    """The duals ride in the federation's checkpointed store: 2 rounds, save, load into a fresh federation, 2 more ==
    4 rounds."""
    data = few_shot()
    whole = _fed(data, [MetaUpdate(alpha=ALPHA, rho=RHO)])
    run_rounds(whole, 4)
    first = _fed(data, [MetaUpdate(alpha=ALPHA, rho=RHO)])
    run_rounds(first, 2)
    second = _fed(data, [MetaUpdate(alpha=ALPHA, rho=RHO)])
    second.load_state_dict(first.state_dict())
    with torch.no_grad():
        for a, b in zip(second.params, first.params):
            a.copy_(b)
    run_rounds(second, 2, start=2)
    assert torch.equal(flat(second.params), flat(whole.params))


def test_client_uploads_do_not_depend_on_the_pm() -> None:
    """The PM enters only the server step: with two different PMs the clients' uploads (the state store) are equal
    after a round, the global models differ."""
    data = few_shot()
    feds = []
    for seed in (5, 6):
        resources = ServerResources(torch.empty(0, dtype=torch.long), {"pm": _pm(seed)})
        parts = [MetaUpdate(alpha=ALPHA, rho=RHO), PMRegularizer(lam=1.0, rh="l2")]
        feds.append(_fed(data, parts, resources=resources))
        run_rounds(feds[-1], 1)
    for cid in range(3):
        assert all(torch.equal(a, b) for a, b in zip(feds[0].store.get(cid).values(), feds[1].store.get(cid).values()))
    assert not torch.equal(flat(feds[0].params), flat(feds[1].params))


def test_bad_values_and_missing_pieces_stop_with_one_line() -> None:
    raises_one_line(MetaUpdate, rho=0.0, match="algo.rho")
    raises_one_line(MetaUpdate, hessian="bfgs", match="algo.hessian")
    raises_one_line(MetaUpdate, delta_index="x", match="algo.delta_index")
    raises_one_line(PMRegularizer, rh="mse", match="algo.rh")
    raises_one_line(PMRegularizer, lam=-1.0, match="algo.lam")
    plain = regression(SIZES)  # no support / query sets
    raises_one_line(_fed, plain, [MetaUpdate()], match="partition=few_shot")
    raises_one_line(_fed, few_shot(), [PMRegularizer(lam=1.0)], match="server.models.pm")


# ---------------------------------------------------------------------- adaptation and Per-FedAvg
def test_adapt_is_one_gradient_step_on_the_support_set() -> None:
    """A held-out client (the last) is personalised by theta - alpha grad L(theta; its rows = support)."""
    data = few_shot(heldout=1)
    fed = _fed(data, [Adapt(steps=2, lr=0.1)], clients_per_round=2, aggregator="mean", local_steps=1)
    theta = flat(fed.params)
    rows = data.client_support[2]
    assert fed.num_clients == 2 and torch.equal(fed.data.support_rows(2), rows)
    phi = theta
    for _ in range(2):
        phi = phi - 0.1 * grad(data.x[rows], data.y[rows], phi)
    with fed.personalize(2):
        torch.testing.assert_close(flat(fed.params), phi, rtol=0, atol=1e-12)
    assert torch.equal(flat(fed.params), theta)


@pytest.mark.parametrize("mode", ["none", "exact"])
def test_per_fedavg_local_steps_match_the_hand_update(mode: str) -> None:
    """K = 2 MAML steps of size beta on one client: w <- w - beta (r - alpha H_S r) (FO: w - beta r)."""
    data, beta = few_shot(), 0.1
    fed = _fed(
        data, [PerFedAvg(alpha=ALPHA, hessian=mode)], clients_per_round=1, aggregator="mean", local_steps=2, lr=beta
    )
    w = flat(fed.params)
    rnd = fed.begin_round(0)
    cid = rnd.cohort[0]
    fed.train_client(cid)
    s, q = _rows(data, cid)
    for _ in range(2):
        r = grad(data.x[q], data.y[q], w - ALPHA * grad(data.x[s], data.y[s], w))
        w = w - beta * (r - (ALPHA * hess(data.x[s]) @ r if mode == "exact" else 0))
    torch.testing.assert_close(flat(fed.params), w, rtol=0, atol=1e-12)


def test_adapt_also_evaluates_more_steps_under_their_own_name() -> None:
    """``also_steps=[3]``: at each evaluation epoch end the module is asked for the personalised metrics again under
    ``adapted3``, with the net adapted by 3 steps; the main metric stays at ``steps``."""
    data = few_shot(heldout=1)
    adapt = Adapt(steps=1, lr=0.1, also_steps=[3])
    fed = _fed(data, [adapt], clients_per_round=2, aggregator="mean", local_steps=1)
    theta, rows = flat(fed.params), data.client_support[2]

    def steps(k: int) -> torch.Tensor:
        phi = theta
        for _ in range(k):
            phi = phi - 0.1 * grad(data.x[rows], data.y[rows], phi)
        return phi

    class Module:
        seen: list = []

        def log_personal_metrics(self, stage: str, name: str) -> None:
            with fed.personalize(2):
                self.seen.append((stage, name, flat(fed.params)))

    adapt.on_test_epoch_end(None, Module())
    ((stage, name, got),) = Module.seen
    assert (stage, name) == ("test", "adapted3")
    torch.testing.assert_close(got, steps(3), rtol=0, atol=1e-12)
    with fed.personalize(2):
        torch.testing.assert_close(flat(fed.params), steps(1), rtol=0, atol=1e-12)
