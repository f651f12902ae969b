r"""FedDyn (:class:`flx.parts.drift.feddyn.FedDyn`) on heterogeneous least-squares clients (``drift_closed_forms``): the
exact minimiser where FedAvg stops at its biased fixed point, three rounds written out (the server state h, the
clients' gradient states g_k, the model), alpha = 0 is FedAvg bit for bit, resume, two ranks, the stacked clients.

Algorithm 1 (Acar et al., ICLR 2021): client k takes K steps on :math:`\nabla f_k(\theta) - g_k + \alpha(\theta -
\theta^{t-1})`, then :math:`g_k \leftarrow g_k - \alpha(\theta_k - \theta^{t-1})`; the server
:math:`h \leftarrow h - \alpha \sum_{k \in P} q_k (\theta_k - \theta^{t-1})` with :math:`q_k = p_k / \sum_{j=1}^m p_j`
(all m clients: the paper's :math:`\alpha / m` for uniform weights) and :math:`\theta^t = \bar\theta - h / \alpha`.
"""

from __future__ import annotations

import pytest
import torch
from drift_closed_forms import (
    fed,
    fedavg_fixed_point,
    fedavg_limit,
    local_steps,
    optimum,
    problem,
    quadratic,
    two_ranks,
    weights,
)
from helpers import raises_one_line
from least_squares import flat

from flx.composition import check_pairs
from flx.errors import ConfigError
from flx.parts.drift.feddyn import FedDyn
from flx.parts.privacy.central_dp import CentralDP
from flx.parts.privacy.local_dp import LocalDP

_G = "feddyn/g"
f64 = torch.float64


def _rounds(f, rounds: int) -> None:
    for t in range(rounds):
        f.train_clients(f.begin_round(t).shard)
        f.end_round()


@pytest.mark.parametrize("weighting", ["num_samples", "uniform"])
def test_full_participation_reaches_the_minimiser_where_fedavg_is_biased(weighting: str) -> None:
    """Full participation, K = 5 full-batch local steps (an inexact local solve): FedAvg converges to the fixed point
    of its affine round map (closed form), away from the minimiser of sum_k q_k f_k; FedDyn converges to that
    minimiser. alpha = 2: the iteration's contraction on this problem reaches 1e-14 within 100 rounds (alpha 0.01,
    the run default, contracts far more slowly with 5 inexact local steps)."""
    data = problem()
    q, kw = weights(data, weighting), dict(clients_per_round=4, weighting=weighting)
    dyn = fed(data, [FedDyn(alpha=2.0)], **kw)
    _rounds(dyn, 100)
    w_star, w_avg = optimum(data, q), fedavg_fixed_point(data, q, steps=5, lr=0.05)
    torch.testing.assert_close(fedavg_limit(weighting), w_avg, rtol=0, atol=1e-12)
    assert float((w_avg - w_star).norm()) > 1e-2  # FedAvg's bias: far above the tolerances
    torch.testing.assert_close(flat(dyn.params), w_star, rtol=0, atol=1e-12)
    # at the fixed point g_k = grad f_k(w*) (the first-order condition) and h = sum_k q_k g_k = 0
    for cid in range(4):
        h, b = quadratic(data, cid)
        torch.testing.assert_close(dyn.store.get(cid)[_G], h @ w_star - b, rtol=0, atol=1e-9)
    torch.testing.assert_close(flat(dyn.parts[0].h), torch.zeros(4, dtype=f64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("weighting", ["num_samples", "uniform"])
def test_three_rounds_match_the_written_out_algorithm(weighting: str) -> None:
    """Two of four clients a round: the model, h and every stored g_k after each round, by hand."""
    data, eta, alpha, k = problem(), 0.05, 0.3, 5
    part = FedDyn(alpha=alpha)
    f = fed(data, [part], clients_per_round=2, weighting=weighting, seed=3)
    p = [float(len(i)) if weighting == "num_samples" else 1.0 for i in data.client_indices]
    x, h = flat(f.params), torch.zeros(4, dtype=f64)
    g = {i: torch.zeros(4, dtype=f64) for i in range(4)}
    for t in range(3):
        f.train_clients(f.begin_round(t).shard)
        f.end_round()
        cohort = f.rnd.cohort
        ys = {i: local_steps(data, i, x, k, eta, lambda y, i=i, x=x: alpha * (y - x) - g[i]) for i in cohort}
        for i in cohort:
            g[i] = g[i] - alpha * (ys[i] - x)
        mean = sum(p[i] * ys[i] for i in cohort) / sum(p[i] for i in cohort)
        h = h - alpha * sum(p[i] / sum(p) * (ys[i] - x) for i in cohort)
        x = mean - h / alpha
        torch.testing.assert_close(flat(f.params), x, rtol=0, atol=1e-12)
        torch.testing.assert_close(flat(part.h), h, rtol=0, atol=1e-12)
        for i in range(4):
            stored = f.store.get(i)[_G] if i in f.store else torch.zeros(4, dtype=f64)
            torch.testing.assert_close(stored, g[i], rtol=0, atol=1e-12)
    assert len(f.store.client_ids()) >= 3  # the cohorts differed: the test saw stored and fresh g_k


def test_alpha_zero_is_fedavg_bitwise() -> None:
    """alpha = 0 means no term and no correction: FedAvg's model bit for bit, and no client state kept."""
    data, kw = problem(), dict(clients_per_round=3, seed=2, batch_size=4)
    avg, dyn = fed(data, [], **kw), fed(data, [FedDyn(alpha=0.0)], **kw)
    _rounds(avg, 3)
    _rounds(dyn, 3)
    assert all(torch.equal(a, b) for a, b in zip(avg.params, dyn.params))
    assert dyn.store.client_ids() == []


def test_resumed_equals_uninterrupted() -> None:
    """2 rounds == 1 round, the federation's and the part's state loaded into fresh ones, 1 more round: bit for bit
    (model, h, the stored g_k)."""
    data, kw = problem(), dict(clients_per_round=3, seed=4, batch_size=4)
    whole = fed(data, [FedDyn(alpha=0.5)], **kw)
    _rounds(whole, 2)
    first = fed(data, [FedDyn(alpha=0.5)], **kw)
    _rounds(first, 1)
    second = fed(data, [FedDyn(alpha=0.5)], **kw)
    second.load_state_dict(first.state_dict())
    second.parts[0].load_state_dict(first.parts[0].state_dict())
    with torch.no_grad():
        for a, b in zip(second.params, first.params):
            a.copy_(b)
    second.train_clients(second.begin_round(1).shard)
    second.end_round()
    assert torch.equal(flat(second.params), flat(whole.params))
    assert all(torch.equal(a, b) for a, b in zip(second.parts[0].h, whole.parts[0].h))
    assert second.store.client_ids() == whole.store.client_ids()
    for cid in whole.store.client_ids():
        assert torch.equal(second.store.get(cid)[_G], whole.store.get(cid)[_G])


def test_two_ranks_equal_one() -> None:
    """Two ranks: the model (corrected on every rank alike), h and every rank's store equal the one-process run."""
    data, kw = problem(), dict(clients_per_round=3, seed=2, batch_size=4)
    single = fed(data, [FedDyn(alpha=0.5)], **kw)
    _rounds(single, 3)
    for rank in two_ranks(lambda **r: fed(data, [FedDyn(alpha=0.5)], **kw, **r), 3):
        torch.testing.assert_close(flat(rank.params), flat(single.params), rtol=0, atol=1e-12)
        torch.testing.assert_close(rank.parts[0].h, single.parts[0].h, rtol=0, atol=1e-12)
        assert rank.store.client_ids() == single.store.client_ids()
        for cid in single.store.client_ids():
            torch.testing.assert_close(rank.store.get(cid)[_G], single.store.get(cid)[_G], rtol=0, atol=1e-12)


def test_stacked_clients_equal_the_sequential_ones() -> None:
    """algo.vectorize=true: the same term on the stacked gradients; model, h and g_k equal the sequential run up to
    summation order (1e-10 in float64, as tests/test_vectorized.py)."""
    data, kw = problem(), dict(clients_per_round=3, seed=5, batch_size=4)
    seq, vec = (fed(data, [FedDyn(alpha=0.5)], vectorize=v, **kw) for v in (False, True))
    _rounds(seq, 3)
    _rounds(vec, 3)
    torch.testing.assert_close(flat(vec.params), flat(seq.params), rtol=0, atol=1e-10)
    torch.testing.assert_close(vec.parts[0].h, seq.parts[0].h, rtol=0, atol=1e-10)
    for cid in seq.store.client_ids():
        torch.testing.assert_close(vec.store.get(cid)[_G], seq.store.get(cid)[_G], rtol=0, atol=1e-10)


def test_central_dp_refuses_the_server_correction_local_dp_runs_it() -> None:
    """FedDyn's clients send only their model, but its server step edits the aggregate before central DP's noise:
    refused in one line. Its step term reads models only (g_k is a function of past local and global models), so
    local DP-SGD runs it."""
    with pytest.raises(ConfigError) as info:
        check_pairs([FedDyn(), CentralDP(noise_multiplier=1.0)])
    message = str(info.value)
    assert "\n" not in message and "FedDyn changes the aggregate on the server" in message, message
    check_pairs([FedDyn(), LocalDP(noise_multiplier=1.0)])


def test_bad_alpha_is_one_line() -> None:
    raises_one_line(FedDyn, alpha=-0.1, match="algo.alpha=-0.1")
