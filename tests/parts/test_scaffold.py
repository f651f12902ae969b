r"""SCAFFOLD (:class:`flx.parts.drift.scaffold.Scaffold`) on heterogeneous least-squares clients
(``drift_closed_forms``): the exact minimiser where FedAvg stops at its biased fixed point, two rounds written out
(both options, partial participation, a server step size), resume, two ranks, the stacked clients, the privacy
refusal of the control-variate channel.

Algorithm 1 (Karimireddy et al., ICML 2020): :math:`y \leftarrow y - \eta_l(\nabla f_i(y) - c_i + c)` for :math:`K`
steps; :math:`c_i^+ = \nabla f_i(x)` (I) or :math:`c_i - c + (x - y_i)/(K\eta_l)` (II);
:math:`x \leftarrow x + \eta_g(\bar y - x)`; :math:`c \leftarrow c + \sum_{i \in S} q_i (c_i^+ - c_i)` with
:math:`q_i = p_i / \sum_{j=1}^N p_j`.
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
from flx.parts.drift.scaffold import Scaffold
from flx.parts.privacy.central_dp import CentralDP
from flx.parts.privacy.local_dp import LocalDP
from flx.server import ServerOptConfig

_CI = "scaffold/c"


@pytest.mark.parametrize("weighting", ["num_samples", "uniform"])
@pytest.mark.parametrize("control", ["option1", "option2"])
def test_full_participation_reaches_the_minimiser_where_fedavg_is_biased(control: str, weighting: str) -> None:
    """Full participation, K = 5 full-batch local steps: FedAvg converges to the fixed point of its affine round map
    (closed form), away from the minimiser of sum_i q_i f_i; SCAFFOLD converges to that minimiser (q_i from
    algo.weighting: the weights c averages the c_i with)."""
    data = problem()
    q = weights(data, weighting)
    kw = dict(clients_per_round=4, weighting=weighting)
    scaffold = fed(data, [Scaffold(control=control)], **kw)
    for t in range(80):
        scaffold.train_clients(scaffold.begin_round(t).shard)
        scaffold.end_round()
    w_star, w_avg = optimum(data, q), fedavg_fixed_point(data, q, steps=5, lr=0.05)
    torch.testing.assert_close(fedavg_limit(weighting), w_avg, rtol=0, atol=1e-12)
    assert float((w_avg - w_star).norm()) > 1e-2  # FedAvg's bias: far above the tolerances
    torch.testing.assert_close(flat(scaffold.params), w_star, rtol=0, atol=1e-12)
    # at the optimum, c_i = grad f_i(w*) and c = sum_i q_i c_i = 0
    for cid in range(4):
        h, b = quadratic(data, cid)
        torch.testing.assert_close(scaffold.store.get(cid)[_CI], h @ w_star - b, rtol=0, atol=1e-9)
    torch.testing.assert_close(scaffold.parts[0].c, torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("control", ["option1", "option2"])
def test_three_rounds_match_the_written_out_algorithm(control: str) -> None:
    """Two of four clients a round (uniform weights: c moves by |S|/N times the cohort's mean Delta c_i, the paper's
    line 17), server step size eta_g = 0.5; the model, c and every stored c_i after each round."""
    data, eta, eta_g, k = problem(), 0.05, 0.5, 5
    part = Scaffold(control=control)
    f = fed(data, [part], clients_per_round=2, weighting="uniform", server=ServerOptConfig(lr=eta_g), seed=3)
    x, c, ci = (
        flat(f.params),
        torch.zeros(4, dtype=torch.float64),
        {i: torch.zeros(4, dtype=torch.float64) for i in range(4)},
    )
    for t in range(3):
        f.train_clients(f.begin_round(t).shard)
        f.end_round()
        cohort = f.rnd.cohort
        ys, dcs = [], []
        for i in cohort:
            y = local_steps(data, i, x, k, eta, c - ci[i])
            if control == "option1":
                h, b = quadratic(data, i)
                new = h @ x - b
            else:
                new = ci[i] - c + (x - y) / (k * eta)
            ys.append(y)
            dcs.append(new - ci[i])
            ci[i] = new
        x = x + eta_g * (sum(ys) / len(ys) - x)
        c = c + len(cohort) / 4 * sum(dcs) / len(dcs)
        torch.testing.assert_close(flat(f.params), x, rtol=0, atol=1e-12)
        torch.testing.assert_close(part.c, c, rtol=0, atol=1e-12)
        for i in range(4):
            stored = f.store.get(i)[_CI] if i in f.store else torch.zeros(4, dtype=torch.float64)
            torch.testing.assert_close(stored, ci[i], rtol=0, atol=1e-12)
    assert len(set(f.store.client_ids())) >= 3  # the cohorts differed: the test saw stored and fresh c_i


def test_sample_weighted_c_is_the_weighted_mean_of_the_clients() -> None:
    """algo.weighting=num_samples: c = sum_j n_j c_j / n over ALL clients (the sampled ones' c_i updated, the others'
    still 0), after rounds of partial participation."""
    data = problem()
    f = fed(data, [Scaffold()], clients_per_round=2, seed=1)
    for t in range(4):
        f.train_clients(f.begin_round(t).shard)
        f.end_round()
    n = [len(i) for i in data.client_indices]
    expected = sum(n[i] * f.store.get(i)[_CI] for i in f.store.client_ids()) / sum(n)
    torch.testing.assert_close(f.parts[0].c, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("control", ["option1", "option2"])
def test_resumed_equals_uninterrupted(control: str) -> None:
    """2 rounds == 1 round, the federation's and the part's state loaded into fresh ones, 1 more round: bit for bit
    (model, c, the stored c_i)."""
    data, kw = problem(), dict(clients_per_round=3, seed=4, batch_size=4)
    whole = fed(data, [Scaffold(control=control)], **kw)
    for t in range(2):
        whole.train_clients(whole.begin_round(t).shard)
        whole.end_round()
    first = fed(data, [Scaffold(control=control)], **kw)
    first.train_clients(first.begin_round(0).shard)
    first.end_round()
    second = fed(data, [Scaffold(control=control)], **kw)
    second.load_state_dict(first.state_dict())
    second.parts[0].load_state_dict(first.parts[0].state_dict())
    with torch.no_grad():
        for a, b in zip(second.params, first.params):
            a.copy_(b)
    second.train_clients(second.begin_round(1).shard)
    second.end_round()
    assert torch.equal(flat(second.params), flat(whole.params))
    assert torch.equal(second.parts[0].c, whole.parts[0].c)
    assert second.store.client_ids() == whole.store.client_ids()
    for cid in whole.store.client_ids():
        assert torch.equal(second.store.get(cid)[_CI], whole.store.get(cid)[_CI])


@pytest.mark.parametrize("control", ["option1", "option2"])
def test_two_ranks_equal_one(control: str) -> None:
    """Two ranks: the Delta c_i sums ride in the round's all-reduce, the c_i in the core's state gather; the model,
    c and every rank's store equal the one-process run."""
    data, kw = problem(), dict(clients_per_round=3, seed=2, batch_size=4)
    single = fed(data, [Scaffold(control=control)], **kw)
    for t in range(3):
        single.train_clients(single.begin_round(t).shard)
        single.end_round()
    for rank in two_ranks(lambda **r: fed(data, [Scaffold(control=control)], **kw, **r), 3):
        torch.testing.assert_close(flat(rank.params), flat(single.params), rtol=0, atol=1e-12)
        torch.testing.assert_close(rank.parts[0].c, single.parts[0].c, rtol=0, atol=1e-12)
        assert rank.store.client_ids() == single.store.client_ids()
        for cid in single.store.client_ids():
            torch.testing.assert_close(rank.store.get(cid)[_CI], single.store.get(cid)[_CI], rtol=0, atol=1e-12)


@pytest.mark.parametrize("control", ["option1", "option2"])
def test_stacked_clients_equal_the_sequential_ones(control: str) -> None:
    """algo.vectorize=true: the same corrected steps on the stacked gradients; model, c and c_i equal the sequential
    run up to summation order (1e-10 in float64, as tests/test_vectorized.py)."""
    data, kw = problem(), dict(clients_per_round=3, seed=5, batch_size=4)
    runs = []
    for vectorize in (False, True):
        f = fed(data, [Scaffold(control=control)], vectorize=vectorize, **kw)
        for t in range(3):
            f.train_clients(f.begin_round(t).shard)
            f.end_round()
        runs.append(f)
    seq, vec = runs
    torch.testing.assert_close(flat(vec.params), flat(seq.params), rtol=0, atol=1e-10)
    torch.testing.assert_close(vec.parts[0].c, seq.parts[0].c, rtol=0, atol=1e-10)
    for cid in seq.store.client_ids():
        torch.testing.assert_close(vec.store.get(cid)[_CI], seq.store.get(cid)[_CI], rtol=0, atol=1e-10)


def test_privacy_refuses_the_control_variate_channel() -> None:
    """Delta c_i is a declared channel that no privacy guarantee covers: central and local DP refuse SCAFFOLD in one
    line naming it."""
    for guard in (CentralDP(noise_multiplier=1.0), LocalDP(noise_multiplier=1.0)):
        with pytest.raises(ConfigError) as info:
            check_pairs([Scaffold(), guard])
        message = str(info.value)
        assert "\n" not in message and "Scaffold sends its control-variate update Delta c_i" in message, message


def test_bad_control_is_one_line() -> None:
    raises_one_line(Scaffold, control="option3", match="algo.control='option3'")
