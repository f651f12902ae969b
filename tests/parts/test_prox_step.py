"""FedMiD (ProxStep) and FedDualAvg (DualAveraging) against hand-written rounds; invariances.

The toy problem is least squares with a bias, ``f_i(w, b) = 1/(2 n_i) ||X_i w + b - y_i||^2``, full-batch steps
(``batch_size >= n_i``), every client in every round, weights ``p_i = n_i``; the regulariser is ``mu ||w||_1`` on the
weight only (``params: ["*weight"]``), so the bias takes plain gradient steps. ``soft(v, t) = sign(v) max(|v| - t, 0)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import build_of, linear, make_fed, raises_one_line, run_rounds, toy_data
from torch import Tensor

from flx import composition
from flx.context import FederationConfig
from flx.parts.proximal.prox_step import DualAveraging, ProxStep
from flx.server import ServerOptConfig

SIZES = [11, 7, 15]
L1 = {"name": "l1", "mu": 0.3, "params": ["*weight"]}


def _lsq_data():
    data = toy_data(SIZES, dim=4, dtype=torch.float64)
    data.y = data.x @ torch.tensor([1.5, 0.0, -0.2, 0.0], dtype=torch.float64) + 0.3  # a sparse real-valued target
    return data


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()


def _grad(x: Tensor, y: Tensor, w: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    r = x @ w + b - y
    return x.T @ r / len(y), r.mean()


def _soft(v: Tensor, t: float) -> Tensor:
    return v.sign() * (v.abs() - t).clamp_min(0)


def _lsq_fed(parts, eta: float = 0.2, server_lr: float = 1.0, **kw):
    net = linear(4, 1, dtype=torch.float64)
    w0, b0 = net.weight.detach().squeeze(0).clone(), net.bias.detach().clone()
    cfg = dict(clients_per_round=3, local_steps=3, batch_size=64, lr=eta, server=ServerOptConfig(lr=server_lr))
    fed = make_fed(net, _lsq_data(), parts=parts, loss_fn=_mse, **{**cfg, **kw})
    return fed, w0, b0


def _clients(data):
    return [(data.x[i], data.y[i]) for i in data.client_indices]


@pytest.mark.parametrize(("server_prox", "server_lr", "mu"), [(True, 1.0, 0.3), (False, 1.0, 0.8), (True, 0.5, 0.5)])
def test_fedmid_round_is_averaged_proximal_gd(server_prox: bool, server_lr: float, mu: float) -> None:
    """One round, K = 3: w_{i,k+1} = soft(w_{i,k} - eta g_w, eta mu), b_{i,k+1} = b_{i,k} - eta g_b (unregularised);
    w_bar = sum n_i w_{i,3} / sum n_i; w' = w^0 + eta_s (w_bar - w^0), and with the server prox
    w^1 = soft(w', eta_s eta K mu) (the bias: b' only). Exact zeros where the formula has them: without the server
    prox an entry of the mean is zero only where every client's is ("the curse of primal averaging"), hence a larger
    mu there."""
    eta, k_steps = 0.2, 3
    fed, w0, b0 = _lsq_fed([ProxStep({**L1, "mu": mu}, server_prox=server_prox)], eta=eta, server_lr=server_lr)
    run_rounds(fed, 1)

    ws, bs = [], []
    for x, y in _clients(fed.data):
        w, b = w0.clone(), b0.clone()
        for _ in range(k_steps):
            gw, gb = _grad(x, y, w, b)
            w, b = _soft(w - eta * gw, eta * mu), b - eta * gb
        ws.append(w)
        bs.append(b)
    n = torch.tensor(SIZES, dtype=torch.float64)
    w_bar, b_bar = sum(ni * w for ni, w in zip(n, ws)) / n.sum(), sum(ni * b for ni, b in zip(n, bs)) / n.sum()
    w, b = w0 + server_lr * (w_bar - w0), b0 + server_lr * (b_bar - b0)
    if server_prox:
        w = _soft(w, server_lr * eta * k_steps * mu)
    torch.testing.assert_close(fed.net.weight.detach().squeeze(0), w, rtol=0, atol=1e-12)
    torch.testing.assert_close(fed.net.bias.detach(), b, rtol=0, atol=1e-12)
    assert (w == 0).any() and torch.equal(fed.net.weight.squeeze(0) == 0, w == 0)  # exact zeros, same support
    assert (b != 0).all()


@pytest.mark.parametrize(
    "part",
    [
        lambda: ProxStep({"name": "l1", "mu": 0.0}),
        lambda: ProxStep({"name": "l1", "mu": 0.0}, server_prox=False),
        lambda: ProxStep(None),
        lambda: DualAveraging({"name": "l1", "mu": 0.0, "params": ["*weight"]}),
        lambda: DualAveraging({"name": "none"}),
    ],
    ids=["fedmid", "fedmid-no-server-prox", "fedmid-null", "feddualavg", "feddualavg-none"],
)
def test_zero_regulariser_is_fedavg_bitwise(part) -> None:
    """h = 0: every prox is the identity, so FedMiD and FedDualAvg (whose dual is then the primal) are FedAvg."""
    data = toy_data([13, 8, 21, 5])
    kw = dict(clients_per_round=3, local_steps=5, batch_size=4, lr=0.1, seed=2)
    avg, other = make_fed(linear(), data, **kw), make_fed(linear(), data, parts=[part()], **kw)
    run_rounds(avg, 3)
    run_rounds(other, 3)
    for a, b in zip(avg.net.parameters(), other.net.parameters()):
        assert torch.equal(a, b)


def _dual_avg_reference(fed, w0: Tensor, b0: Tensor, rounds: int, eta: float, eta_s: float, mu: float, k: int):
    """FedDualAvg written out: z^0 = (w^0, b^0), eta~_0 = 0; client i from z^t: for k' < K,
    x = (soft(z_w, (eta~_t + eta k') mu), z_b), z <- z - eta grad f_i(x); the server z^{t+1} = z^t + eta_s (z_bar - z^t)
    (z_bar the n_i-weighted mean), eta~_{t+1} = eta~_t + eta_s eta K, w^{t+1} = (soft(z_w, eta~_{t+1} mu), z_b)."""
    zw, zb, elapsed = w0.clone(), b0.clone(), 0.0
    n = torch.tensor(SIZES, dtype=torch.float64)
    for _ in range(rounds):
        ws, bs = [], []
        for x, y in _clients(fed.data):
            w, b = zw.clone(), zb.clone()
            for j in range(k):
                gw, gb = _grad(x, y, _soft(w, (elapsed + eta * j) * mu), b)
                w, b = w - eta * gw, b - eta * gb
            ws.append(w)
            bs.append(b)
        zw = zw + eta_s * (sum(ni * w for ni, w in zip(n, ws)) / n.sum() - zw)
        zb = zb + eta_s * (sum(ni * b for ni, b in zip(n, bs)) / n.sum() - zb)
        elapsed += eta_s * eta * k
    return zw, zb, elapsed


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
@pytest.mark.parametrize("rounds", [1, 2])
def test_feddualavg_matches_the_written_out_algorithm(rounds: int, server_lr: float) -> None:
    eta, mu, k = 0.2, 0.8, 3
    part = DualAveraging({**L1, "mu": mu})
    fed, w0, b0 = _lsq_fed([part], eta=eta, server_lr=server_lr)
    run_rounds(fed, rounds)
    zw, zb, elapsed = _dual_avg_reference(fed, w0, b0, rounds, eta, server_lr, mu, k)
    assert part.elapsed == pytest.approx(elapsed, rel=1e-15)
    torch.testing.assert_close(part.z[0].squeeze(0), zw, rtol=0, atol=1e-12)
    torch.testing.assert_close(part.z[1], zb, rtol=0, atol=1e-12)
    w = _soft(zw, elapsed * mu)
    torch.testing.assert_close(fed.net.weight.detach().squeeze(0), w, rtol=0, atol=1e-12)
    torch.testing.assert_close(fed.net.bias.detach(), zb, rtol=0, atol=1e-12)
    assert (w == 0).any() and torch.equal(fed.net.weight.squeeze(0) == 0, w == 0)


def _two_ranks(make_part, rounds: int, **kw):
    """The 2-rank run of tests/test_federation.py::test_two_ranks_equal_one_rank: ranks run one after the other,
    the collective sums their round buffers (aggregate, counters and the parts' statistics)."""
    data = toy_data([7, 12, 30, 4, 19, 25])
    buffers: dict[int, Tensor] = {}
    ranks = [
        make_fed(
            linear(), data, parts=[make_part()], rank=r, world_size=2, reduce_sum=lambda t: sum(buffers.values()), **kw
        )
        for r in (0, 1)
    ]
    for r in range(rounds):
        shards = [fed.begin_round(r).shard for fed in ranks]
        for k, fed in enumerate(ranks):
            for cid in shards[k]:
                fed.train_client(cid)
            buffers[k] = fed.aggregator._flat.clone()
        for fed in ranks:
            fed.end_round()
    return ranks


@pytest.mark.parametrize(
    "make_part",
    [
        lambda: ProxStep({"name": "l1", "mu": 0.05, "params": ["*weight"]}),
        lambda: DualAveraging({"name": "l1", "mu": 0.05, "params": ["*weight"]}),
        lambda: DualAveraging({"name": "nuclear", "mu": 0.05, "params": ["weight"]}),
    ],
    ids=["fedmid", "feddualavg", "feddualavg-nuclear"],
)
def test_two_ranks_equal_one_rank(make_part) -> None:
    kw = dict(clients_per_round=5, local_epochs=1, batch_size=5, lr=0.2, seed=1)  # K_i differ: K-bar is a statistic
    single = make_fed(linear(), toy_data([7, 12, 30, 4, 19, 25]), parts=[make_part()], **kw)
    run_rounds(single, 3)
    for fed in _two_ranks(make_part, 3, **kw):
        for a, b in zip(fed.net.parameters(), single.net.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        if isinstance(fed.parts[0], DualAveraging):
            assert fed.parts[0].elapsed == pytest.approx(single.parts[0].elapsed, rel=1e-6)


def test_server_step_uses_the_weighted_mean_step_count() -> None:
    """local_epochs=1, B=4: K_i = ceil(n_i / 4) = (3, 2, 4); the statistic holds (sum n_i K_i, sum n_i)."""
    fed = make_fed(linear(), toy_data(SIZES), parts=[ProxStep(L1)], clients_per_round=3, local_epochs=1, batch_size=4)
    run_rounds(fed, 1)
    torch.testing.assert_close(fed.stat("prox_step/steps"), torch.tensor([11.0 * 3 + 7 * 2 + 15 * 4, 33.0]))


def test_feddualavg_resumed_equals_uninterrupted() -> None:
    """2 rounds, a new federation and part loaded from the state_dict (and the net), 2 more == 4 rounds."""
    data, kw = toy_data([13, 8, 21, 5]), dict(clients_per_round=3, local_steps=4, batch_size=4, lr=0.1, seed=3)
    reg = {"name": "l1", "mu": 0.2, "params": ["*weight"]}
    full = make_fed(linear(), data, parts=[DualAveraging(reg)], **kw)
    run_rounds(full, 4)
    first = make_fed(linear(), data, parts=[DualAveraging(reg)], **kw)
    run_rounds(first, 2)
    part = DualAveraging(reg)
    net = linear()
    net.load_state_dict(first.net.state_dict())
    resumed = make_fed(net, data, parts=[part], **kw)
    part.load_state_dict(first.parts[0].state_dict())  # after on_attach, as a resumed run does
    run_rounds(resumed, 2, start=2)
    for a, b in zip(full.net.parameters(), resumed.net.parameters()):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(full.parts[0].z, part.z)) and full.parts[0].elapsed == part.elapsed


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (dict(momentum=0.9), "algo.momentum=0.9: FedDualAvg"),
        (dict(weight_decay=1e-4), "algo.weight_decay=0.0001: FedDualAvg"),
        (dict(aggregator="count_mean"), "algo.aggregator='count_mean': FedDualAvg"),
    ],
)
def test_feddualavg_rejects_what_it_cannot_use(cfg: dict, match: str) -> None:
    raises_one_line(composition.check, build_of([DualAveraging(L1)], FederationConfig(**cfg)), match=match)


def test_bad_options_name_the_key() -> None:
    raises_one_line(ProxStep, {"name": "lasso"}, match="algo.regularizer.name='lasso'")
    raises_one_line(ProxStep, L1, server_prox="yes", match="algo.server_prox='yes'")
    raises_one_line(make_fed, linear(), toy_data(SIZES), parts=[ProxStep({**L1, "params": ["fc*"]})], match="fc*")


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["fedmid", "feddualavg"])
def test_algo_configs_train_and_resume(tmp_path: Path, algo: str) -> None:
    """``algo=fedmid|feddualavg`` through the entry point: exact zeros in the weights, none in the biases; 4 rounds
    == 2 rounds + a resume from the checkpoint to 4 (FedDualAvg's z and eta~ come back with the part's state), on
    fresh minibatches (both configs' default ``algo.minibatch``, named here: the stream's end-to-end resume check)."""
    from flx.config import precheck
    from flx.run import train

    base = [f"algo={algo}", "model=logreg", "partition.num_clients=6", "algo.clients_per_round=3", "logger=none"]
    base += ["algo.local_steps=3", "algo.regularizer.mu=0.05", "callbacks.progress_bar=null", "trainer.accelerator=cpu"]
    base += ["trainer.enable_progress_bar=false", "algo.minibatch=fresh"]

    def run(out: str, *extra: str) -> dict:
        train(precheck([*base, *extra, f"paths.output_dir={tmp_path / out}"]))
        return torch.load(tmp_path / out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)

    full = run("a", "algo.rounds=4")
    run("b", "algo.rounds=2")
    resumed = run("c", "algo.rounds=4", f"ckpt_path={tmp_path / 'b' / 'checkpoints' / 'last.ckpt'}")
    weights = [v for k, v in full["state_dict"].items() if k.endswith("weight")]
    biases = [v for k, v in full["state_dict"].items() if k.endswith("bias")]
    assert any((w == 0).any() for w in weights) and all((b != 0).all() for b in biases)
    for key, value in full["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][key]), key
