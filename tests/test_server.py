"""Server optimizer updates against their closed forms (Reddi et al. 2021, Alg. 2; FedAvgM), and the optimizers
through whole federations: reductions to FedAvg, resume, 2 ranks, the vectorised runner."""

from __future__ import annotations

import pytest
import torch
from helpers import linear, make_fed, run_rounds, toy_data

from flx.server import ServerOptConfig, ServerOptimizer


def _run(cfg: ServerOptConfig, means: list[torch.Tensor], w0: torch.Tensor) -> tuple[torch.Tensor, ServerOptimizer]:
    w = [w0.clone()]
    opt = ServerOptimizer(w, cfg)
    for m in means:
        opt.step([m])
    return w[0], opt


W0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
M1 = torch.tensor([0.5, -1.0, 0.5], dtype=torch.float64)
M2 = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)


def test_fedavg_is_an_exact_copy_of_the_mean() -> None:
    m = torch.tensor([0.1, 0.2, 0.3])
    w, _ = _run(ServerOptConfig(), [m], torch.tensor([7.0, 8.0, 9.0]))
    assert torch.equal(w, m)


def test_server_sgd_with_momentum() -> None:
    """FedAvgM: v1 = d1, w1 = w0 + lr v1; v2 = beta v1 + d2, w2 = w1 + lr v2, with d_t = m_t - w_{t-1}."""
    lr, beta = 0.7, 0.9
    w, _ = _run(ServerOptConfig(name="sgd", lr=lr, momentum=beta), [M1, M2], W0)
    v1 = M1 - W0
    w1 = W0 + lr * v1
    v2 = beta * v1 + (M2 - w1)
    torch.testing.assert_close(w, w1 + lr * v2, rtol=0, atol=1e-14)


def test_fedadam_without_bias_correction() -> None:
    """m_t = b1 m + (1-b1) d, v_t = b2 v + (1-b2) d^2, w += lr m_t / (sqrt(v_t) + tau)."""
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    w, _ = _run(ServerOptConfig(name="adam", lr=lr, betas=(b1, b2), eps=tau), [M1, M2], W0)
    m = v = torch.zeros(3, dtype=torch.float64)
    x = W0.clone()
    for mean in (M1, M2):
        d = mean - x
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d
        x = x + lr * m / (v.sqrt() + tau)
    torch.testing.assert_close(w, x, rtol=0, atol=1e-14)


def _adaptive_by_hand(name: str, means: list[torch.Tensor], lr: float, b1: float, b2: float, tau: float, v0: float):
    """Reddi et al. Algorithm 2 written out: m_{-1} = 0, v_{-1} = v0, then per step Delta = mean - x,
    m = b1 m + (1-b1) Delta, adagrad v = v + Delta^2 | yogi v = v - (1-b2) Delta^2 sign(v - Delta^2),
    x = x + lr m / (sqrt(v) + tau). Returns the iterates after each step and the signs yogi saw."""
    m, v, x = torch.zeros(3, dtype=torch.float64), torch.full((3,), v0, dtype=torch.float64), W0.clone()
    xs, signs = [], []
    for mean in means:
        d = mean - x
        m = b1 * m + (1 - b1) * d
        if name == "adagrad":
            v = v + d * d
        else:
            signs.append(torch.sign(v - d * d))
            v = v - (1 - b2) * d * d * torch.sign(v - d * d)
        x = x + lr * m / (v.sqrt() + tau)
        xs.append(x)
    return xs, signs


M0 = torch.tensor([0.5, -1.0, 0.6], dtype=torch.float64)  # Delta_0 = M0 - W0 nonzero in every coordinate
STEP2 = torch.tensor([1e-4, -1e-4, 2.0], dtype=torch.float64)  # Delta_1: small in two coordinates, large in one


@pytest.mark.parametrize("name", ["adagrad", "yogi"])
def test_adagrad_and_yogi_one_and_two_steps_are_algorithm_2(name: str) -> None:
    """One and two server steps against the paper's update written by hand, with the default v_{-1} = tau^2. The
    second step's mean leaves Delta small in some coordinates and large in another, so yogi's sign(v - Delta^2)
    takes both signs there (both branches of its update run)."""
    lr, b1, b2, tau = 0.3, 0.9, 0.99, 1e-2
    cfg = ServerOptConfig(name=name, lr=lr, betas=(b1, b2), eps=tau)
    first, _ = _adaptive_by_hand(name, [M0], lr, b1, b2, tau, tau**2)
    means = [M0, first[0] + STEP2]
    expected, signs = _adaptive_by_hand(name, means, lr, b1, b2, tau, tau**2)
    for k in (1, 2):
        w, opt = _run(cfg, means[:k], W0)
        torch.testing.assert_close(w, expected[k - 1], rtol=0, atol=1e-15)
        assert opt.state["step"] == k
    if name == "yogi":
        assert (signs[0] == -1).all() and (signs[1] == 1).any() and (signs[1] == -1).any()


@pytest.mark.parametrize("name", ["adagrad", "yogi", "adam"])
def test_initial_accumulator_is_v_minus_1(name: str) -> None:
    """``initial_accumulator`` is the v_{-1} of Algorithm 2; None gives tau^2 for adagrad and yogi, 0 for adam."""
    lr, b1, b2, tau, v0 = 0.1, 0.9, 0.99, 1e-3, 0.25
    w, _ = _run(ServerOptConfig(name=name, lr=lr, betas=(b1, b2), eps=tau, initial_accumulator=v0), [M1], W0)
    d = M1 - W0
    yogi = v0 - (1 - b2) * d * d * torch.sign(v0 - d * d)
    v = {"adagrad": v0 + d * d, "yogi": yogi, "adam": b2 * v0 + (1 - b2) * d * d}
    torch.testing.assert_close(w, W0 + lr * (1 - b1) * d / (v[name].sqrt() + tau), rtol=0, atol=1e-15)
    assert ServerOptConfig(name=name, eps=tau).initial_v() == (0.0 if name == "adam" else tau**2)


@pytest.mark.parametrize("name", ["adam", "adagrad", "yogi", "sgd"])
def test_state_dict_roundtrip_continues_identically(name: str) -> None:
    cfg = ServerOptConfig(name=name, lr=0.1, momentum=0.9 if name == "sgd" else 0.0)
    full, _ = _run(cfg, [M1, M2], W0)
    half, opt = _run(cfg, [M1], W0)
    w = [half.clone()]
    resumed = ServerOptimizer(w, cfg)
    resumed.load_state_dict(opt.state_dict())
    resumed.step([M2])
    assert torch.equal(w[0], full) and resumed.state["step"] == 2


# ---------------------------------------------------------------------------------------------- through federations
F64 = torch.float64
SIZES = [7, 12, 30, 4, 19, 25, 9, 16]
OPTS = {
    "fedavgm": ServerOptConfig(name="sgd", lr=0.5, momentum=0.9),
    "fedadagrad": ServerOptConfig(name="adagrad", lr=0.05, eps=1e-2),
    "fedyogi": ServerOptConfig(name="yogi", lr=0.05, eps=1e-2),
}


def _fed(server: ServerOptConfig, **kw: object):
    cfg = dict(clients_per_round=5, local_steps=3, batch_size=5, lr=0.2, seed=3, server=server) | kw
    return make_fed(linear(dtype=F64), toy_data(SIZES, dtype=F64), **cfg)


def _flat(fed) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in fed.params])


def _set(fed, flat: torch.Tensor) -> None:
    """Copies a flat vector into the net's parameters, in place (the federation holds views of them)."""
    with torch.no_grad():
        for p, x in zip(fed.params, flat.split([p.numel() for p in fed.params])):
            p.copy_(x.view_as(p))


def test_fedavgm_with_momentum_0_is_fedavg_bitwise() -> None:
    """FedAvgM's config with beta = 0 and eta_s = 1 is FedAvg through whole rounds, bit for bit (the step is then
    the exact copy of the mean: w + (m - w) is not m in floating point)."""
    fedavg, fedavgm = _fed(ServerOptConfig()), _fed(ServerOptConfig(name="sgd", lr=1.0, momentum=0.0))
    for fed in (fedavg, fedavgm):
        run_rounds(fed, 4)
    assert torch.equal(_flat(fedavg), _flat(fedavgm))


def test_fedavgm_through_rounds_is_momentum_on_the_fedavg_means() -> None:
    """FedAvgM over 3 rounds == the momentum recursion v = beta v + (m_t - w_t), w_{t+1} = w_t + eta_s v applied by hand
    to the means a FedAvg federation computes from the same global model each round."""
    cfg = OPTS["fedavgm"]
    fedavgm, fedavg = _fed(cfg), _fed(ServerOptConfig())
    run_rounds(fedavgm, 3)
    w, v = _flat(fedavg).clone(), torch.zeros_like(_flat(fedavg))
    for r in range(3):
        _set(fedavg, w)
        run_rounds(fedavg, 1, start=r)
        v = cfg.momentum * v + (_flat(fedavg) - w)
        w = w + cfg.lr * v
    torch.testing.assert_close(_flat(fedavgm), w, rtol=0, atol=1e-14)


@pytest.mark.parametrize("name", list(OPTS))
def test_resumed_equals_uninterrupted(name: str) -> None:
    """1 round, the federation's state_dict loaded into a fresh one (with the global model), 1 more round == 2 rounds
    straight, bit for bit: the optimizer's moments ride in the checkpoint."""
    whole = _fed(OPTS[name])
    run_rounds(whole, 2)
    first, second = _fed(OPTS[name]), _fed(OPTS[name])
    run_rounds(first, 1)
    second.load_state_dict(first.state_dict())
    with torch.no_grad():
        for a, b in zip(second.params, first.params):
            a.copy_(b)
    run_rounds(second, 1, start=1)
    assert torch.equal(_flat(second), _flat(whole))


def _two_ranks(server: ServerOptConfig, rounds: int):
    """Two simulated ranks, one after the other; the collective sums the ranks' buffers."""
    sent: dict[int, torch.Tensor] = {}
    ranks = [
        _fed(server, rank=r, world_size=2, reduce_sum=lambda t: sum(sent.values()))
        for r in (0, 1)  # noqa: B023
    ]
    for r in range(rounds):
        shards = [fed.begin_round(r).shard for fed in ranks]
        for k, fed in enumerate(ranks):
            for cid in shards[k]:
                fed.train_client(cid)
            sent[k] = fed.aggregator._flat.clone()
        for fed in ranks:
            fed.end_round()
    return ranks


@pytest.mark.parametrize("name", ["fedavgm", "fedyogi"])
def test_two_ranks_equal_one(name: str) -> None:
    """2 ranks == 1 (float64, allclose 1e-12: the ranks' partial sums change only the summation order)."""
    single = _fed(OPTS[name])
    run_rounds(single, 3)
    for fed in _two_ranks(OPTS[name], 3):
        torch.testing.assert_close(_flat(fed), _flat(single), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["fedavgm", "fedyogi"])
def test_vectorized_equals_sequential(name: str) -> None:
    """algo.vectorize=true == the sequential runner (float64, allclose 1e-10 as tests/test_vectorized.py: the stacked
    steps differ only in summation order)."""
    seq, vec = _fed(OPTS[name]), _fed(OPTS[name], vectorize=True)
    for fed in (seq, vec):
        run_rounds(fed, 3)
    torch.testing.assert_close(_flat(vec), _flat(seq), rtol=0, atol=1e-10)
