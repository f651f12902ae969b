"""Closed-form and invariance tests of the round protocol (no Lightning, milliseconds each)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import full_batch_gd, linear, make_fed, params, run_rounds, toy_data
from torch import nn

from flx.hooks import FederatedCallback
from flx.sampling import NUMPY_FROM, derive_seed, derive_seeds, local_batches, shard_greedy, uniform_cohort


def test_one_client_fedavg_equals_centralised_sgd() -> None:
    """FedAvg with a single client, server SGD(lr=1): every round is K SGD steps on that client's data.

    The centralised reference draws its minibatches exactly as documented for a client: a permutation of
    the client's rows from a generator seeded by ``derive_seed(seed, round, client)``, reshuffled when
    exhausted. Weights must be identical (bitwise).
    """
    data = toy_data([37])
    fed = make_fed(linear(), data, rounds=3, clients_per_round=1, local_steps=7, batch_size=8, lr=0.1, seed=3)
    run_rounds(fed, 3)

    ref = linear()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for r in range(3):
        g = torch.Generator().manual_seed(derive_seed(3, r, 0))
        steps = 0
        while steps < 7:
            for b in torch.randperm(37, generator=g).split(8):
                if steps == 7:
                    break
                opt.zero_grad()
                F.cross_entropy(ref(data.x[b]), data.y[b]).backward()
                opt.step()
                steps += 1
    for a, b in zip(fed.net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_full_batch_fedavg_equals_centralised_gd() -> None:
    """Full participation, K=1 full-batch step, weights p_i = n_i:

    w' = sum_i (n_i/n) (w - eta grad f_i(w)) = w - eta grad( sum_i (n_i/n) f_i )(w) = w - eta grad F(w),
    with F the mean loss over the union of the clients' data (float64).
    """
    sizes = [5, 17, 9, 30]
    data = toy_data(sizes, dtype=torch.float64)
    net = linear(dtype=torch.float64)
    fed = make_fed(net, data, rounds=4, clients_per_round=4, local_steps=1, batch_size=64, lr=0.5)
    run_rounds(fed, 4)

    ref = full_batch_gd(linear(dtype=torch.float64), data.x, data.y, lr=0.5, steps=4)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_uniform_weighting_is_plain_mean() -> None:
    """weighting=uniform: w' = (1/m) sum_i w_i (full batch, K=1, float64)."""
    sizes = [3, 11]
    data = toy_data(sizes, dtype=torch.float64)
    net = linear(dtype=torch.float64)
    w0 = params(net)
    fed = make_fed(net, data, clients_per_round=2, local_steps=1, batch_size=64, lr=0.3, weighting="uniform")
    run_rounds(fed, 1)
    grads = []
    for idx in data.client_indices:
        ref = linear(dtype=torch.float64)
        F.cross_entropy(ref(data.x[idx]), data.y[idx]).backward()
        grads.append([p.grad for p in ref.parameters()])
    for k, p in enumerate(net.parameters()):
        expected = w0[k] - 0.3 * (grads[0][k] + grads[1][k]) / 2
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-12)


class _Recorder(FederatedCallback):
    """Records every client's local model (after training) and its weight."""

    def __init__(self) -> None:
        self.local: dict[int, list[torch.Tensor]] = {}
        self.weights: dict[int, float] = {}

    def on_client_end(self, fed, client) -> None:
        self.local[client.cid] = [p.detach().clone() for p in fed.params]
        self.weights[client.cid] = client.weight


def _dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


def test_client_result_depends_only_on_seed_round_client() -> None:
    """A client's local model is the same whatever other clients trained before it (dropout included)."""
    data = toy_data([20, 20, 20, 20])
    kw = dict(clients_per_round=4, local_steps=3, batch_size=4, lr=0.1)
    rec_a, rec_b = _Recorder(), _Recorder()
    fed_a = make_fed(_dropout_net(), data, parts=[rec_a], **kw)
    fed_b = make_fed(_dropout_net(), data, parts=[rec_b], **kw)
    for fed, order in ((fed_a, [0, 1, 2, 3]), (fed_b, [3, 1, 0, 2])):
        fed.begin_round(0)
        for cid in order:
            fed.train_client(cid)
        fed.end_round()
    for cid in range(4):
        for a, b in zip(rec_a.local[cid], rec_b.local[cid]):
            assert torch.equal(a, b)
    for a, b in zip(fed_a.net.parameters(), fed_b.net.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_two_ranks_equal_one_rank() -> None:
    """Sharding over 2 ranks with a sum-reduce gives the 1-rank global model (allclose 1e-5).

    The two ranks run one after the other; the collective is simulated by summing their flat buffers.
    """
    data = toy_data([7, 12, 30, 4, 19, 25])
    kw = dict(clients_per_round=5, local_steps=4, batch_size=5, lr=0.2, seed=1)
    single = make_fed(_dropout_net(), data, **kw)
    run_rounds(single, 3)

    buffers: dict[int, torch.Tensor] = {}

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        return sum(buffers.values())

    ranks = [make_fed(_dropout_net(), data, rank=r, world_size=2, reduce_sum=reduce_sum, **kw) for r in (0, 1)]
    for r in range(3):
        shards = [fed.begin_round(r).shard for fed in ranks]
        assert sorted(shards[0] + shards[1]) == list(ranks[0].rnd.cohort)
        for k, fed in enumerate(ranks):
            for cid in shards[k]:
                fed.train_client(cid)
            buffers[k] = fed.aggregator._flat.clone()
        for fed in ranks:
            fed.end_round()
    for fed in ranks:
        for a, b in zip(fed.net.parameters(), single.net.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_client_weight_is_sample_count_times_multiplicity() -> None:
    class Twice(FederatedCallback):
        def sample_clients(self, fed, round_idx, rng):
            return [1, 1, 2]

    rec = _Recorder()
    fed = make_fed(linear(), toy_data([4, 6, 9]), parts=[Twice(), rec], clients_per_round=2)
    run_rounds(fed, 1)
    assert fed.rnd.cohort == (1, 2) and tuple(fed.rnd.draws[c] for c in fed.rnd.cohort) == (2, 1)
    assert rec.weights == {1: 12.0, 2: 9.0}


def test_local_steps_from_epochs() -> None:
    fed = make_fed(linear(), toy_data([10, 21]), clients_per_round=2, local_epochs=2, batch_size=4)
    assert [fed.client_steps(0), fed.client_steps(1)] == [2 * 3, 2 * 6]


def test_local_batches_cover_each_sample_once_per_pass() -> None:
    idx = torch.arange(100, 123)
    g = torch.Generator().manual_seed(0)
    batches = list(local_batches(idx, 5, 10, g))  # 5 batches per pass (23 = 4*5 + 3), two passes
    assert len(batches) == 10 and [len(b) for b in batches] == [5, 5, 5, 5, 3] * 2
    for p in (0, 1):
        assert torch.equal(torch.cat(batches[5 * p : 5 * p + 5]).sort().values, idx)
    assert not torch.equal(torch.cat(batches[:5]), torch.cat(batches[5:]))  # reshuffled


def test_uniform_cohort_is_seeded_and_without_replacement() -> None:
    a = uniform_cohort(50, 10, np.random.default_rng(derive_seed(0, 3, 90)))
    b = uniform_cohort(50, 10, np.random.default_rng(derive_seed(0, 3, 90)))
    c = uniform_cohort(50, 10, np.random.default_rng(derive_seed(0, 4, 90)))
    assert a == b and a != c and len(set(a)) == 10 and all(0 <= x < 50 for x in a)


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_shard_greedy_partitions_and_balances(world: int) -> None:
    rng = np.random.default_rng(world)
    cids = list(rng.choice(1000, size=20, replace=False))
    sizes = list(rng.integers(1, 200, size=20))
    shards = shard_greedy(cids, sizes, world)
    assert sorted(c for s in shards for c in s) == sorted(cids)
    load = {c: s for c, s in zip(cids, sizes)}
    loads = [sum(load[c] for c in s) for s in shards]
    assert max(loads) - min(loads) <= max(sizes)  # LPT: the gap is at most one client
    assert shards == shard_greedy(list(reversed(cids)), list(reversed(sizes)), world)  # order-free


def test_derive_seed_streams_differ() -> None:
    seeds = {derive_seed(0, r, c) for r in range(20) for c in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**63 for s in seeds)


class _FixedRows(FederatedCallback):
    """Test part: every local step uses the given rows (or defers with None)."""

    def __init__(self, rows: torch.Tensor | None) -> None:
        self.rows = rows

    def sample_batch(self, fed, client):
        return self.rows


def test_sample_batch_hook_sets_the_minibatch() -> None:
    """With rows R at every step, K local steps are K full-batch GD steps on R (one client, float64)."""
    data = toy_data([12], dtype=torch.float64)
    rows = torch.tensor([0, 3, 5, 11])
    net = linear(dtype=torch.float64)
    run_rounds(make_fed(net, data, parts=[_FixedRows(rows)], clients_per_round=1, local_steps=3, lr=0.4), 1)
    ref = full_batch_gd(linear(dtype=torch.float64), data.x[rows], data.y[rows], lr=0.4, steps=3)
    for a, b in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_sample_batch_deferring_keeps_the_default_stream() -> None:
    data = toy_data([9, 14])
    kw = dict(clients_per_round=2, local_steps=4, batch_size=4, lr=0.1)
    plain, deferring = make_fed(linear(), data, **kw), make_fed(linear(), data, parts=[_FixedRows(None)], **kw)
    run_rounds(plain, 2)
    run_rounds(deferring, 2)
    for a, b in zip(plain.net.parameters(), deferring.net.parameters()):
        assert torch.equal(a, b)


class _Draws(FederatedCallback):
    """Test part: a fixed cohort every round (repeats allowed)."""

    def __init__(self, cohort: list[int]) -> None:
        self.cohort = cohort

    def sample_clients(self, fed, round_idx, rng):
        return self.cohort


class _Runs(FederatedCallback):
    """Records every local run's model, weight, the draws it stands for and copy index, in training order."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, int, float, list[torch.Tensor]]] = []

    def on_client_end(self, fed, client) -> None:
        local = [p.detach().clone() for p in fed.params]
        self.runs.append((client.cid, client.copy, client.stands_for, client.weight, local))


def _local_sgd(data, cid: int, seed: int, lr: float, steps: int, batch: int) -> list[torch.Tensor]:
    """A client's local run written out: K minibatch SGD steps from w^0 = linear(float64), the minibatch order a
    fresh permutation of its rows per pass from a generator seeded with ``seed``."""
    net = linear(dtype=torch.float64)
    idx, g, done = data.client_indices[cid], torch.Generator().manual_seed(seed), 0
    while done < steps:
        for b in idx[torch.randperm(len(idx), generator=g)].split(batch):
            if done == steps:
                break
            net.zero_grad()
            F.cross_entropy(net(data.x[b]), data.y[b]).backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= lr * p.grad
            done += 1
    return [p.detach() for p in net.parameters()]


REPEAT_KW = dict(clients_per_round=3, local_steps=3, batch_size=2, lr=0.3, seed=4)


def test_repeat_trains_each_draw_as_an_independent_local_run() -> None:
    """duplicates=repeat, cohort draws (1, 1, 2), p_i = n_i: client 1 runs twice from w^0, copy 0 seeded with
    (seed, 0, 1), copy 1 with (seed, 0, 1, 1), each weight n_1 (one draw), so

        w^1 = (n_1 w_1^(0) + n_1 w_1^(1) + n_2 w_2) / (2 n_1 + n_2),

    with every local run written out by hand (float64). The two copies differ (other minibatches)."""
    data = toy_data([4, 6, 9], dtype=torch.float64)
    rec = _Runs()
    net = linear(dtype=torch.float64)
    fed = make_fed(net, data, parts=[_Draws([1, 2, 1]), rec], duplicates="repeat", **REPEAT_KW)
    run_rounds(fed, 1)
    assert (
        fed.rnd.cohort == (1, 2)
        and tuple(fed.rnd.draws[c] for c in fed.rnd.cohort) == (2, 1)
        and fed.rnd.shard == (1, 1, 2)
    )
    assert [(c, j, d, w) for c, j, d, w, _ in rec.runs] == [(1, 0, 1, 6.0), (1, 1, 1, 6.0), (2, 0, 1, 9.0)]
    s = REPEAT_KW["seed"]
    w1a, w1b = (_local_sgd(data, 1, seed, 0.3, 3, 2) for seed in (derive_seed(s, 0, 1), derive_seed(s, 0, 1, 1)))
    w2 = _local_sgd(data, 2, derive_seed(s, 0, 2), 0.3, 3, 2)
    for k, p in enumerate(net.parameters()):
        torch.testing.assert_close(rec.runs[0][4][k], w1a[k], rtol=0, atol=1e-12)
        torch.testing.assert_close(rec.runs[1][4][k], w1b[k], rtol=0, atol=1e-12)
        expected = (6 * w1a[k] + 6 * w1b[k] + 9 * w2[k]) / (2 * 6 + 9)
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-12)
    assert not torch.allclose(w1a[0], w1b[0])


class _DoubleWeight(FederatedCallback):
    def on_client_start(self, fed, client) -> None:
        client.weight *= 2 if client.cid == 1 else 1


# the model after 2 rounds of cohort (1, 1, 2), multiplicity, REPEAT_KW, computed by the code before algo.duplicates
# existed (first 4 entries and the sum, as float.hex): the default path must stay what it was, to a few ulps (the
# values were bitwise these on the CPU they were made on; an AVX-512 CPU's fp64 kernels round differently, ~1e-17)
PINNED = ["-0x1.c2dd42712cdc1p-7", "0x1.137b92f72bd53p-2", "-0x1.9e2f0839656dfp-2", "-0x1.62f04d0cfaaa0p-1"]
PINNED_SUM = "-0x1.83f3b07e00002p-1"


def test_multiplicity_is_one_run_with_k_times_the_weight_and_is_the_default() -> None:
    """duplicates=multiplicity (the default): client 1 drawn twice trains once (copy 0, stands_for = 2, weight 2 n_1);
    the model is the one of the code before the option existed (to a few ulps across CPUs), and equals (to rounding:
    the pre-divided weights differ) the cohort (1, 2) with client 1's weight doubled by hand."""
    data = toy_data([4, 6, 9], dtype=torch.float64)
    rec, nets = _Runs(), {}
    for name, parts, extra in (
        ("default", [_Draws([1, 2, 1]), rec], {}),
        ("explicit", [_Draws([1, 2, 1])], {"duplicates": "multiplicity"}),
        ("doubled", [_Draws([1, 2]), _DoubleWeight()], {}),
    ):
        nets[name] = linear(dtype=torch.float64)
        run_rounds(make_fed(nets[name], data, parts=parts, **extra, **REPEAT_KW), 2)
    for a, b, c in zip(*(nets[k].parameters() for k in ("default", "explicit", "doubled"))):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=0, atol=1e-14)
    flat = torch.cat([p.detach().flatten() for p in nets["default"].parameters()])
    pinned = torch.tensor([float.fromhex(v) for v in [*PINNED, PINNED_SUM]], dtype=torch.float64)
    torch.testing.assert_close(torch.cat([flat[:4], flat.sum()[None]]), pinned, rtol=1e-14, atol=0)
    assert [(c, j, d, w) for c, j, d, w, _ in rec.runs[:2]] == [(1, 0, 2, 12.0), (2, 0, 1, 9.0)]


def test_a_client_drawn_once_trains_bitwise_alike_in_both_modes() -> None:
    """k = 1 keeps the 3-word seed: with distinct cohorts the runs are bitwise equal in both modes (dropout
    included), and in cohort (1, 1, 2) client 2's run and client 1's copy 0 equal their multiplicity runs."""
    data = toy_data([20, 20, 20, 20])
    kw = dict(clients_per_round=3, local_steps=3, batch_size=4, lr=0.1, seed=2)
    a, b = make_fed(_dropout_net(), data, **kw), make_fed(_dropout_net(), data, duplicates="repeat", **kw)
    run_rounds(a, 3)
    run_rounds(b, 3)
    for p, q in zip(a.net.parameters(), b.net.parameters()):
        assert torch.equal(p, q)
    recs = {mode: _Runs() for mode in ("multiplicity", "repeat")}
    for mode, rec in recs.items():
        run_rounds(make_fed(_dropout_net(), data, parts=[_Draws([1, 2, 1]), rec], duplicates=mode, **kw), 1)
    first = {(c, j): local for c, j, _, _, local in recs["repeat"].runs}
    for cid, _, _, _, local in recs["multiplicity"].runs:
        assert all(torch.equal(p, q) for p, q in zip(local, first[(cid, 0)]))


def test_repeat_on_two_ranks_equals_one_rank() -> None:
    """Cohort (0, 0, 0, 1) under repeat: the copies of client 0 spread over both ranks (LPT, numbered in rank
    order), each copy keeps its seed wherever it runs, so the 2-rank model equals the 1-rank one (allclose 1e-5)."""
    data = toy_data([10, 10, 10])
    kw = dict(duplicates="repeat", local_steps=3, batch_size=3, lr=0.2, clients_per_round=4)
    recs = [_Runs() for _ in range(3)]
    single = make_fed(_dropout_net(), data, parts=[_Draws([0, 0, 1, 0]), recs[0]], **kw)
    run_rounds(single, 2)
    buffers: dict[int, torch.Tensor] = {}
    ranks = [
        make_fed(
            _dropout_net(),
            data,
            parts=[_Draws([0, 0, 1, 0]), recs[1 + r]],
            rank=r,
            world_size=2,
            reduce_sum=lambda t: sum(buffers.values()),
            **kw,
        )
        for r in (0, 1)
    ]
    for r in range(2):
        shards = [fed.begin_round(r).shard for fed in ranks]
        assert shards == [(0, 0), (0, 1)] and all(fed.rnd.slots == 2 for fed in ranks)
        for k, fed in enumerate(ranks):
            for cid in shards[k]:
                fed.train_client(cid)
            buffers[k] = fed.aggregator._flat.clone()
        for fed in ranks:
            fed.end_round()
    assert [(c, j) for c, j, *_ in recs[1].runs[:2]] == [(0, 0), (0, 1)]
    assert [(c, j) for c, j, *_ in recs[2].runs[:2]] == [(0, 2), (1, 0)]
    for fed in ranks:
        for a, b in zip(fed.net.parameters(), single.net.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


class _Visits(FederatedCallback):
    def on_client_end(self, fed, client) -> None:
        client.state["visits"] = client.state.get("visits", torch.zeros(())) + 1


def test_repeated_copies_start_from_the_round_start_client_state() -> None:
    """Per-client state under repeat: every copy loads the state stored before the round (copy 0's update does not
    leak into copy 1), so a client's runs do not depend on which rank trains which copy."""
    rec = _Visits()
    fed = make_fed(
        linear(),
        toy_data([4, 6]),
        parts=[_Draws([0, 0, 1]), rec],
        duplicates="repeat",
        clients_per_round=3,
        local_steps=1,
    )
    run_rounds(fed, 2)
    assert float(fed.store.get(0)["visits"]) == 2 and float(fed.store.get(1)["visits"]) == 2


def test_cohort_is_the_last_rounds_distinct_sample() -> None:
    """``fed.cohort``: empty before a round, then the distinct clients of the round being trained or last trained
    (what the per-client tables mark as sampled), a draw with repeats counted once."""

    class Repeats(FederatedCallback):
        def sample_clients(self, fed, round_idx, rng):
            return [3, 1, 3]

    fed = make_fed(linear(), toy_data([4, 5, 6, 7]), clients_per_round=2, local_steps=1)
    assert fed.cohort == ()
    for r in range(2):
        run_rounds(fed, 1, start=r)
        assert fed.cohort == tuple(sorted(fed.sample(r))) and len(fed.cohort) == 2
    fed = make_fed(linear(), toy_data([4, 5, 6, 7]), [Repeats()], clients_per_round=3, local_steps=1)
    fed.begin_round(0)
    assert fed.cohort == (1, 3)


def test_derive_seeds_equals_derive_seed_bit_for_bit() -> None:
    """The vectorised seeds of a round's clients are numpy's SeedSequence seeds exactly: run seeds of one and two
    32-bit words, round 0 and large, client 0 and ids up to 2**32 - 1, with and without a copy word (5 words: more
    than SeedSequence's pool of 4, its second mixing loop)."""
    rng = np.random.default_rng(0)
    cids = np.concatenate([[0, 1, 2**32 - 1], rng.integers(0, 2**32, 40)])
    for seed in (0, 7, 2**40 + 5, 2**63 - 1):
        for rnd in (0, 3, 10**6):
            for n in (len(cids), NUMPY_FROM, NUMPY_FROM - 1, 1):  # numpy's path, and one SeedSequence each
                some = cids[:n]
                assert derive_seeds(seed, rnd, some).tolist() == [derive_seed(seed, rnd, int(c)) for c in some]
                assert derive_seeds(seed, rnd, some, 2).tolist() == [derive_seed(seed, rnd, int(c), 2) for c in some]
    assert derive_seeds(1, 2, np.array([], dtype=np.int64)).tolist() == []
    with pytest.raises(ValueError, match="2\\*\\*32"):
        derive_seeds(0, 0, np.array([2**32]))
    with pytest.raises(ValueError, match="2\\*\\*32"):
        derive_seeds(0, 0, np.array([-1, 3]))


@pytest.mark.parametrize(("steps", "epochs", "expected"), [(3, None, ((0, 2), (1, 3))), (None, 1, ((0,), (1, 2, 3)))])
def test_shards_balance_the_expected_cost(steps: int | None, epochs: int | None, expected: tuple) -> None:
    """Clients of 60, 8, 8 and 8 rows, B=4, 2 ranks. With K=3 local steps every client processes 3 * 4 rows, so the
    shards hold two clients each (by sample count the 60-row client would sit alone); with one local epoch the costs
    are 60, 8, 8, 8 rows and the big client is alone. ``expected_cost`` is ``K_i * min(B, n_i)``."""
    data = toy_data([60, 8, 8, 8])
    kw = dict(clients_per_round=4, local_steps=steps or 1, local_epochs=epochs, batch_size=4, seed=0)
    ranks = [make_fed(linear(), data, rank=r, world_size=2, **kw) for r in (0, 1)]
    assert [ranks[0].expected_cost(c) for c in range(4)] == ([12] * 4 if steps else [60, 8, 8, 8])
    assert tuple(fed.begin_round(0).shard for fed in ranks) == expected
