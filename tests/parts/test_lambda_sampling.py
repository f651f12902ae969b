"""Lambda sampling (DRFA family): the dual steps against hand computation, sampling laws, composition with FedProx."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, run_rounds
from torch import nn

from flx import simplex
from flx.datamodules.datamodule import ClientStore
from flx.errors import ConfigError
from flx.parts.proximal.prox import Prox
from flx.parts.robustness.lambda_sampling import _EVAL_SET_TAG, _SNAPSHOT_TAG, LambdaSampling
from flx.sampling import derive_seed

SEED = 0


def _data(sizes: tuple[int, ...] = (6, 9, 5, 7), dim: int = 3) -> ClientStore:
    """Client c's labels are mostly class c % 3 (heterogeneous losses), float64."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(sum(sizes), dim, generator=g, dtype=torch.float64)
    y = torch.cat([torch.full((n,), c % 3) for c, n in enumerate(sizes)])
    y[::4] = torch.randint(0, 3, (len(y[::4]),), generator=g)
    bounds = np.cumsum((0, *sizes))
    return ClientStore(x, y, [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])])


def _net() -> nn.Module:
    return linear(3, 3, dtype=torch.float64)


def _fed(net: nn.Module, parts: list, data: ClientStore, tau: int = 3, m: int = 4, lr: float = 0.3, **kw: object):
    # batch_size above every client size: each local step is a full-batch gradient step (order-free)
    return make_fed(
        net,
        data,
        parts=parts,
        clients_per_round=m,
        local_steps=tau,
        lr=lr,
        batch_size=100,
        weighting="uniform",
        seed=SEED,
        **kw,
    )


def _gd(w: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float, steps: int, mu: float = 0.0):
    """``steps`` full-batch GD steps on the mean cross-entropy (+ mu/2 ||w - w0||^2) from ``w``."""
    w0, w = [t.detach() for t in w], [t.detach().clone() for t in w]
    for _ in range(steps):
        wr = [t.clone().requires_grad_() for t in w]
        grads = torch.autograd.grad(F.cross_entropy(x @ wr[0].T + wr[1], y), wr)
        w = [t - lr * (g + mu * (t - t0)) for t, g, t0 in zip(w, grads, w0)]
    return w


def _loss(w: list[torch.Tensor], data: ClientStore, cid: int) -> float:
    rows = data.client_indices[cid]
    return float(F.cross_entropy(data.x[rows] @ w[0].T + w[1], data.y[rows]))


def _snapshot_and_mean(data: ClientStore, w0: list[torch.Tensor], rnd, tau: int, lr: float, mu: float = 0.0):
    """The averaged snapshot (after j local steps) and the new global model, both weighted by multiplicity."""
    j = int(np.random.default_rng(derive_seed(SEED, rnd.round, _SNAPSHOT_TAG)).integers(1, tau + 1))
    snaps, finals, weights = [], [], []
    for cid in rnd.cohort:
        mult = rnd.draws[cid]
        x, y = data.x[data.client_indices[cid]], data.y[data.client_indices[cid]]
        snaps.append(_gd(w0, x, y, lr, j, mu))
        finals.append(_gd(w0, x, y, lr, tau, mu))
        weights.append(mult)
    avg = lambda ws: [sum(k * t for k, t in zip(weights, ts)) / sum(weights) for ts in zip(*ws)]  # noqa: E731
    return avg(snaps), avg(finals)


def _eval_set(round_idx: int, n: int, m: int) -> list[int]:
    rng = np.random.default_rng(derive_seed(SEED, round_idx, _EVAL_SET_TAG))
    return sorted(rng.choice(n, size=m, replace=False).tolist())


@pytest.mark.parametrize("regularizer", ["none", "chi2", "kl"])
def test_drfa_round_matches_algorithm_1(regularizer: str) -> None:
    """One round: lambda^1 = Proj(lambda^0 + tau gamma v) (or DRFA-Prox's prox), v_i = (N/m) f_i(w^(t')) on U,
    w^(t') the multiplicity-weighted mean of the cohort's models after j local steps; the global model is the
    unweighted mean over the draws. Written out independently with full-batch steps, float64."""
    data, tau, lr, gamma, rho, m = _data(), 3, 0.3, 0.05, 0.7, 3
    part = LambdaSampling(
        gamma=gamma, regularizer=regularizer, rho=rho if regularizer != "none" else 0.0, eval_batch=100
    )
    net = _net()
    w0 = [p.detach().clone() for p in net.parameters()]
    fed = _fed(net, [part], data, tau=tau, m=m, lr=lr)
    run_rounds(fed, 1)
    snap, mean = _snapshot_and_mean(data, w0, fed.rnd, tau, lr)
    for p, q in zip(net.parameters(), mean):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-12)
    n, u = 4, _eval_set(0, 4, m)
    v = torch.zeros(n, dtype=torch.float64)
    for cid in u:
        v[cid] = n / m * _loss(snap, data, cid)
    y = torch.full((n,), 1 / n, dtype=torch.float64) + tau * gamma * v
    expected = {
        "none": lambda: simplex.project_simplex(y),
        "chi2": lambda: simplex.prox_chi2(y, gamma * tau * rho),
        "kl": lambda: simplex.prox_kl(y, gamma * tau * rho),
    }[regularizer]()
    torch.testing.assert_close(part.lam, expected, rtol=0, atol=1e-12)
    assert not torch.allclose(part.lam, torch.full((n,), 0.25, dtype=torch.float64))


def test_drfa_ga_uses_full_losses_at_the_round_start_model() -> None:
    """DRFA-GA (Alg. 3, chi2 regulariser): lambda^1 = Proj(lambda^0 + gamma (f(w_bar^0) + grad g(lambda^0)))."""
    data, gamma, rho = _data(), 0.2, 0.5
    part = LambdaSampling(gamma=gamma, mode="ga", regularizer="chi2", rho=rho, lambda_init="num_samples")
    net = _net()
    w0 = [p.detach().clone() for p in net.parameters()]
    run_rounds(_fed(net, [part], data), 1)
    lam0 = torch.tensor([6, 9, 5, 7], dtype=torch.float64) / 27
    f = torch.tensor([_loss(w0, data, c) for c in range(4)], dtype=torch.float64)
    expected = simplex.project_simplex(lam0 + gamma * (f - rho * (lam0 - 0.25)))
    torch.testing.assert_close(part.lam, expected, rtol=0, atol=1e-12)


def test_uniform_weighted_aggregation_of_the_authors_code() -> None:
    """FedTorch: uniform cohort without replacement, w <- w - sum_{i in D} lam_i (N/m) (w - w_i); gamma decayed
    before the first round (gamma * 0.9), floor 1e-3 then renormalised."""
    data, tau, lr, m = _data(), 2, 0.3, 2
    part = LambdaSampling(
        gamma=0.05,
        sampling="uniform_weighted",
        gamma_decay=0.9,
        lambda_floor=1e-3,
        lambda_init="num_samples",
        eval_batch=100,
    )
    net = _net()
    w0 = [p.detach().clone() for p in net.parameters()]
    fed = _fed(net, [part], data, tau=tau, m=m, lr=lr)
    run_rounds(fed, 1)
    lam0 = torch.tensor([6, 9, 5, 7], dtype=torch.float64) / 27
    assert tuple(fed.rnd.draws[c] for c in fed.rnd.cohort) == (1, 1)
    expected = [t.clone() for t in w0]
    for cid in fed.rnd.cohort:
        wi = _gd(w0, data.x[data.client_indices[cid]], data.y[data.client_indices[cid]], lr, tau)
        expected = [e - lam0[cid] * 4 / m * (t0 - t) for e, t0, t in zip(expected, w0, wi)]
    for p, q in zip(net.parameters(), expected):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-12)
    assert part.gamma_at(0) == pytest.approx(0.045) and part.gamma_at(2) == pytest.approx(0.05 * 0.9**3)
    assert float(part.lam.sum()) == pytest.approx(1.0) and float(part.lam.min()) >= 1e-3 / (1 + 4e-3)


def test_afl_snapshot_is_the_new_global_model() -> None:
    """tau = 1 (AFL): the only snapshot step is the last, so w^(t') is the new global model and lambda moves with
    the losses at it."""
    data, gamma = _data(), 0.1
    part = LambdaSampling(gamma=gamma, eval_batch=100)
    net = _net()
    fed = _fed(net, [part], data, tau=1, m=4)
    run_rounds(fed, 1)
    w1 = [p.detach().clone() for p in net.parameters()]
    v = torch.zeros(4, dtype=torch.float64)
    for cid in _eval_set(0, 4, 4):
        v[cid] = _loss(w1, data, cid)
    torch.testing.assert_close(part.lam, simplex.project_simplex(0.25 + gamma * v), rtol=0, atol=1e-12)


def test_cohort_draws_follow_lambda_with_replacement_and_t_prime_is_uniform() -> None:
    """Over many rounds with lambda frozen (gamma tiny), a client's share of the draws is lambda_i, repeats occur,
    and the snapshot step j is uniform on {1..tau} (chi-square-free checks at 4-sigma tolerances)."""
    part = LambdaSampling(gamma=1e-12)
    fed = _fed(_net(), [part], _data(), tau=4, m=5)
    part.lam = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    counts, steps, repeats, rounds = np.zeros(4), np.zeros(5), 0, 2000
    for r in range(rounds):
        draws = fed.sample(r)
        counts += np.bincount(draws, minlength=4)
        repeats += len(set(draws)) < len(draws)
        part.on_round_start(fed, fed.rnd or type("R", (), {"round": r})())
        steps[part._snap_step] += 1
    share = counts / counts.sum()
    sd = np.sqrt(part.lam.numpy() * (1 - part.lam.numpy()) / counts.sum())
    assert np.all(np.abs(share - part.lam.numpy()) < 4 * sd), share
    assert repeats > rounds * 0.9 and steps[0] == 0
    assert np.all(np.abs(steps[1:] / rounds - 0.25) < 4 * np.sqrt(0.25 * 0.75 / rounds)), steps


def test_composes_with_fedprox() -> None:
    """algo=drfa + the FedProx part: the global model is the multiplicity-weighted mean of proximal local GD, and
    Prox(mu=0) changes nothing (bitwise)."""
    data, tau, lr, mu = _data(), 3, 0.3, 0.4
    nets = {}
    for name, parts in {
        "drfa": [LambdaSampling(gamma=0.05, eval_batch=100)],
        "prox0": [LambdaSampling(gamma=0.05, eval_batch=100), Prox(mu=0.0)],
        "prox": [LambdaSampling(gamma=0.05, eval_batch=100), Prox(mu=mu)],
    }.items():
        nets[name] = _net()
        fed = _fed(nets[name], parts, data, tau=tau, m=3, lr=lr)
        run_rounds(fed, 1)
    for p, q in zip(nets["drfa"].parameters(), nets["prox0"].parameters()):
        assert torch.equal(p, q)
    _, mean = _snapshot_and_mean(data, [p.detach() for p in _net().parameters()], fed.rnd, tau, lr, mu)
    for p, q in zip(nets["prox"].parameters(), mean):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-12)


def test_repeat_gives_each_draw_one_weight_in_both_means() -> None:
    """duplicates=repeat: a client drawn k times runs k times, each run with one draw's weight in the primal mean
    and in the snapshot mean w^(t'). Full-batch local steps make the k runs equal, so over rounds whose cohorts
    repeat clients the model and lambda equal the multiplicity run's (to rounding), and round 0 still matches
    Algorithm 1 written out (draw-weighted means, v on U, projection)."""
    data, tau, lr, gamma, m = _data(), 3, 0.3, 0.05, 4
    parts = {mode: LambdaSampling(gamma=gamma, eval_batch=100) for mode in ("multiplicity", "repeat")}
    nets = {mode: _net() for mode in parts}
    w0 = [p.detach().clone() for p in nets["repeat"].parameters()]
    feds = {mode: _fed(nets[mode], [parts[mode]], data, tau=tau, m=m, lr=lr, duplicates=mode) for mode in parts}
    shards = []
    for r in range(4):
        for fed in feds.values():
            rnd = fed.begin_round(r)
            for cid in rnd.shard:
                fed.train_client(cid)
            fed.end_round()
            if r == 0:
                snap0, mean0 = _snapshot_and_mean(data, w0, rnd, tau, lr)
                lam0 = parts[fed.cfg.duplicates].lam.clone()
                for p, q in zip(fed.net.parameters(), mean0):
                    torch.testing.assert_close(p.detach(), q, rtol=0, atol=1e-12)
        shards.append(feds["repeat"].rnd.shard)
        torch.testing.assert_close(parts["repeat"].lam, parts["multiplicity"].lam, rtol=0, atol=1e-12)
    assert any(len(set(s)) < len(s) == m for s in shards), shards  # some round trained a client twice
    v = torch.zeros(4, dtype=torch.float64)
    for cid in _eval_set(0, 4, m):
        v[cid] = 4 / m * _loss(snap0, data, cid)
    torch.testing.assert_close(lam0, simplex.project_simplex(0.25 + tau * gamma * v), rtol=0, atol=1e-12)
    for p, q in zip(nets["repeat"].parameters(), nets["multiplicity"].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"mode": "x"}, "algo.mode"),
        ({"regularizer": "l1"}, "algo.regularizer"),
        ({"gamma": 0}, "algo.gamma"),
        ({"regularizer": "kl", "rho": 0}, "algo.rho"),
        ({"sampling": "poisson"}, "algo.sampling"),
        ({"gamma_decay": 1.5}, "algo.gamma_decay"),
        ({"lambda_floor": -1}, "algo.lambda_floor"),
        ({"lambda_init": "random"}, "algo.lambda_init"),
        ({"eval_batch": 0}, "algo.eval_batch"),
    ],
)
def test_bad_options_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        LambdaSampling(**kwargs)
