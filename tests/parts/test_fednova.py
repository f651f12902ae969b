r"""FedNova (Wang et al., NeurIPS 2020): the objective-inconsistency closed form on quadratic clients, the reduction to
FedAvg under equal work, one round by hand with local momentum and with a proximal term, resume, 2 ranks, the
vectorised runner.

Quadratic clients: client ``i`` holds the 4 rows ``2 I`` with targets ``2 e_i``, a bias-free ``Linear(4, 1)`` and
the loss ``1/2 mse``, so ``F_i(x) = 1/2 ||x - e_i||^2`` and a full-batch local step is ``x <- x - eta (x - e_i)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, raises_one_line, run_rounds, toy_data

from flx.datamodules.datamodule import ClientStore
from flx.hooks import FederatedCallback
from flx.parts.drift.fednova import FedNova, a_norm
from flx.parts.proximal.prox import Prox
from flx.parts.systems.random_work import RandomWork
from flx.traits import PartTraits

f64 = torch.float64
D = 4
TARGETS = torch.tensor([[1.0, -2.0, 0.5, 3.0], [-1.0, 0.0, 2.0, 1.0], [0.5, 1.5, -1.0, -2.0]], dtype=f64)


class Steps(FederatedCallback):
    """Gives client ``i`` ``steps[i]`` local steps every round (``rnd.set_steps``)."""

    traits = PartTraits(uploads={}, steps="data_free", vectorizable=True)

    def __init__(self, steps: dict[int, int]) -> None:
        self.steps = steps

    def on_round_start(self, fed, rnd) -> None:
        for cid in rnd.cohort:
            rnd.set_steps(cid, self.steps[cid])


def _half_mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * F.mse_loss(out, y)


def _quadratic(targets: torch.Tensor = TARGETS) -> ClientStore:
    x = (2 * torch.eye(D, dtype=f64)).repeat(len(targets), 1)
    y = (2 * targets).reshape(-1, 1)
    return ClientStore(x, y, [torch.arange(D * i, D * (i + 1)) for i in range(len(targets))])


def _quad_fed(parts, steps: dict[int, int], eta: float, **kw: object):
    net = linear(D, 1, dtype=f64, bias=False)
    with torch.no_grad():
        net.weight.zero_()
    cfg = dict(clients_per_round=len(steps), local_steps=1, batch_size=D, lr=eta, seed=1) | kw
    return make_fed(net, _quadratic(), [Steps(steps), *parts], loss_fn=_half_mse, **cfg)


def _x(fed) -> torch.Tensor:
    return fed.params[0].detach().reshape(-1).clone()


def test_objective_inconsistency_closed_forms() -> None:
    """Section 3: with local GD, client i ends at e_i + (1 - eta)^{tau_i} (x - e_i). FedAvg's (p_i = 1/3) fixed point
    weights the targets by p_i (1 - (1 - eta)^{tau_i}), the work done (-> p_i tau_i as eta -> 0: the paper's
    tau-weighted surrogate optimum); FedNova's update x - tau_eff sum p_i (x - x_i) / tau_i vanishes where the weights
    are p_i (1 - (1 - eta)^{tau_i}) / tau_i (-> p_i eta: the true optimum sum p_i e_i of sum p_i F_i). Both fixed
    points asserted to 1e-10 after 300 rounds; FedNova's distance to the true optimum is O(eta), FedAvg's O(1)."""
    eta, steps = 0.05, {0: 1, 1: 3, 2: 8}
    tau = torch.tensor([float(steps[i]) for i in range(3)], dtype=f64)
    done = 1 - (1 - eta) ** tau
    avg, nova = _quad_fed([], steps, eta), _quad_fed([FedNova()], steps, eta)
    for fed in (avg, nova):
        run_rounds(fed, 300)
    x_avg = (done[:, None] * TARGETS).sum(0) / done.sum()
    x_nova = ((done / tau)[:, None] * TARGETS).sum(0) / (done / tau).sum()
    torch.testing.assert_close(_x(avg), x_avg, rtol=0, atol=1e-10)
    torch.testing.assert_close(_x(nova), x_nova, rtol=0, atol=1e-10)
    true, surrogate = TARGETS.mean(0), (tau[:, None] * TARGETS).sum(0) / tau.sum()
    assert (x_nova - true).norm() < eta * (tau.max() - tau.min()) * TARGETS.norm()  # first order in eta
    assert (x_nova - true).norm() < 0.15 * (x_avg - true).norm()
    assert (x_avg - surrogate).norm() < 0.5 * (x_avg - true).norm()  # FedAvg sits near the tau-weighted optimum


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("vectorize", [False, True])
def test_equal_work_is_fedavg_bitwise(momentum: float, vectorize: bool) -> None:
    """Every client takes the same steps: ||a_i||_1 = tau_eff, the factor is exactly 1 (tau_eff = a_min + sum p_i
    (a_i - a_min) = a_min) and the uploads are FedAvg's, untouched: torch.equal through 3 rounds."""
    data = toy_data([13, 8, 21, 5, 17], dtype=f64)
    kw = dict(clients_per_round=3, local_steps=4, batch_size=4, lr=0.1, momentum=momentum, seed=2, vectorize=vectorize)
    avg = make_fed(linear(dtype=f64), data, **kw)
    nova = make_fed(linear(dtype=f64), data, [FedNova()], **kw)
    for fed in (avg, nova):
        run_rounds(fed, 3)
    assert all(torch.equal(a, b) for a, b in zip(avg.params, nova.params))


def _by_hand(eta: float, steps: dict[int, int], rho: float, mu: float, norms: list[float]) -> torch.Tensor:
    """One round from x^t = 0: each client's local SGD (torch's momentum b = rho b + g, prox gradient mu (x - x^t)),
    then x^t - tau_eff sum p_i (x^t - x_i) / ||a_i||_1 with p_i = 1/3 and the given ||a_i||_1."""
    xt = torch.zeros(D, dtype=f64)
    uploads = []
    for i, tau in steps.items():
        x, b = xt.clone(), torch.zeros(D, dtype=f64)
        for _ in range(tau):
            b = rho * b + (x - TARGETS[i]) + mu * (x - xt)
            x = x - eta * b
        uploads.append(x)
    tau_eff = sum(norms) / 3
    return xt - tau_eff * sum((xt - x) / a for x, a in zip(uploads, norms)) / 3


def test_one_round_with_local_momentum_by_hand() -> None:
    """a_{i,k} = (1 - rho^{tau_i - k}) / (1 - rho): ||a_i||_1 = (tau_i - rho (1 - rho^{tau_i}) / (1 - rho)) / (1 -
    rho), the paper's momentum form."""
    eta, rho, steps = 0.1, 0.9, {0: 2, 1: 5, 2: 3}
    norms = [(t - rho * (1 - rho**t) / (1 - rho)) / (1 - rho) for t in steps.values()]
    fed = _quad_fed([FedNova()], steps, eta, momentum=rho)
    run_rounds(fed, 1)
    torch.testing.assert_close(_x(fed), _by_hand(eta, steps, rho, 0.0, norms), rtol=0, atol=1e-13)


def test_one_round_with_the_prox_term_by_hand() -> None:
    """FedProx's term: a_{i,k} = (1 - eta mu)^{tau_i - 1 - k}, ||a_i||_1 = (1 - (1 - eta mu)^{tau_i}) / (eta mu)."""
    eta, mu, steps = 0.1, 0.5, {0: 2, 1: 5, 2: 3}
    norms = [(1 - (1 - eta * mu) ** t) / (eta * mu) for t in steps.values()]
    fed = _quad_fed([Prox(mu), FedNova(mu=mu)], steps, eta)
    run_rounds(fed, 1)
    torch.testing.assert_close(_x(fed), _by_hand(eta, steps, 0.0, mu, norms), rtol=0, atol=1e-13)


def test_a_norm_is_the_local_solver_response_to_unit_gradients() -> None:
    """||a_i||_1 = (x^t - x^{t,tau}) / eta when every step's loss gradient is 1: the closed forms (momentum alone, prox
    alone, plain SGD exactly tau) and the recursion (both at once) against the solver run by hand."""

    def solver(tau: int, eta: float, rho: float, mu: float) -> float:
        x, b = 0.0, 0.0
        for _ in range(tau):
            b = rho * b + 1.0 + mu * x
            x -= eta * b
        return -x / eta

    for rho, mu in [(0.0, 0.0), (0.9, 0.0), (0.0, 0.7), (0.5, 0.7)]:
        for tau in (1, 2, 7):
            assert a_norm(tau, 0.1, rho, mu) == pytest.approx(solver(tau, 0.1, rho, mu), rel=1e-12)
    assert a_norm(7, 0.1) == 7.0


def _random_fed(**kw: object):
    data = toy_data([13, 8, 21, 5, 17, 9], dtype=f64)
    cfg = dict(clients_per_round=4, local_steps=2, batch_size=4, lr=0.1, momentum=0.5, seed=5) | kw
    return make_fed(linear(dtype=f64), data, [RandomWork([1, 3]), FedNova(mu=0.0)], **cfg)


def test_random_work_draws_per_round_and_client() -> None:
    """RandomWork([1, 3]) before FedNova: client i takes r_i * local_steps steps, r_i in {1, 2, 3}, redrawn every
    round (each value drawn), the same in a second federation of the same seed."""
    fed, again = _random_fed(), _random_fed()
    seen = set()
    for r in range(4):
        a, b = fed.begin_round(r), again.begin_round(r)
        for cid in a.cohort:
            assert fed.client_steps(cid) == again.client_steps(cid) and fed.client_steps(cid) in (2, 4, 6)
            seen.add(fed.client_steps(cid))
        for f, rnd in ((fed, a), (again, b)):
            f.train_clients(rnd.shard)
            f.end_round()
    assert seen == {2, 4, 6}


def test_resumed_equals_uninterrupted() -> None:
    """1 round, the state_dict into a fresh federation (with the global model), 1 more round == 2 rounds, bit for bit
    (the round's work and tau_eff are functions of (seed, round, client))."""
    whole = _random_fed()
    run_rounds(whole, 2)
    first, second = _random_fed(), _random_fed()
    run_rounds(first, 1)
    second.load_state_dict(first.state_dict())
    with torch.no_grad():
        for a, b in zip(second.params, first.params):
            a.copy_(b)
    run_rounds(second, 1, start=1)
    assert all(torch.equal(a, b) for a, b in zip(second.params, whole.params))


def test_two_ranks_equal_one() -> None:
    """2 ranks == 1 (float64, allclose 1e-12: the reduce sums the ranks' partial sums, another order)."""
    single = _random_fed()
    run_rounds(single, 3)
    sent: dict[int, torch.Tensor] = {}
    ranks = [_random_fed(rank=r, world_size=2, reduce_sum=lambda t: sum(sent.values())) for r in (0, 1)]
    for r in range(3):
        shards = [fed.begin_round(r).shard for fed in ranks]
        for k, fed in enumerate(ranks):
            for cid in shards[k]:
                fed.train_client(cid)
            sent[k] = fed.aggregator._flat.clone()
        for fed in ranks:
            fed.end_round()
    for fed in ranks:
        for a, b in zip(fed.params, single.params):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_vectorized_equals_sequential() -> None:
    """algo.vectorize=true == sequential (float64, allclose 1e-10 as tests/test_vectorized.py), unequal work: the
    stacked runner groups clients by step count, FedNova rescales each at its end."""
    seq, vec = _random_fed(), _random_fed(vectorize=True)
    for fed in (seq, vec):
        run_rounds(fed, 3)
    for a, b in zip(vec.params, seq.params):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(mu=-1.0), "algo.mu=-1.0: must be >= 0"),
    ],
)
def test_bad_values_are_one_line(kw: dict, match: str) -> None:
    raises_one_line(FedNova, match=match, **kw)


def test_random_work_after_fednova_is_refused() -> None:
    """FedNova computes tau_eff in planning from fed.client_steps: a RandomWork listed after it would change the steps
    afterwards, so the build refuses that order in one line (the other order builds)."""
    data = toy_data([13, 8, 21], dtype=f64)
    make_fed(linear(dtype=f64), data, [RandomWork([1, 3]), FedNova()], clients_per_round=3)
    raises_one_line(
        make_fed,
        linear(dtype=f64),
        data,
        [FedNova(), RandomWork([1, 3])],
        clients_per_round=3,
        match="list the RandomWork part",
    )
