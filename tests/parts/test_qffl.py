"""q-FedAvg: q=0 is uniform FedAvg, a round equals Algorithm 2 written out, weights follow F_k^q, 2 ranks == 1."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, params, run_rounds, toy_data
from torch import Tensor, nn

from flx.datamodules.datamodule import ClientStore
from flx.errors import ConfigError
from flx.hooks import FederatedCallback
from flx.parts.robustness.qffl import QFFL, qffl_terms

f64 = torch.float64


def _bn_dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 3)).to(f64)


def _flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


class _Record(FederatedCallback):
    """Keeps each client's local parameters (listed after QFFL: the weight it sees is F_k^q)."""

    def __init__(self) -> None:
        self.local: dict[int, Tensor] = {}

    def on_client_end(self, fed, client) -> None:
        self.local[client.cid] = _flat(fed.params).clone()


class _Draws(FederatedCallback):
    def __init__(self, draws: tuple[int, ...]) -> None:
        self.draws = draws

    def sample_clients(self, fed, round_idx, rng):
        return list(self.draws)


@pytest.mark.parametrize("lipschitz", [None, 3.0])
def test_q_zero_is_uniform_fedavg(lipschitz: float | None) -> None:
    """q = 0: a_k = F_k^0 = 1, h_k = L, so s = L m / (m L) = 1 and w^{t+1} = (1/m) sum_k w_k for any L.

    The net has BatchNorm and dropout: evaluating F_k (eval mode) must change neither the buffers nor the RNG.
    """
    data = toy_data([12, 8, 22, 6, 10], dtype=f64)
    kw = dict(clients_per_round=3, local_steps=5, batch_size=4, lr=0.1, seed=2, weighting="uniform")
    avg = make_fed(_bn_dropout_net(), data, **kw)
    qffl = make_fed(_bn_dropout_net(), data, parts=[QFFL(q=0.0, lipschitz=lipschitz)], **kw)
    run_rounds(avg, 3)
    run_rounds(qffl, 3)
    for a, b in zip(avg.net.state_dict().values(), qffl.net.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _logistic_data() -> ClientStore:
    """3 clients of different difficulty: separable by different directions, the last one with random labels."""
    g = torch.Generator().manual_seed(3)
    sizes, dirs = [6, 9, 5], [[1.0, -1.0, 0.5], [-0.5, 2.0, 1.0], None]
    xs, ys = [], []
    for n, d in zip(sizes, dirs):
        x = torch.randn(n, 3, generator=g, dtype=f64)
        y = (x @ torch.tensor(d, dtype=f64) > 0).to(f64) if d else torch.randint(0, 2, (n,), generator=g).to(f64)
        xs.append(x)
        ys.append(y)
    bounds = torch.tensor([0, *sizes]).cumsum(0)
    return ClientStore(torch.cat(xs), torch.cat(ys), [torch.arange(int(a), int(b)) for a, b in zip(bounds, bounds[1:])])


def _bce(out: Tensor, y: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(out.squeeze(-1), y)


@pytest.mark.parametrize("duplicates", ["multiplicity", "repeat"])
@pytest.mark.parametrize(
    ("q", "lipschitz", "draws"), [(0.5, None, (0, 1, 2)), (2.0, 7.0, (0, 1, 2)), (1.0, None, (0, 2, 2))]
)
def test_round_is_algorithm_2(q: float, lipschitz: float | None, draws: tuple[int, ...], duplicates: str) -> None:
    """Logistic regression z = x^T w, F_k(w) = mean(log(1 + e^z) - y z), grad = X^T (sigmoid(X w) - y) / n_k.

    K full-batch steps w <- w - eta grad from w^t give w_k; then, over the draws (a repeated client counts twice),
    Delta w_k = L (w^t - w_k), Delta_k = F_k^q Delta w_k, h_k = q F_k^(q-1) ||Delta w_k||^2 + L F_k^q and
    w^{t+1} = w^t - sum Delta_k / sum h_k, with L = 1/eta when lipschitz is None. Full-batch runs are the same for
    every copy, so duplicates=repeat (one run per draw, each counted once) must give the same step.
    """
    eta, steps, data = 0.5, 4, _logistic_data()
    net = linear(3, 1, dtype=f64, bias=False)
    wt = params(net)[0].squeeze(0)
    parts = [_Draws(draws), QFFL(q=q, lipschitz=lipschitz)]
    kw = dict(clients_per_round=3, local_steps=steps, batch_size=64, lr=eta, duplicates=duplicates)
    fed = make_fed(net, data, parts=parts, loss_fn=_bce, **kw)
    run_rounds(fed, 1)

    L = 1 / eta if lipschitz is None else lipschitz
    deltas, hs = [], []
    for k in draws:
        x, y = data.x[data.client_indices[k]], data.y[data.client_indices[k]]
        fk = float((torch.log1p(torch.exp(x @ wt)) - y * (x @ wt)).mean())
        w = wt.clone()
        for _ in range(steps):
            w = w - eta * x.T @ (torch.sigmoid(x @ w) - y) / len(y)
        dw = L * (wt - w)
        deltas.append(fk**q * dw)
        hs.append(q * fk ** (q - 1) * float(dw @ dw) + L * fk**q)
    expected = wt - sum(deltas) / sum(hs)
    torch.testing.assert_close(net.weight.detach().squeeze(0), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("q", [0.5, 2.0])
def test_higher_loss_clients_pull_harder(q: float) -> None:
    """w^{t+1} - w^t = sum_k c_k (w_k - w^t) with c_k = s F_k^q / sum_j F_j^q and s = L sum a / sum h in (0, 1].

    So c_i / c_j = (F_i / F_j)^q: the highest-loss client gets more than FedAvg's uniform share 1/m. The c_k are
    recovered by least squares from the clients' local models (minibatch SGD, multiclass cross-entropy).
    """
    data = toy_data([10, 14, 12], dtype=f64)
    data.x[data.client_indices[2]] *= 4.0  # larger logits: a clearly larger loss at w^t
    rec, net = _Record(), linear(dtype=f64)
    fed = make_fed(net, data, parts=[QFFL(q=q), rec], clients_per_round=3, local_steps=6, batch_size=4, lr=0.1)
    wt = _flat(params(net))
    with torch.no_grad():
        losses = torch.stack([F.cross_entropy(net(data.x[i]), data.y[i]) for i in data.client_indices])
    run_rounds(fed, 1)

    updates = torch.stack([rec.local[k] - wt for k in range(3)], dim=1)  # (P, 3)
    step = _flat(params(net)) - wt
    c = torch.linalg.lstsq(updates, step[:, None]).solution.squeeze(1)
    torch.testing.assert_close(updates @ c, step, rtol=0, atol=1e-12)  # the step is a combination of the updates
    torch.testing.assert_close(c / c.sum(), losses**q / (losses**q).sum(), rtol=1e-8, atol=0)
    assert int(c.argmax()) == int(losses.argmax()) == 2
    assert float(c[2] / c.sum()) > 1 / 3
    assert 0 < float(c.sum()) <= 1 + 1e-12


def test_two_ranks_equal_one_rank() -> None:
    """Sharding over 2 ranks (simulated sum-reduce of the round buffer, which carries the 2 q-FFL sums) gives the 1-rank
    model."""
    data = toy_data([7, 12, 30, 4, 19, 25], dtype=f64)
    kw = dict(clients_per_round=5, local_steps=4, batch_size=5, lr=0.2, seed=1)
    single = make_fed(linear(dtype=f64), data, parts=[QFFL(q=1.5)], **kw)
    run_rounds(single, 3)

    sent: dict[tuple[int, int], Tensor] = {}  # (rank, numel) -> that rank's buffer

    def reduce_sum(t: Tensor) -> Tensor:
        return sum(v for (_, n), v in sent.items() if n == t.numel())

    parts = [QFFL(q=1.5), QFFL(q=1.5)]
    ranks = [
        make_fed(linear(dtype=f64), data, [parts[r]], rank=r, world_size=2, reduce_sum=reduce_sum, **kw) for r in (0, 1)
    ]
    for r in range(3):
        shards = [fed.begin_round(r).shard for fed in ranks]
        for k, fed in enumerate(ranks):
            for cid in shards[k]:
                fed.train_client(cid)
            sent[(k, fed.aggregator._flat.numel())] = fed.aggregator._flat.clone()
        for fed in ranks:
            fed.end_round()
    for fed in ranks:
        for a, b in zip(fed.net.parameters(), single.net.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_terms_closed_form() -> None:
    """a = F^q, h = q F^(q-1) L^2 d + L F^q; the curvature term is 0 for q = 0 or d = 0, infinite for F = 0, q < 1."""
    assert qffl_terms(4.0, 0.25, q=0.5, lipschitz=2.0) == (2.0, 0.5 * 4.0**-0.5 * 4.0 * 0.25 + 2.0 * 2.0)
    assert qffl_terms(0.0, 1.0, q=0.0, lipschitz=3.0) == (1.0, 3.0)
    assert qffl_terms(0.0, 0.0, q=0.5, lipschitz=3.0) == (0.0, 0.0)
    assert qffl_terms(0.0, 1.0, q=0.5, lipschitz=3.0) == (0.0, math.inf)
    assert qffl_terms(0.0, 1.0, q=1.0, lipschitz=3.0) == (0.0, 9.0)


def test_negative_loss_stops_the_run() -> None:
    fed = make_fed(
        linear(),
        toy_data([5, 6]),
        parts=[QFFL(q=0.5)],
        loss_fn=lambda o, y: -F.cross_entropy(o, y),
        clients_per_round=2,
    )
    with pytest.raises(RuntimeError, match="F_k"):
        run_rounds(fed, 1)


def test_zero_losses_stop_the_run() -> None:
    """F_k = 0 everywhere with q > 0: every weight F_k^q is 0, so the round has no server step to take."""
    fed = make_fed(
        linear(), toy_data([5, 6]), parts=[QFFL(q=0.5)], loss_fn=lambda o, y: 0.0 * o.sum(), clients_per_round=2
    )
    with pytest.raises(RuntimeError, match="zero total weight"):
        run_rounds(fed, 1)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"q": -0.1}, "algo.q"),
        ({"q": math.nan}, "algo.q"),
        ({"q": math.inf}, "algo.q"),
        ({"lipschitz": 0.0}, "algo.lipschitz"),
        ({"lipschitz": -2.0}, "algo.lipschitz"),
    ],
)
def test_bad_values_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        QFFL(**kwargs)
