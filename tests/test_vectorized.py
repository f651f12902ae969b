"""``algo.vectorize=true`` (flx.vectorized): the stacked cohort trains to the sequential path's models.

Every comparison runs the same rounds twice on float64 data and nets, one after the other per client and stacked with
``torch.func.vmap``, and asks for the same global model, training loss and left-out clients (allclose 1e-10: the two
paths differ only in floating-point summation order). The clients' sizes make several groups of minibatch shapes:
clients below ``B`` rows, clients with a short last batch, clients with full batches only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_fed, raises_one_line, run_rounds, toy_data
from torch import nn

from flx import vectorized
from flx.hooks import FederatedCallback
from flx.parts.proximal.prox import Prox
from flx.parts.robustness.lambda_sampling import LambdaSampling
from flx.tasks import Classification
from flx.traits import PartTraits

SIZES = [7, 12, 30, 4, 19, 25, 1, 40, 9, 16]  # B = 5: below B, short last batches, full batches only


def _mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    """Row-wise: the vectorised path folds the cohort into the batch (``flx.vectorized.foldable``)."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(dropout), nn.Linear(8, 3))
    return net.to(torch.float64)


class _Gated(nn.Module):
    """Not declared row-wise (a custom forward): the vectorised path vmaps the forward over the clients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(5, 6), nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)) * torch.sigmoid(self.b(x)))


NETS = {"folded": _mlp, "vmapped": lambda: _Gated().to(torch.float64)}


def _pair(parts=lambda: (), rounds: int = 3, data=None, net: str = "folded", **cfg: object) -> tuple:
    """The sequential and the vectorised federation after ``rounds`` rounds of the same settings."""
    data = data if data is not None else toy_data(SIZES, dtype=torch.float64)
    kw = dict(clients_per_round=8, local_steps=4, batch_size=5, lr=0.3, seed=3) | cfg
    feds = [make_fed(NETS[net](), data, list(parts()), vectorize=v, **kw) for v in (False, True)]
    for fed in feds:
        run_rounds(fed, rounds)
    return feds


def _assert_same(seq, vec) -> None:
    for a, b in zip(seq.net.parameters(), vec.net.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)
    assert vec.train_loss == pytest.approx(seq.train_loss, abs=1e-10)
    assert (vec.faults.dropped, vec.faults.skipped) == (seq.faults.dropped, seq.faults.skipped)


@pytest.mark.parametrize("net", list(NETS))
@pytest.mark.parametrize(
    "cfg",
    [
        {},  # FedAvg, n_i-weighted
        {"momentum": 0.9, "weight_decay": 1e-2},  # torch.optim.SGD's momentum and decay, reset per client
        {"local_epochs": 2, "weighting": "uniform"},  # K_i grows with n_i: more groups
        {"single_row_batch": "drop"},  # the one-row client is skipped, one-row last batches are left out
        {"minibatch": "fresh"},  # B fresh rows a step (clients below B: all rows, reshuffled), same draws per client
        {"minibatch": "fresh", "local_epochs": 2, "single_row_batch": "drop"},  # K_i from n_i; the one-row client out
    ],
    ids=["fedavg", "momentum_decay", "epochs", "drop_single_rows", "fresh", "fresh_epochs_drop"],
)
def test_fedavg_equals_the_sequential_path(cfg: dict, net: str) -> None:
    assert vectorized.foldable(NETS[net]()) == (net == "folded")
    _assert_same(*_pair(net=net, **cfg))


@pytest.mark.parametrize("net", list(NETS))
@pytest.mark.parametrize("cfg", [{}, {"local_epochs": 2}], ids=["steps", "epochs"])
def test_the_tasks_per_row_loss_scores_the_stack_alike(cfg: dict, net: str) -> None:
    """A task with ``loss_rows`` (classification) scores the whole padded stack in one call, each client's mean over
    its own rows: the same models and training loss as the sequential path, which calls ``loss`` per batch."""
    _assert_same(*_pair(net=net, loss_fn=Classification().loss, **cfg))


@pytest.mark.parametrize("net", list(NETS))
def test_fedprox_equals_the_sequential_path(net: str) -> None:
    """FedProx's ``mu (w - w^t)`` on the stacked gradients (``Prox.on_cohort_grad``)."""
    seq, vec = _pair(lambda: [Prox(mu=0.5)], net=net, momentum=0.5)
    _assert_same(seq, vec)
    fedavg = _pair(lambda: [Prox(mu=0.0)], net=net, momentum=0.5)[0]
    assert not torch.allclose(next(seq.net.parameters()), next(fedavg.net.parameters()))  # the term is felt


def test_drfa_equals_the_sequential_path() -> None:
    """DRFA: clients drawn from lambda with replacement (multiplicity and repeat), the snapshot ``w^(t')`` taken from
    the stacked clients (``LambdaSampling.on_cohort_step_end``), so lambda after the dual steps is the same too."""
    for duplicates in ("multiplicity", "repeat"):

        def parts() -> list:
            return [LambdaSampling(gamma=0.5, mode="drfa"), Prox(mu=0.1)]

        seq, vec = _pair(parts, rounds=4, duplicates=duplicates, weighting="uniform")
        _assert_same(seq, vec)
        torch.testing.assert_close(vec.parts[0].lam, seq.parts[0].lam, rtol=0, atol=1e-10)
        assert not torch.allclose(seq.parts[0].lam, torch.full_like(seq.parts[0].lam, 1 / len(SIZES)))


def test_a_nan_client_is_dropped_alike() -> None:
    """A client whose rows hold a NaN trains to a NaN model in its stacked slot only: it is dropped (the same
    client, counted alike) and the others aggregate as on the sequential path."""
    data = toy_data(SIZES, dtype=torch.float64)
    data.x[data.client_indices[2][0]] = float("nan")
    seq, vec = _pair(data=data, clients_per_round=10, rounds=1)
    _assert_same(seq, vec)
    assert vec.faults.dropped == (2,)


def test_progress_ticks_come_in_shard_order() -> None:
    fed = make_fed(_mlp(), toy_data(SIZES, dtype=torch.float64), clients_per_round=6, local_steps=2, vectorize=True)
    rnd, ticks = fed.begin_round(0), []
    fed.train_clients(rnd.shard, ticks.append)
    assert ticks == list(rnd.shard)


class _LocalLoss(FederatedCallback):
    def local_loss(self, fed, client, loss):
        return loss


class _Replaces(FederatedCallback):
    traits = PartTraits(vectorizable=True)

    def local_update(self, fed, client):
        return None


class _Grad(FederatedCallback):
    traits = PartTraits(vectorizable=True)

    def on_local_grad(self, fed, client) -> None: ...


class _ClientEnd(FederatedCallback):
    def on_client_end(self, fed, client) -> None: ...


@pytest.mark.parametrize(
    ("net", "parts", "match"),
    [
        (nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)), [], "BatchNorm1d layers"),
        (_mlp(dropout=0.2), [], "Dropout layers"),
        (_mlp(), [_LocalLoss()], "part _LocalLoss has no vectorised form of its client hooks (local_loss)"),
        (_mlp(), [_Replaces()], "(local_update)"),
        (_mlp(), [_Grad()], "(on_local_grad)"),
        (_mlp(), [_ClientEnd()], "(on_client_end)"),  # not declared vectorizable
    ],
)
def test_what_cannot_be_vectorised_is_refused_in_one_line(net, parts, match: str) -> None:
    raises_one_line(vectorized.check, net, parts, match=match)


def test_what_can_be_vectorised_passes_the_check() -> None:
    vectorized.check(_mlp(dropout=0.0), [Prox(), LambdaSampling(gamma=0.1)])


def test_the_loss_function_sees_one_client() -> None:
    """The task's loss gets one client's ``(B, C)`` outputs and ``(B,)`` targets, padding left out: a batch-mean
    loss is the client's mean, not the cohort's (its values: the equality tests; here its shapes). It runs ``vmap``-ed
    over the clients of each batch size, so the Python function is entered once per size, smallest first."""
    seen: list[tuple] = []

    def loss(out, y):
        seen.append((tuple(out.shape), tuple(y.shape)))
        return F.cross_entropy(out, y)

    data = toy_data([10, 3, 10], dtype=torch.float64)
    kw = dict(clients_per_round=3, local_steps=1, batch_size=5, vectorize=True)
    # diverge_factor=None: the divergence rule's one evaluation of the initial model (all 23 rows) is not training
    fed = make_fed(_mlp(), data, loss_fn=loss, diverge_factor=None, **kw)
    run_rounds(fed, 1)
    # one stack (client 1's 3 rows padded to 5 in the forward); its loss: client 1 alone, then clients 0 and 2
    assert seen == [((3, 3), (3,)), ((5, 3), (5,))]


def test_which_nets_fold_the_cohort_into_the_batch() -> None:
    """Folding needs row-wise layers and parameters in nn.Linear only; flx's linear models and MLP declare their
    forwards row-wise; anything else (convolutions, a batch-flattening layer, custom forwards) is vmapped."""
    from flx.models.nets import CNN, MLP, LogisticRegression

    assert vectorized.foldable(MLP(input_shape=(8, 8), num_classes=10))
    assert vectorized.foldable(LogisticRegression(input_shape=(8, 8), num_classes=10))
    assert not vectorized.foldable(CNN(input_shape=(1, 8, 8), num_classes=10))
    assert not vectorized.foldable(nn.Sequential(nn.Flatten(0), nn.Linear(10, 2)))
    assert not vectorized.foldable(_Gated())


def test_the_folded_forward_equals_each_clients_own_forward() -> None:
    """``m`` clients' rows through the folded net (3-D rows: ``(B, T, in)``) equal each client's net on its rows."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    m, names = 3, [n for n, _ in net.named_parameters()]
    params = [p.detach().unsqueeze(0) + torch.randn(m, *p.shape, dtype=p.dtype) for p in net.parameters()]
    x = torch.randn(m, 5, 7, 4, dtype=torch.float64)
    fed = make_fed(net, toy_data([4], dim=4, dtype=torch.float64))
    stored = [p.mT.contiguous() if p.dim() == 3 else p for p in params]  # weights stored (m, in, out)
    out = vectorized._folded(fed, m)(stored, x, [5] * m)
    for i in range(m):
        own = torch.func.functional_call(net, {n: p[i] for n, p in zip(names, params)}, (x[i],))
        torch.testing.assert_close(out[i], own, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "params",
    [
        {"compositional": False, "beta": 1.0},  # FeDXL1
        {},  # FeDXL2: u tables in the client store, momentum with the server mean
        {"momentum_sync": "client", "replacement": True, "depth": 2},  # momentum kept per client, draws with repl.
        {"pairs": "local", "momentum_sync": "client"},  # the Local Pair baseline
    ],
    ids=["fedxl1", "fedxl2", "fedxl2_client_momentum_replacement", "local_pairs"],
)
def test_fedxl_equals_the_sequential_path(params: dict) -> None:
    """FeDXL's clients stacked: ``sample_batch`` and ``local_loss`` per client inside the stacked step, each client
    drawing from its own generator in the sequential order, the momentum on the stacked gradients. The model, the
    merged score pools and the clients' stored ``u`` / ``m`` equal the sequential run's."""
    from helpers import binary_store

    from flx.parts.xrisk.passive_buffer import PassiveBuffer

    data = binary_store([5, 7, 4, 6, 9], [8, 6, 9, 5, 7], dim=5, shift=0.7)
    kw = dict(clients_per_round=4, local_steps=3, lr=0.2, weighting="uniform", seed=2)
    part = dict(b1=3, b2=4, gamma=0.3, beta=0.5) | params
    torch.manual_seed(0)
    feds = [
        make_fed(nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double(), data, [PassiveBuffer(**part)],
                 vectorize=v, **kw)
        for v in (False, True)
    ]  # fmt: skip
    feds[1].net.load_state_dict(feds[0].net.state_dict())
    for fed in feds:
        run_rounds(fed, 3)
    seq, vec = feds
    _assert_same(seq, vec)
    for a, b in zip(seq.parts[0].pools, vec.parts[0].pools):
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-10) for k in a)
    assert sorted(seq.store.state_dict()["clients"]) == sorted(vec.store.state_dict()["clients"])
    for cid, state in seq.store.state_dict()["clients"].items():
        for key, value in state.items():
            torch.testing.assert_close(vec.store.state_dict()["clients"][cid][key], value, rtol=0, atol=1e-10)
