"""Local layers (FedBN, FedPer, FedRep, FedBABU, LG-FedAvg): the maths against hand-run local gradient descent.

The clients' minibatches are their whole row sets (``batch_size`` above every client's size), so a hand-run of the
local steps is full-batch gradient descent, in float64: equal to the federation's up to the order of the rows in a
batch (a permutation), hence ``atol=1e-12``. Reductions and invariances are bitwise (``torch.equal``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from helpers import make_fed, run_rounds, toy_data
from torch import Tensor, nn
from torch.func import functional_call

from flx.errors import ConfigError
from flx.hooks import FederatedCallback
from flx.models.nets import MLP
from flx.parts.meta_learning.adapt import Adapt
from flx.parts.personalisation.fedbabu import FedBABU
from flx.parts.personalisation.fedbn import FedBN
from flx.parts.personalisation.fedper import FedPer
from flx.parts.personalisation.fedrep import FedRep
from flx.parts.personalisation.lg_fedavg import LGFedAvg
from flx.server import ServerOptConfig
from flx.traits import PartTraits

f64 = torch.float64
SIZES = [6, 9, 7, 8]
FULL = dict(batch_size=16, lr=0.3, seed=3)  # every step a client's whole rows
HEAD = ("net.3.weight", "net.3.bias")  # MLP(hidden=[4])'s head: net = Flatten, Linear, ReLU, Linear
HEAD_BN = ("net.4.weight", "net.4.bias")  # with batch_norm: Flatten, Linear, BatchNorm1d, ReLU, Linear


def mlp(batch_norm: bool = False) -> MLP:
    torch.manual_seed(0)
    return MLP(input_shape=(5,), num_classes=3, hidden=[4], batch_norm=batch_norm).to(f64)


def data():
    return toy_data(SIZES, dim=5, classes=3, seed=1, dtype=f64)


def state(net: nn.Module) -> dict[str, Tensor]:
    """Every uploaded tensor by name (parameters, then float buffers)."""
    named = {**dict(net.named_parameters()), **dict(net.named_buffers())}
    return {k: v.detach().clone() for k, v in named.items() if v.is_floating_point()}


def gd(
    net: nn.Module,
    start: dict[str, Tensor],
    rows: Tensor,
    phases: Sequence[tuple[int, Sequence[str]]],
    lr: float,
    beta: float = 0.0,
    wd: float = 0.0,
) -> dict[str, Tensor]:
    """Hand-run local SGD on the client's whole rows from ``start``: each phase ``(steps, names)`` steps only the
    parameters ``names`` (torch.optim.SGD's rule: ``g + wd p``, momentum ``buf = beta buf + g`` started afresh for a
    parameter's first step, ``p -= lr buf``)."""
    d = data()
    p = {k: v.clone() for k, v in start.items()}
    buf: dict[str, Tensor] = {}
    for steps, names in phases:
        for _ in range(steps):
            live = {k: (v.requires_grad_(True) if k in names else v) for k, v in p.items()}
            loss = F.cross_entropy(functional_call(net, live, (d.x[rows],)), d.y[rows])
            grads = torch.autograd.grad(loss, [live[k] for k in names])
            with torch.no_grad():
                for k, g in zip(names, grads):
                    g = g + wd * p[k]
                    buf[k] = g if k not in buf else beta * buf[k] + g
                    p[k] = (p[k] - lr * buf[k]).detach()
            p = {k: v.detach() for k, v in p.items()}
    return p


def weighted_mean(models: dict[int, dict[str, Tensor]], key: str) -> Tensor:
    return sum(SIZES[c] * m[key] for c, m in models.items()) / sum(SIZES[c] for c in models)


def close(a: Tensor, b: Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def flat(fed) -> Tensor:
    return torch.cat([t.detach().reshape(-1) for t in fed.local_state])


# ----------------------------------------------------------------------------- reductions to FedAvg
@pytest.mark.parametrize(
    "parts",
    [lambda: [FedBN()], lambda: [FedPer(local=[])], lambda: [LGFedAvg(local=[])]],
    ids=["fedbn", "fedper", "lg"],
)
def test_no_local_tensor_is_fedavg_bitwise(parts: Callable[[], list]) -> None:
    """FedBN on a net without BatchNorm and FedPer / LG-FedAvg with nothing local are FedAvg bit for bit (minibatches,
    server momentum), and a client's personalised model is the global one."""
    kw = dict(clients_per_round=3, local_steps=4, batch_size=3, lr=0.2, seed=5, server=ServerOptConfig(momentum=0.5))
    fedavg, local = make_fed(mlp(), data(), [], **kw), make_fed(mlp(), data(), parts(), **kw)
    run_rounds(fedavg, 3)
    run_rounds(local, 3)
    assert torch.equal(flat(local), flat(fedavg))
    assert len(local.store) == 0
    with local.personalize(0) as own:
        assert not own


# ----------------------------------------------------------------------------- the server's copy, the clients' own
@pytest.mark.parametrize("server", [ServerOptConfig(), ServerOptConfig(momentum=0.9), ServerOptConfig("adam", 0.1)])
@pytest.mark.parametrize("part", [FedPer, LGFedAvg, lambda: FedRep(rep_steps=2)], ids=["fedper", "lg", "fedrep"])
def test_server_copy_of_local_tensors_stays_at_its_initial_value(part, server: ServerOptConfig) -> None:
    """Under every server optimizer the global model's local entries are their initial values bit for bit after
    rounds in which every client trained them, and the shared entries moved."""
    net = mlp()
    init = state(net)
    fed = make_fed(net, data(), [p := part()], clients_per_round=3, local_steps=4, batch_size=3, server=server)
    run_rounds(fed, 3)
    now = state(net)
    local = {name for k, name in enumerate(init) if k in p.local}
    assert local == ({"net.1.weight", "net.1.bias"} if isinstance(p, LGFedAvg) else set(HEAD))
    for name in init:
        assert torch.equal(now[name], init[name]) == (name in local), name
    for cid in range(4):  # each client's own local tensors moved
        stored = fed.store.get(cid)
        assert all(not torch.equal(stored[f"local/{k}"], fed.local_state[k]) for k in p.local)


@pytest.mark.parametrize("part", [FedPer, LGFedAvg], ids=["fedper", "lg"])
def test_local_tensors_after_two_visits_equal_hand_run_local_steps(part) -> None:
    """Every client in both rounds, K = 3 full-batch steps. Round 0: each client from ``w^0``; the server averages
    the shared entries (weights ``n_i``) and keeps ``w_L^0``. Round 1: client ``i`` starts from ``(w_S^1, w_{L,i})``.
    Its stored local tensors, its personalised model and the global model equal the hand-run."""
    net = mlp()
    fed = make_fed(net, data(), [p := part()], clients_per_round=4, local_steps=3, **FULL)
    names = list(state(net))
    local = [names[k] for k in p.local]
    trainable = [n for n, _ in net.named_parameters()]
    w0 = state(net)
    rows = data().client_indices
    start = {c: dict(w0) for c in range(4)}
    for _ in range(2):
        trained = {c: gd(net, start[c], rows[c], [(3, trainable)], FULL["lr"]) for c in range(4)}
        shared = {n: (w0[n] if n in local else weighted_mean(trained, n)) for n in names}
        start = {c: {n: (trained[c][n] if n in local else shared[n]) for n in names} for c in range(4)}
    run_rounds(fed, 2)
    for n, t in zip(names, fed.local_state):
        close(t, shared[n])
    for c in range(4):
        for k in p.local:
            close(fed.store.get(c)[f"local/{k}"], trained[c][names[k]])
        with fed.personalize(c):
            for n, t in zip(names, fed.local_state):
                close(t, start[c][n])


def test_lg_fedavg_averages_the_head_and_keeps_the_body() -> None:
    """LG-FedAvg after one round of every client: the head is the ``n_i``-weighted mean of the clients' heads, the
    global body is ``w^0`` bit for bit and each client keeps its own body."""
    net = mlp()
    w0 = state(net)
    fed = make_fed(net, data(), [LGFedAvg()], clients_per_round=4, local_steps=2, **FULL)
    run_rounds(fed, 1)
    rows, trainable = data().client_indices, [n for n, _ in net.named_parameters()]
    trained = {c: gd(net, w0, rows[c], [(2, trainable)], FULL["lr"]) for c in range(4)}
    now = state(net)
    for n in HEAD:
        close(now[n], weighted_mean(trained, n))
    for n in ("net.1.weight", "net.1.bias"):
        assert torch.equal(now[n], w0[n])
        for c in range(4):
            with fed.personalize(c):
                close(state(net)[n], trained[c][n])


# ----------------------------------------------------------------------------- FedBN
def test_fedbn_keeps_batch_norm_parameters_and_running_statistics_local() -> None:
    """One full-batch step a round: client ``i``'s running mean after its first visit is ``0.9 * 0 + 0.1 *`` the batch
    mean of its first layer's outputs at ``w^0`` (BatchNorm's momentum 0.1); the server's BatchNorm (scale, shift,
    running statistics) stays at its initial values bit for bit, its other layers move; the personalised model has the
    client's own statistics."""
    net = mlp(batch_norm=True)
    bn = net.net[2]
    w0 = state(net)
    fed = make_fed(net, data(), [FedBN()], clients_per_round=4, local_steps=1, **FULL)
    run_rounds(fed, 2)
    names = list(w0)
    bn_names = {n for n in names if n.startswith("net.2.")}
    assert bn_names == {f"net.2.{s}" for s in ("weight", "bias", "running_mean", "running_var")}
    assert {names[k] for k in fed.parts[0].local} == bn_names
    now = state(net)
    for n in names:  # the first layer's bias has no gradient in front of BatchNorm (the batch mean takes it out)
        if n != "net.1.bias":
            assert torch.equal(now[n], w0[n]) == (n in bn_names), n
    d = data()
    with torch.no_grad():
        first = {c: 0.1 * mlp(True).net[1](d.x[d.client_indices[c]]).mean(0) for c in range(4)}  # at w^0
    run = make_fed(mlp(batch_norm=True), d, [FedBN()], clients_per_round=4, local_steps=1, **FULL)
    run_rounds(run, 1)
    k_mean = names.index("net.2.running_mean")
    for c in range(4):
        close(run.store.get(c)[f"local/{k_mean}"], first[c])
        with fed.personalize(c):
            assert torch.equal(bn.running_mean, fed.store.get(c)[f"local/{k_mean}"])
            assert not torch.equal(bn.running_mean, w0["net.2.running_mean"])


# ----------------------------------------------------------------------------- FedRep
class _Steps(FederatedCallback):
    """Test part: the net's parameters after every local step."""

    traits = PartTraits(uploads={})

    def __init__(self) -> None:
        self.seen: list[dict[str, Tensor]] = []

    def on_local_step_end(self, fed, client) -> None:
        self.seen.append(state(fed.net))


@pytest.mark.parametrize("beta, wd", [(0.0, 0.0), (0.9, 0.1)])
def test_fedrep_moves_the_head_first_then_the_body(beta: float, wd: float) -> None:
    """K = 5 full-batch steps, tau_h = 2: steps 0-1 move the head only, steps 2-4 the body only (momentum and weight
    decay included: the frozen group has no gradient). The client's head and the uploaded body equal a hand-run of
    the two phases (a fresh momentum buffer for each group); the server's head stays ``w^0``."""
    net = mlp()
    w0 = state(net)
    probe = _Steps()
    kw = dict(clients_per_round=1, local_steps=5, momentum=beta, weight_decay=wd, **FULL)
    fed = make_fed(net, data(), [FedRep(rep_steps=3), probe], **kw)
    run_rounds(fed, 1)
    cid = fed.rnd.cohort[0]
    body = ["net.1.weight", "net.1.bias"]
    before = w0
    for k, after in enumerate(probe.seen):
        moved = {n for n in body + list(HEAD) if not torch.equal(after[n], before[n])}
        assert moved == (set(HEAD) if k < 2 else set(body)), k
        before = after
    hand = gd(net, w0, data().client_indices[cid], [(2, HEAD), (3, body)], FULL["lr"], beta, wd)
    now = state(net)
    for n in body:
        close(now[n], hand[n])  # one client: the mean is its model
    for n in HEAD:
        assert torch.equal(now[n], w0[n])
    k_head = list(w0).index(HEAD[0])
    close(fed.store.get(cid)[f"local/{k_head}"], hand[HEAD[0]])


def test_fedrep_rep_epochs_count_passes_over_the_client() -> None:
    """With ``local_epochs`` the representation phase is ``rep_epochs * ceil(n_i / B)`` steps: a client of 9 rows
    with B = 4 trains its head for 3 x 3 - 3 = 6 steps, then the body for 1 x 3 = 3."""
    probe = _Steps()
    fed = make_fed(mlp(), data(), [FedRep(rep_epochs=1), probe], clients_per_round=4, local_epochs=3, batch_size=4)
    run_rounds(fed, 1)
    order = fed.rnd.shard
    at = sum(fed.client_steps(c) for c in order[: order.index(1)])  # client 1's first step in the probe's list
    seen = probe.seen[at - 1 : at + 9] if at else [None, *probe.seen[:9]]
    for k in range(1, 10):
        head_moved = not torch.equal(seen[k][HEAD[0]], seen[k - 1][HEAD[0]]) if seen[k - 1] else True
        assert head_moved == (k - 1 < 6), k


# ----------------------------------------------------------------------------- FedBABU
def test_fedbabu_head_never_moves_and_personal_model_is_a_hand_fine_tune() -> None:
    """The head equals ``w^0`` bit for bit at every local step (momentum and weight decay on) and on the server; the
    body is the clients' mean. The personalised model is 2 full-batch steps of size 0.1 on all parameters from the
    global model, on the client's rows."""
    net = mlp()
    w0 = state(net)
    probe = _Steps()
    kw = dict(clients_per_round=2, local_steps=3, momentum=0.9, weight_decay=0.1, **FULL)
    fed = make_fed(net, data(), [FedBABU(), Adapt(steps=2, lr=0.1), probe], **kw)
    run_rounds(fed, 2)
    assert probe.seen and all(torch.equal(s[n], w0[n]) for s in probe.seen for n in HEAD)
    g = state(net)
    assert all(torch.equal(g[n], w0[n]) for n in HEAD) and not torch.equal(g["net.1.weight"], w0["net.1.weight"])
    trainable = [n for n, _ in net.named_parameters()]
    for cid in (0, 3):
        hand = gd(net, g, data().client_indices[cid], [(2, trainable)], 0.1)
        with fed.personalize(cid):
            for n, t in state(net).items():
                close(t, hand[n])


# ----------------------------------------------------------------------------- resume, evaluation, refusals
@pytest.mark.parametrize(
    "parts, bn",
    [(lambda: [FedPer()], False), (lambda: [FedRep(rep_steps=2)], False), (lambda: [FedBN()], True)],
    ids=["fedper", "fedrep", "fedbn"],
)
def test_resumed_equals_uninterrupted(parts, bn: bool) -> None:
    """The clients' local tensors ride in the checkpointed store: 1 round, save, load into a fresh federation, 1 more
    round == 2 rounds, global and personalised models, bit for bit."""
    kw = dict(clients_per_round=3, local_steps=4, batch_size=3, lr=0.2, seed=4, momentum=0.5)
    whole = make_fed(mlp(bn), data(), parts(), **kw)
    run_rounds(whole, 2)
    first = make_fed(mlp(bn), data(), parts(), **kw)
    run_rounds(first, 1)
    second = make_fed(mlp(bn), data(), parts(), **kw)
    second.load_state_dict(first.state_dict())
    with torch.no_grad():
        for a, b in zip(second.local_state, first.local_state):
            a.copy_(b)
    run_rounds(second, 1, start=1)
    assert torch.equal(flat(second), flat(whole))
    for cid in range(4):
        with whole.personalize(cid):
            expected = flat(whole)
        with second.personalize(cid):
            assert torch.equal(flat(second), expected)


def test_a_client_never_sampled_is_evaluated_with_the_global_model() -> None:
    fed = make_fed(mlp(), data(), [FedPer()], clients_per_round=1, local_steps=2, **FULL)
    run_rounds(fed, 1)
    (sampled,) = fed.rnd.cohort
    other = next(c for c in range(4) if c != sampled)
    g = flat(fed)
    with fed.personalize(other) as own:
        assert not own and torch.equal(flat(fed), g)
    with fed.personalize(sampled) as own:
        assert own and not torch.equal(flat(fed), g)


@pytest.mark.parametrize("part", [FedPer, FedBN, LGFedAvg, FedBABU, lambda: FedRep(rep_steps=1)])
def test_vectorized_runner_refuses_in_one_line(part) -> None:
    with pytest.raises(ConfigError, match=r"^algo.vectorize=true: part \w+ has no vectorised form") as e:
        make_fed(mlp(), data(), [part()], vectorize=True)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: make_fed(mlp(), data(), [FedPer(local=["tail"])]), r"^algo.local=\['tail'\]: 'tail' names no"),
        (lambda: make_fed(mlp(), data(), [FedPer(local="head")]), r"^algo.local='head': a list of patterns"),
        (lambda: make_fed(mlp(), data(), [FedBABU(frozen=["!"])]), r"^algo.frozen=\['!'\]: a list of patterns"),
        (lambda: make_fed(mlp(), data(), [FedRep()], local_steps=3), r"^algo.rep_steps=None: FedRep's repr"),
        (lambda: make_fed(mlp(), data(), [FedRep(rep_steps=0)], local_steps=3), r"^algo.rep_steps=0: must be"),
        (lambda: make_fed(mlp(), data(), [FedRep(rep_epochs=3)], local_epochs=2), r"^algo.rep_epochs=3: must be"),
        (
            lambda: make_fed(mlp(), data(), [FedPer()], server=ServerOptConfig(weight_decay=0.1)),
            r"^algo.server.weight_decay=0.1: must be 0 with FedPer",
        ),
    ],
)
def test_bad_settings_stop_in_one_line(build, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        build()
    assert "\n" not in str(e.value)


def test_patterns_name_tensors_modules_and_batch_norm() -> None:
    """``head`` and ``head.*`` reach the MLP's head through its property, ``net.1.*`` names by state-dict name,
    ``batch_norm`` takes the BatchNorm layer's parameters and float buffers, ``!`` takes out."""
    from flx.parts.personalisation.local_layers import select

    net = mlp(batch_norm=True)
    up = [p for p in net.parameters()] + [b for b in net.buffers() if b.is_floating_point()]
    names = [n for n, _ in net.named_parameters()] + [n for n, b in net.named_buffers() if b.is_floating_point()]

    def picked(*patterns: str) -> set[str]:
        return {names[k] for k in select(net, up, patterns, "algo.local")}

    assert picked("head") == picked("head.*") == set(HEAD_BN)
    assert picked("head.bias") == {HEAD_BN[1]}
    assert picked("net.1.*") == {"net.1.weight", "net.1.bias"}
    assert picked("batch_norm") == {f"net.2.{s}" for s in ("weight", "bias", "running_mean", "running_var")}
    assert picked("*", "!head", "!batch_norm") == {"net.1.weight", "net.1.bias"}
