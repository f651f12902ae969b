"""Faulty clients and clients with tiny or odd data: the documented policy of each case (no Lightning, fast).

Policies (``FederationConfig.fault_policy``, ``single_row_batch``; docs/round_protocol.md):

* a client whose loss or update is not finite is dropped from the round (``drop``): the aggregate is the weighted
  mean of the other clients, its state is not stored, and it is counted in ``fed.faults.dropped``; ``stop`` raises
  :class:`ClientFault` naming the round and the client;
* every client of a round dropped, or a non-finite global model after the server step: :class:`Diverged`;
* a client without rows is skipped (counted in ``fed.faults.skipped``); a round where every client is skipped keeps
  the global model;
* with BatchNorm (``single_row_batch=auto``) a pass's last minibatch of one row is left out, and a client with one
  row is skipped; without BatchNorm nothing changes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, params, run_rounds, toy_data
from torch import nn

from flx.datamodules.datamodule import ClientStore
from flx.faults import ClientFault, Diverged, DivergenceWatch, RoundFaults, all_finite, distance, optimizer_cause
from flx.federation import Federation, FederationConfig
from flx.hooks import FederatedCallback
from flx.sampling import derive_seed, local_batches
from flx.server import ServerOptConfig, ServerOptimizer


class PoisonClient(FederatedCallback):
    """Test part: makes client ``cid``'s local model NaN (or its loss, with ``where="loss"``) in every round."""

    def __init__(self, cid: int, where: str = "update") -> None:
        self.cid, self.where = cid, where

    def local_loss(self, fed, client, loss):
        return loss * float("nan") if self.where == "loss" and client.cid == self.cid else loss

    def on_client_end(self, fed, client) -> None:
        if self.where == "update" and client.cid == self.cid:
            with torch.no_grad():
                fed.params[0][0, 0] = float("nan")
        client.state["seen"] = torch.ones(())


def _fedavg_without(sizes: list[int], left_out: int, **cfg) -> list[torch.Tensor]:
    """The reference: the same round where client ``left_out`` holds no rows (so it adds nothing)."""
    data = toy_data(sizes)
    kept = [idx if c != left_out else idx[:0] for c, idx in enumerate(data.client_indices)]
    fed = make_fed(linear(), ClientStore(data.x, data.y, kept), **cfg)
    run_rounds(fed, 1)
    return params(fed.net)


@pytest.mark.parametrize("where", ["update", "loss"])
def test_a_nan_client_is_dropped_and_the_rest_is_averaged(where: str) -> None:
    """drop: w' = sum_{i != bad} n_i w_i / sum_{i != bad} n_i, i.e. the round without the bad client, bitwise;
    the bad client's state is not stored and the drop is counted."""
    cfg = dict(clients_per_round=3, local_steps=3, batch_size=4, lr=0.1)
    fed = make_fed(linear(), toy_data([6, 8, 7]), parts=[PoisonClient(1, where)], **cfg)
    run_rounds(fed, 1)
    assert fed.faults == RoundFaults(dropped=(1,), skipped=())
    expected = _fedavg_without([6, 8, 7], 1, **cfg)
    for a, b in zip(params(fed.net), expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the weight scale differs: 1/21 vs 1/13
    assert sorted(fed.store.client_ids()) == [0, 2]


def test_stop_policy_names_round_and_client() -> None:
    fed = make_fed(linear(), toy_data([6, 8, 7]), parts=[PoisonClient(2)], clients_per_round=3, fault_policy="stop")
    with pytest.raises(ClientFault, match=r"round 1: client 2 .*fault.policy=stop"):
        run_rounds(fed, 1)


def test_every_client_dropped_is_divergence_and_the_model_is_kept() -> None:
    """A cohort where every update is NaN stops the run; the global model of the last finite round is unchanged."""
    fed = make_fed(linear(), toy_data([6]), parts=[PoisonClient(0)], clients_per_round=1)
    before = params(fed.net)
    with pytest.raises(Diverged, match=r"diverged in round 1: every client.*lower algo.lr"):
        run_rounds(fed, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, fed.global_params))


def test_huge_learning_rate_diverges() -> None:
    """lr = 1e8: within a few rounds every client's update overflows; the run stops as diverged, never ends with a
    NaN model."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    fed = make_fed(mlp, toy_data([20, 20]), clients_per_round=2, local_steps=10, lr=1e8, batch_size=4)
    with pytest.raises(Diverged, match="lower algo.lr"):
        run_rounds(fed, 20)


def test_server_step_to_infinity_diverges() -> None:
    """A finite mean but a server step that overflows (FedAvgM, huge server lr): the global model check stops it."""
    from flx.server import ServerOptConfig

    server = ServerOptConfig(lr=3e38)  # eta_s * Delta overflows float32 (max 3.4e38) once |Delta| > 1.2
    fed = make_fed(linear(), toy_data([20, 20]), clients_per_round=2, lr=5.0, server=server)
    with pytest.raises(Diverged, match=r"global model is not finite.*algo.server.lr"):
        run_rounds(fed, 5)


class Cohort(FederatedCallback):
    """Test part: a fixed cohort."""

    def __init__(self, cohort: list[int]) -> None:
        self.cohort = cohort

    def sample_clients(self, fed, round_idx, rng):
        return self.cohort


def test_empty_clients_are_skipped_and_counted() -> None:
    """An empty client adds nothing: the round equals the round of the other clients alone, bitwise (its weight
    n_i = 0 changes neither the weights nor the weight scale); a round of only empty clients keeps the model."""
    data = toy_data([5, 3, 4])
    rows = [data.client_indices[0], data.client_indices[1][:0], data.client_indices[2]]
    cfg = dict(clients_per_round=3, local_steps=2, batch_size=2, lr=0.1)
    fed = make_fed(linear(), ClientStore(data.x, data.y, rows), **cfg)
    run_rounds(fed, 1)
    assert fed.faults == RoundFaults(dropped=(), skipped=(1,))
    ref = make_fed(linear(), data, parts=[Cohort([0, 2])], **cfg)
    run_rounds(ref, 1)
    assert all(torch.equal(a, b) for a, b in zip(params(fed.net), params(ref.net)))
    empty = make_fed(linear(), ClientStore(data.x, data.y, [rows[1]]), clients_per_round=1)
    before = params(empty.net)
    run_rounds(empty, 2)
    assert empty.faults.skipped == (0,) and all(torch.equal(a, b) for a, b in zip(before, params(empty.net)))


def test_single_row_batches_are_dropped_only_with_batchnorm() -> None:
    """local_batches with min_rows=2: a pass of 5 rows in batches of 2 gives (2, 2) and the next pass, never a
    batch of 1; min_rows=1 keeps the (2, 2, 1) of before."""
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    idx = torch.arange(5)
    assert [len(b) for b in local_batches(idx, 2, 5, g1, min_rows=2)] == [2, 2, 2, 2, 2]
    assert [len(b) for b in local_batches(idx, 2, 5, g2, min_rows=1)] == [2, 2, 1, 2, 2]
    with pytest.raises(ValueError, match="min_rows"):
        next(local_batches(idx[:1], 2, 1, g1, min_rows=2))


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))


def test_batchnorm_with_a_one_row_client_and_odd_sizes() -> None:
    """BatchNorm net: a client of one row is skipped; 5 rows in batches of 2 never hit BatchNorm with one row
    (which raises in train mode); fewer rows than the batch size train on all the rows. No traceback."""
    data = toy_data([1, 5, 3])
    fed = make_fed(_bn_net(), data, clients_per_round=3, local_steps=4, batch_size=2)
    run_rounds(fed, 2)
    assert fed.faults.skipped == (0,) and fed.faults.dropped == ()
    big = make_fed(_bn_net(), toy_data([3]), clients_per_round=1, local_steps=2, batch_size=32)
    run_rounds(big, 1)  # one batch of all 3 rows per step
    keep = make_fed(_bn_net(), toy_data([5]), clients_per_round=1, local_steps=3, batch_size=2, single_row_batch="keep")
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        run_rounds(keep, 1)


def test_a_linear_net_keeps_single_row_batches() -> None:
    """Without BatchNorm (auto) the batches are those of before, so every earlier result holds bitwise."""
    data = toy_data([5])
    fed = make_fed(linear(), data, clients_per_round=1, local_steps=3, batch_size=2, lr=0.1)
    assert fed.min_rows == 1
    run_rounds(fed, 1)
    ref = linear()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(derive_seed(0, 0, 0))
    for b in torch.randperm(5, generator=g).split(2):  # batches of 2, 2 and 1 rows
        opt.zero_grad()
        F.cross_entropy(ref(data.x[b]), data.y[b]).backward()
        opt.step()
    for a, b in zip(fed.net.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_two_ranks_agree_on_the_dropped_clients() -> None:
    """On 2 ranks the drop counters ride in the round's one reduce and the ids are gathered only then: both ranks
    see the same RoundFaults and the 1-rank global model (allclose 1e-6). The collectives are simulated."""
    data = toy_data([7, 12, 30, 4, 19, 25])
    kw = dict(clients_per_round=6, local_steps=3, batch_size=5, lr=0.2)
    single = make_fed(linear(), data, parts=[PoisonClient(3)], **kw)
    run_rounds(single, 2)
    buffers: dict[int, torch.Tensor] = {}
    ranks: list = []

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        return sum(buffers.values())

    def gather(obj: object) -> list:  # every rank's object of the same call: the left-out ids or the state updates
        if isinstance(obj, dict) and set(obj) == {"dropped", "skipped"}:
            return [fed.rnd.left_out for fed in ranks]
        return [fed.rnd.state_updates for fed in ranks]

    for r in (0, 1):
        fed = make_fed(linear(), data, parts=[PoisonClient(3)], rank=r, world_size=2, reduce_sum=reduce_sum, **kw)
        fed.gather = gather
        ranks.append(fed)
    for t in range(2):
        for k, fed in enumerate(ranks):
            for cid in fed.begin_round(t).shard:
                fed.train_client(cid)
            buffers[k] = fed.aggregator._flat.clone()
        for fed in ranks:
            fed.end_round()
    assert ranks[0].faults == ranks[1].faults == single.faults == RoundFaults(dropped=(3,), skipped=())
    for fed in ranks:
        for a, b in zip(fed.net.parameters(), single.net.parameters()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_finds_any_bad_entry(dtype: torch.dtype) -> None:
    """One NaN, +inf or -inf anywhere among 10**5 entries is found, also +inf and -inf in two tensors (their sums would
    cancel to NaN, never to a finite number); large finite half-precision values (whose fp16 sum would overflow) are
    finite: the sums run in fp32 at least."""
    big = torch.full((100, 1000), 60000.0 if dtype == torch.float16 else 1.0, dtype=dtype)
    assert all_finite([big, torch.ones(3, dtype=dtype)]) and all_finite([])
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = big.clone()
        t[37, 411] = bad
        assert not all_finite([torch.ones(3, dtype=dtype), t])
    plus, minus = torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=dtype)
    plus[0], minus[1] = float("inf"), -float("inf")
    assert not all_finite([plus, minus])


# --- the finite-divergence rule (fault.diverge_factor, fault.diverge_rounds) ------------------------------------------


def _fires_at(losses: list[float | None], reference: float = 2.0, factor: float = 10.0, rounds: int = 2) -> int | None:
    """The 1-based round at which :class:`DivergenceWatch` stops on ``losses`` (None: it never does)."""
    watch = DivergenceWatch(factor, rounds)
    watch.set_reference(reference)
    for r, loss in enumerate(losses, start=1):
        try:
            watch.observe(r, loss, lambda first: "lower algo.lr (now 3)")
        except Diverged:
            return r
    return None


@pytest.mark.parametrize(
    ("losses", "expected"),
    [
        ([1.9, 25.0, 25.0], 3),  # above c L_0 = 20 in rounds 2 and 3
        ([1e7, 2e7, 1.9], 2),  # a blow-up inside round 1 counts from round 1
        ([25.0, 19.0, 25.0, 1.0, 25.0], None),  # never twice in a row
        ([25.0, 20.0, 25.0], None),  # exactly c L_0 is not above it
        ([25.0, None, 25.0], 3),  # a round without aggregated clients leaves the count as it is
        ([0.5] * 50, None),
    ],
)
def test_divergence_rule_fires_exactly_after_r_rounds_above_c_times_the_initial_loss(losses, expected) -> None:
    """Stop at round t iff L_s > c L_0 for s = t-r+1..t (c = 10, r = 2, L_0 = 2 here)."""
    assert _fires_at(losses) == expected


def test_divergence_rule_variants_and_switches() -> None:
    """r = 1 stops at the first round above; factor None (fault.diverge_factor=null) and an initial loss that is not
    a finite number > 0 switch the rule off."""
    assert _fires_at([1.0, 21.0], rounds=1) == 2
    assert _fires_at([1e30] * 10, factor=None) is None
    assert _fires_at([1e30] * 10, reference=0.0) is None
    assert _fires_at([1e30] * 10, reference=float("nan")) is None


def test_divergence_message_names_round_value_rule_and_knob() -> None:
    watch = DivergenceWatch(100.0, 2)
    watch.set_reference(2.302)
    watch.observe(1, 3.9e7, lambda first: f"lower algo.lr (now 3) since {first}")
    with pytest.raises(Diverged) as err:
        watch.observe(2, 5.2e7, lambda first: f"lower algo.lr (now 3) since {first}")
    assert str(err.value) == (
        "diverged in round 2: train/loss 5.2e+07 above 100 x the initial loss 2.302 for 2 round(s) in a row "
        "(fault.diverge_factor, fault.diverge_rounds; null switches the rule off); lower algo.lr (now 3) since 1"
    )


def test_divergence_state_resumes_mid_streak() -> None:
    """The initial loss and the count are checkpointed: a run resumed after one round above stops one round later,
    as the uninterrupted run does."""
    first = DivergenceWatch(10.0, 3)
    first.set_reference(2.0)
    first.observe(1, 30.0, str)
    resumed = DivergenceWatch(10.0, 3)
    resumed.load_state_dict(first.state_dict())
    assert not resumed.needs_reference()
    resumed.observe(2, 30.0, str)
    with pytest.raises(Diverged, match="round 3"):
        resumed.observe(3, 30.0, str)


def test_optimizer_cause_names_the_key_the_measurement_points_to() -> None:
    """Amplification ``a`` at most 1: the clients (algo.lr). Above 1: SGD names algo.server.lr when lr > 1 and
    algo.server.momentum when ``a / lr`` > 1 (``||v_t|| > ||Delta_t||``); FedAdam names algo.server.lr, and
    algo.server.eps when the effective denominator is within 2 eps (second moment ~0)."""
    moved = "the server step moved the global model {} x the clients' mean update"
    cfg = FederationConfig(lr=3.0, server=ServerOptConfig(lr=4.0, momentum=0.9))
    assert optimizer_cause(cfg, 1.0) == f"lower algo.lr (now 3): {moved.format(1)}, no farther"
    assert optimizer_cause(cfg, 0.01) == f"lower algo.lr (now 3): {moved.format(0.01)}, no farther"
    assert (
        optimizer_cause(cfg, 6.0)
        == f"lower algo.server.momentum (now 0.9) or algo.server.lr (now 4): {moved.format(6)}"
    )
    assert optimizer_cause(cfg, 2.0) == f"lower algo.server.lr (now 4): {moved.format(2)}"  # 2 / 4: v_t shorter
    cfg = FederationConfig(server=ServerOptConfig(lr=0.5, momentum=0.99))
    assert optimizer_cause(cfg, 30.0) == f"lower algo.server.momentum (now 0.99): {moved.format(30)}"
    cfg = FederationConfig(server=ServerOptConfig(name="adam", lr=1e8, eps=1e-3))
    assert optimizer_cause(cfg, 7.5e9, 0.0015) == (
        f"lower algo.server.lr (now 1e+08) or raise algo.server.eps (now 0.001): {moved.format('7.5e+09')}, its "
        "adaptive denominator 0.0015 at eps (second moment ~0: steps ~ lr / eps)"
    )
    assert optimizer_cause(cfg, 7.5e9, 0.05) == f"lower algo.server.lr (now 1e+08): {moved.format('7.5e+09')}"
    for name in ("adagrad", "yogi"):  # the other adaptive steps of Algorithm 2: the same keys
        adaptive = FederationConfig(server=ServerOptConfig(name=name, lr=1e8, eps=1e-3))
        assert optimizer_cause(adaptive, 7.5e9, 0.0015) == optimizer_cause(cfg, 7.5e9, 0.0015)
    inf, nan = float("inf"), float("nan")
    assert (
        optimizer_cause(cfg, inf)
        == optimizer_cause(cfg, inf, nan)
        == f"lower algo.server.lr (now 1e+08): {moved.format(inf)}"
    )
    assert optimizer_cause(cfg, nan).startswith("lower algo.server.lr (now 1e+08): ")


def test_distance_is_the_norm_of_the_difference() -> None:
    a, b = [torch.tensor([3.0, 1.0]), torch.tensor([[2.0]])], [torch.tensor([0.0, 1.0]), torch.tensor([[-2.0]])]
    assert float(distance(a, b)) == pytest.approx(5.0) and float(distance([], [])) == 0.0
    wide = distance([t.double() for t in a], b)  # a float64 model keeps float64
    assert wide.dtype == torch.float64 and float(wide) == 5.0


def test_server_amplification_closed_forms() -> None:
    """||w_{t+1} - w_t|| / ||Delta||: 1 for plain averaging; eta_s for SGD without momentum; for FedAdam's first step
    on one scalar, eta_s (1 - b1) / (sqrt(1 - b2) |Delta| + tau) (m = (1 - b1) Delta, v = (1 - b2) Delta^2), whose
    denominator eta_s |m| / |step| is sqrt(v) + tau."""
    delta = 0.5
    for cfg, expected in [
        (ServerOptConfig(), 1.0),
        (ServerOptConfig(lr=0.5), 0.5),
        (ServerOptConfig(lr=4.0), 4.0),
        (ServerOptConfig(name="adam", lr=0.01), 0.01 * 0.1 / (0.1 * delta + 1e-3)),
    ]:
        w = [torch.zeros((), dtype=torch.float64)]
        opt = ServerOptimizer(w, cfg)
        opt.step([torch.full((), delta, dtype=torch.float64)])
        assert opt.amplification == pytest.approx(expected, rel=1e-12)
        if cfg.name == "adam":  # the effective denominator is sqrt(v) + tau = 0.1 |Delta| + tau
            assert opt.moves.denominator == pytest.approx(0.1 * delta + 1e-3, rel=1e-12)
        else:
            assert math.isnan(opt.moves.denominator)
        assert ServerOptimizer(w, cfg).amplification == 1.0  # before any step
        resumed = ServerOptimizer(w, cfg)
        resumed.load_state_dict(opt.state_dict())
        assert resumed.amplification == opt.amplification


def _blow_up_fed(**cfg) -> Federation:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    return make_fed(mlp, toy_data([20, 20, 20]), clients_per_round=3, local_steps=10, batch_size=4, **cfg)


def _blow_up_run(**cfg) -> str:
    """The divergence message of a small MLP run with ``cfg`` (it must diverge within 10 rounds)."""
    with pytest.raises(Diverged) as err:
        run_rounds(_blow_up_fed(**cfg), 10)
    return str(err.value)


def test_fedadam_divergence_names_the_server_lr_or_the_client_lr_by_what_drove_it() -> None:
    """FedAdam with eta_s = 1e8 (clients fine): the server step drove it, the message names algo.server.lr; FedAdam
    with its default eta_s and a client lr of 50: the clients drove it, algo.lr."""
    server = _blow_up_run(lr=0.05, server=ServerOptConfig(name="adam", lr=1e8))
    assert "lower algo.server.lr (now 1e+08)" in server and "algo.lr" not in server.replace("algo.server.lr", "")
    clients = _blow_up_run(lr=50.0, server=ServerOptConfig(name="adam", lr=0.01))
    assert clients.endswith("lower algo.lr (now 50): the blow-up began in round 1, before any server step")


def test_finite_blow_up_with_plain_averaging_names_algo_lr_and_off_lets_it_run() -> None:
    """FedAvg (plain averaging can never outrun the clients) with a large client lr: the finite rule stops it,
    naming algo.lr; with the rule off the same run goes on (its loss stays finite)."""
    message = _blow_up_run(lr=50.0)
    assert message.startswith("diverged in round 2: train/loss ")
    assert message.endswith("lower algo.lr (now 50): the blow-up began in round 1, before any server step")
    fed = _blow_up_fed(lr=50.0, diverge_factor=None)
    run_rounds(fed, 10)
    assert fed.server.round == 10 and fed.divergence.reference is None
