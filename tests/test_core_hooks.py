"""The core v2 hooks and helpers, each exercised by a small test part against a hand computation.

``register_stat`` (a statistic in the round's one all-reduce), ``local_update`` (a closed-form local step instead of K
SGD steps, ``local_steps=0``), the aggregators by config with ``client.masks`` (``count_mean``, ``admm_sum``),
``grad_at`` / ``hvp`` at other parameters, ``personalize`` / ``evaluate_clients``, ``broadcast`` / ``on_server``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, params, run_rounds, toy_data
from torch import Tensor

from flx import autodiff
from flx.datamodules.client_eval import ClientRows
from flx.federation import COUNTERS
from flx.hooks import HOOKS, FederatedCallback, first_answer

f64 = torch.float64


def _regression(sizes: list[int], dim: int = 3, seed: int = 0):
    """Float targets y = x a + noise; client c owns a contiguous block of sizes[c] rows (float64)."""
    data = toy_data(sizes, dim=dim, seed=seed, dtype=f64)
    g = torch.Generator().manual_seed(seed + 1)
    data.y = data.x @ torch.randn(dim, 1, generator=g, dtype=f64) + 0.1 * torch.randn(len(data.x), 1, dtype=f64)
    return data


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


class _Sizes(FederatedCallback):
    """Registers a per-client statistic (n_i, written by the rank that trains i) and reads its sum after the reduce."""

    def __init__(self) -> None:
        self.seen: list[Tensor] = []

    def on_attach(self, fed) -> None:
        fed.register_stat("sizes", torch.zeros(fed.num_clients))

    def on_client_end(self, fed, client) -> None:
        fed.stat("sizes")[client.cid] += client.num_samples

    def on_round_end(self, fed, rnd) -> None:
        self.seen.append(fed.stat("sizes").clone())


def _two_ranks(data, parts_of, rounds: int, **kw):
    """Two simulated ranks run one after the other; every collective is counted and is a sum of the ranks' buffers."""
    sent: dict[int, Tensor] = {}
    calls: list[int] = []

    def reduce_sum(t: Tensor) -> Tensor:
        calls.append(t.numel())
        return sum(sent.values())

    ranks = [
        make_fed(linear(dtype=f64), data, parts_of(r), rank=r, world_size=2, reduce_sum=reduce_sum, **kw)
        for r in (0, 1)
    ]
    per_round = []
    for r in range(rounds):
        shards = [fed.begin_round(r).shard for fed in ranks]
        for k, fed in enumerate(ranks):
            for cid in shards[k]:
                fed.train_client(cid)
            sent[k] = fed.aggregator._flat.clone()
        before = len(calls)
        for fed in ranks:
            fed.end_round()
        per_round.append((len(calls) - before) // 2)  # both ranks call the (simulated) collective once
    return ranks, per_round


def test_registered_stat_rides_in_the_one_reduce_and_sums_over_ranks() -> None:
    data = toy_data([5, 8, 3, 9], dim=5, dtype=f64)
    kw = dict(clients_per_round=3, local_steps=2, batch_size=4, seed=2)
    single = _Sizes()
    fed1 = make_fed(linear(dtype=f64), data, [single], **kw)
    run_rounds(fed1, 3)
    parts = [_Sizes(), _Sizes()]
    ranks, per_round = _two_ranks(data, lambda r: [parts[r]], 3, **kw)
    assert per_round == [1, 1, 1]  # the aggregate, the counters and the statistic: one collective a round
    for r, seen in enumerate(single.seen):
        expected = torch.zeros(4)
        cohort = list(fed1.rnd.cohort) if r == 2 else None
        assert seen.sum() == sum(data.client_indices[c].numel() for c in torch.nonzero(seen).flatten().tolist())
        if cohort is not None:
            expected[cohort] = torch.tensor([float(len(data.client_indices[c])) for c in cohort])
            torch.testing.assert_close(seen.float(), expected)
        for part in parts:  # both ranks see the same sum, equal to the one-rank value
            torch.testing.assert_close(part.seen[r], seen)
    for a, b in zip(params(ranks[0].net), params(fed1.net)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_register_stat_after_attach_and_twice_is_refused() -> None:
    fed = make_fed(linear(), toy_data([4, 4]), clients_per_round=2)
    with pytest.raises(RuntimeError, match="on_attach"):
        fed.register_stat("late", torch.zeros(2))

    class Twice(FederatedCallback):
        def on_attach(self, fed) -> None:
            fed.register_stat("x", torch.zeros(1))
            fed.register_stat("x", torch.zeros(1))

    with pytest.raises(ValueError, match="already registered"):
        make_fed(linear(), toy_data([4, 4]), [Twice()], clients_per_round=2)


def test_fp64_statistic_widens_the_round_buffer() -> None:
    class Wide(FederatedCallback):
        def on_attach(self, fed) -> None:
            fed.register_stat("wide", torch.zeros(3, dtype=f64))

    fed = make_fed(linear(), toy_data([4, 4]), [Wide()], clients_per_round=2)
    assert fed.stat("wide").dtype == f64 and fed.stat("wide").shape == (3,)


def test_train_loss_is_the_mean_over_aggregated_clients() -> None:
    losses: list[float] = []

    class Record(FederatedCallback):
        def on_client_end(self, fed, client) -> None:
            pass

    fed = make_fed(linear(dtype=f64), toy_data([6, 7, 8], dtype=f64), [Record()], clients_per_round=3, local_steps=3)
    rnd = fed.begin_round(0)
    for cid in rnd.shard:
        losses.append(float(fed.train_client(cid)))
    fed.end_round()
    assert fed.train_loss == pytest.approx(sum(losses) / 3, rel=1e-12)
    assert int(fed.buffer.counters[COUNTERS.index("aggregated")]) == 3


class _ClosedForm(FederatedCallback):
    """local_update: one full-batch gradient step of the client's MSE, w_i = w - eta grad f_i(w), via fed.grad_at."""

    def __init__(self, eta: float) -> None:
        self.eta = eta

    def local_update(self, fed, client) -> Tensor:
        rows = fed.data.client_indices[client.cid]
        grads = fed.grad_at([p.detach() for p in fed.params], rows)
        with torch.no_grad():
            for p, g in zip(fed.params, grads):
                p -= self.eta * g
        return _mse(fed.net(fed.data.x[rows]), fed.data.y[rows]).detach()


def test_local_update_replaces_the_sgd_steps_with_local_steps_zero() -> None:
    """FedAvg of one full-batch GD step per client equals the hand-computed sum_i n_i (w - eta grad f_i(w)) / n."""
    data = _regression([4, 6, 5])
    net = linear(dim=3, out=1, dtype=f64)
    w0 = params(net)
    fed = make_fed(net, data, [_ClosedForm(0.1)], loss_fn=_mse, clients_per_round=3, local_steps=0)
    run_rounds(fed, 1)
    expected = [torch.zeros_like(t) for t in w0]
    n = sum(len(r) for r in data.client_indices)
    for rows in data.client_indices:
        x, y = data.x[rows], data.y[rows]
        w = [t.clone().requires_grad_() for t in w0]
        grads = torch.autograd.grad(F.mse_loss(x @ w[0].T + w[1], y), w)
        for e, t, g in zip(expected, w0, grads):
            e += len(rows) / n * (t - 0.1 * g)
    for a, b in zip(params(net), expected):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


class _PrefixMask(FederatedCallback):
    """client.masks: client c trains (and uploads) only the first c + 1 output rows of the linear layer."""

    def on_client_start(self, fed, client) -> None:
        masks = []
        for t in fed.local_state:
            m = torch.zeros_like(t)
            m[: client.cid + 1] = 1
            masks.append(m)
        client.masks = masks

    def on_local_grad(self, fed, client) -> None:
        for p, m in zip(fed.params, client.masks):
            p.grad.mul_(m)


def test_count_mean_averages_each_entry_over_the_clients_that_hold_it() -> None:
    data = toy_data([5, 5], dim=4, classes=4, dtype=f64)
    net = linear(dim=4, out=4, dtype=f64)
    w0 = params(net)
    locals_: dict[int, list[Tensor]] = {}

    class Keep(FederatedCallback):
        def on_client_end(self, fed, client) -> None:
            locals_[client.cid] = [t.detach().clone() for t in fed.local_state]

    fed = make_fed(net, data, [_PrefixMask(), Keep()], clients_per_round=2, local_steps=2, aggregator="count_mean")
    run_rounds(fed, 1)
    w, b = params(net)
    # row 0: both clients; row 1: client 1 only; rows 2-3: nobody (keep w^0)
    torch.testing.assert_close(w[0], (locals_[0][0][0] + locals_[1][0][0]) / 2, rtol=0, atol=1e-15)
    torch.testing.assert_close(w[1], locals_[1][0][1], rtol=0, atol=1e-15)
    torch.testing.assert_close(w[2:], w0[0][2:], rtol=0, atol=0)
    torch.testing.assert_close(b[2:], w0[1][2:], rtol=0, atol=0)


def test_masks_with_the_weighted_mean_are_refused() -> None:
    fed = make_fed(linear(), toy_data([4, 4]), [_PrefixMask()], clients_per_round=2, local_steps=1)
    with pytest.raises(ValueError, match="count_mean"):
        run_rounds(fed, 1)


class _Admm(FederatedCallback):
    """Uploads u_i = y_i + rho theta_i with weight rho (AugFL Eq. 13's sum), y_i a fixed client constant."""

    def __init__(self, rho: float) -> None:
        self.rho = rho

    def on_client_end(self, fed, client) -> None:
        with torch.no_grad():
            for t in fed.local_state:
                t.mul_(self.rho).add_(float(client.cid + 1))
        client.weight = self.rho


def test_admm_sum_is_the_closed_form_server_step() -> None:
    data = toy_data([5, 6, 7], dim=3, classes=2, dtype=f64)
    net = linear(dim=3, out=2, dtype=f64)
    thetas: dict[int, list[Tensor]] = {}

    class Keep(FederatedCallback):
        def on_client_end(self, fed, client) -> None:
            thetas[client.cid] = [t.detach().clone() for t in fed.local_state]

    fed = make_fed(net, data, [Keep(), _Admm(0.7)], clients_per_round=3, local_steps=2, aggregator="admm_sum")
    run_rounds(fed, 1)
    for k, p in enumerate(params(net)):
        expected = sum((c + 1) + 0.7 * thetas[c][k] for c in range(3)) / (3 * 0.7)
        torch.testing.assert_close(p, expected, rtol=0, atol=1e-14)


def test_fed_grad_at_and_hvp_wrap_autodiff_on_store_rows() -> None:
    data = _regression([6, 6])
    net = linear(dim=3, out=1, dtype=f64)
    fed = make_fed(net, data, loss_fn=_mse, clients_per_round=2)
    rows = data.client_indices[1]
    at = [p.detach() + 0.3 for p in fed.params]
    v = [torch.ones_like(p) for p in fed.params]
    for a, b in zip(fed.grad_at(at, rows), autodiff.grad_at(net, at, (data.x[rows], data.y[rows]), _mse)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # MSE of a linear model: H v = 2 [X 1]^T [X 1] v / n, whatever the parameters
    xt = torch.cat([data.x[rows], torch.ones(len(rows), 1, dtype=f64)], 1)
    hv = 2 * xt.T @ xt @ torch.ones(4, dtype=f64) / len(rows)
    for mode in ("exact", "fd"):
        got = fed.hvp(v, rows, mode=mode, params=at)
        torch.testing.assert_close(torch.cat([g.flatten() for g in got]), hv, rtol=1e-6, atol=1e-8)
    assert all(float(g.abs().max()) == 0 for g in fed.hvp(v, rows, mode="none"))


class _Shift(FederatedCallback):
    """personalize: client c's model is the global one with c added to the bias (undone by the federation)."""

    def personalize(self, fed, cid):
        @contextlib.contextmanager
        def shifted():
            with torch.no_grad():
                fed.net.bias += float(cid)
            yield

        return shifted()


def test_personalize_and_evaluate_clients_against_a_hand_computation() -> None:
    data = _regression([4, 5, 6])
    net = linear(dim=3, out=1, dtype=f64)
    fed = make_fed(net, data, [_Shift()], loss_fn=_mse, clients_per_round=3)
    before = params(net)
    rng = torch.get_rng_state()
    evaluation = ClientRows(data.x, data.y, [*data.client_indices, torch.zeros(0, dtype=torch.long)])
    got = fed.evaluate_clients(evaluation, _mse)
    for cid, (x, y) in enumerate(evaluation[c] for c in range(3)):
        expected = F.mse_loss(x @ before[0].T + before[1] + cid, y)
        torch.testing.assert_close(got[cid], expected.double(), rtol=0, atol=1e-14)
    assert torch.isnan(got[3])  # a client without rows
    assert all(torch.equal(a, b) for a, b in zip(params(net), before)) and torch.equal(torch.get_rng_state(), rng)
    assert fed.parts_with("personalize") and not make_fed(linear(), toy_data([3])).parts_with("personalize")


def test_personalize_restores_the_net_even_when_the_block_raises() -> None:
    fed = make_fed(linear(dim=3, out=1, dtype=f64), _regression([4]), [_Shift()], loss_fn=_mse, clients_per_round=1)
    before = params(fed.net)
    with pytest.raises(KeyError), fed.personalize(3):
        assert float(fed.net.bias.detach()) == pytest.approx(float(before[1]) + 3)
        raise KeyError("boom")
    assert all(torch.equal(a, b) for a, b in zip(params(fed.net), before))


def test_on_server_runs_once_and_broadcast_reaches_every_rank() -> None:
    runs: list[int] = []
    box: dict[str, object] = {}

    def broadcast(obj):  # rank 0 calls first and fills the box; rank 1 receives rank 0's object
        if "obj" not in box:
            box["obj"] = obj
        return box["obj"]

    data = toy_data([4, 4])
    feds = [make_fed(linear(), data, clients_per_round=2, rank=r, world_size=2, broadcast=broadcast) for r in (0, 1)]
    results = [fed.on_server(lambda fed=fed: runs.append(fed.rank) or f"trained on rank {fed.rank}") for fed in feds]
    assert runs == [0] and results == ["trained on rank 0"] * 2
    assert make_fed(linear(), toy_data([4])).broadcast({"a": 1}) == {"a": 1}


def test_hook_set_is_documented_in_the_round_protocol() -> None:
    """docs/round_protocol.md's hook table lists every hook of flx.hooks (the single documented contract)."""
    from pathlib import Path

    table = (Path(__file__).resolve().parents[1] / "docs" / "round_protocol.md").read_text()
    missing = [h for h in HOOKS if f"`{h}(" not in table]
    assert not missing, f"hooks missing from docs/round_protocol.md: {missing}"


def test_client_rows_are_the_steps_minibatch() -> None:
    """``client.rows`` holds the step's row indices, so ``fed.grad_at(w, client.rows)`` is the step's gradient."""
    data = _regression([9, 7])
    seen: list[bool] = []

    class Check(FederatedCallback):
        def on_local_grad(self, fed, client) -> None:
            assert torch.equal(fed.data.x[client.rows], client.batch[0])
            at = [p.detach() for p in fed.params]
            seen.append(all(torch.equal(g, p.grad) for g, p in zip(fed.grad_at(at, client.rows), fed.params)))

    fed = make_fed(linear(dim=3, out=1, dtype=f64), data, [Check()], loss_fn=_mse, clients_per_round=2, batch_size=4)
    run_rounds(fed, 1)
    assert seen and all(seen)


def test_first_answer_asks_in_order_until_one_answers() -> None:
    """The rule of the hooks one part answers for all: the parts in order, the first non-None answer wins, the later
    parts are never asked; None when no part answers."""
    asked: list[str] = []

    class Answers(FederatedCallback):
        def __init__(self, name: str, answer: object) -> None:
            self.name, self.answer = name, answer

        def release_loss(self, fed, cid, state, round_idx):
            asked.append(self.name)
            return self.answer if cid == 0 else None

    parts = [Answers("a", None), Answers("b", 0.0), Answers("c", 2.0)]
    assert first_answer(parts, "release_loss", None, 0, {}, 3) == 0.0  # 0.0 is an answer: only None defers
    assert asked == ["a", "b"]
    asked.clear()
    assert first_answer(parts, "release_loss", None, 1, {}, 3) is None
    assert asked == ["a", "b", "c"]
    assert first_answer([], "sample_batch", None, None) is None
