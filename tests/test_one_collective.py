"""One collective per round: the shipped parts' per-round statistics ride in the round's single all-reduce.

Two ranks are simulated by two threads that take turns (one runs at a time, so the global RNG streams are as on
two processes) and meet at every collective; each collective is logged with the rank, the round and the phase. The
only other collectives are the core's: the client-state all-gather, in rounds where some client stored state
(FeDXL2's ``u`` tables, CODASCA's control variates, pFedMe's and Ditto's personal models, the local layers of FedPer,
FedRep, LG-FedAvg and FedBN), and ClientLoss's
evaluation reduce on validated rounds. FedMiD, FedDualAvg and pFedFBE add nothing to the round's one reduce.
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import binary_store, make_fed, run_rounds, toy_data
from torch import Tensor, nn

from flx.datamodules.datamodule import ClientStore
from flx.federation import Federation
from flx.hooks import FederatedCallback
from flx.models.scalable import ScalableCNN
from flx.parts.meta_learning.meta_update import MetaUpdate
from flx.parts.meta_learning.pm_regularizer import PMRegularizer
from flx.parts.personalisation.ditto import Ditto
from flx.parts.personalisation.fbe import FBE
from flx.parts.personalisation.fedbabu import FedBABU
from flx.parts.personalisation.fedbn import FedBN
from flx.parts.personalisation.fedper import FedPer
from flx.parts.personalisation.fedrep import FedRep
from flx.parts.personalisation.lg_fedavg import LGFedAvg
from flx.parts.personalisation.pfedme import PFedMe
from flx.parts.proximal.prox_step import DualAveraging, ProxStep
from flx.parts.robustness.client_loss import ClientLoss, client_train_losses
from flx.parts.robustness.lambda_sampling import LambdaSampling
from flx.parts.robustness.qffl import QFFL
from flx.parts.systems.subnetwork import MAX_LEVELS, Subnetwork
from flx.parts.xrisk.client_noise import ClientNoise
from flx.parts.xrisk.codasca import Codasca
from flx.parts.xrisk.passive_buffer import PassiveBuffer
from flx.resources import ServerResources
from flx.systems.simulator import LatencySimulator

ROUNDS, TIMEOUT_S = 3, 60.0


class Group:
    """``world`` simulated ranks as threads: rank ``r`` runs until its next collective, then rank ``r + 1`` does; the
    last rank to arrive combines the values and hands the turn back to rank 0."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.turn = [threading.Semaphore(0) for _ in range(world)]
        self.values: list[Any] = [None] * world
        self.kinds: list[str] = [""] * world
        self.result: Any = None
        self.where: list[tuple[int, str]] = [(-1, "setup")] * world  # (round, phase) each rank is in
        self.log: list[list[tuple[int, str, str]]] = [[] for _ in range(world)]  # (round, phase, kind) per rank

    def _wait(self, rank: int) -> None:
        if not self.turn[rank].acquire(timeout=TIMEOUT_S):
            raise TimeoutError(f"rank {rank}: the other ranks never reached the same collective")

    def collective(self, rank: int, kind: str, value: Any, combine: Callable[[list[Any]], Any]) -> Any:
        self.log[rank].append((*self.where[rank], kind))
        self.values[rank], self.kinds[rank] = value, kind
        if rank == self.world - 1:
            assert len(set(self.kinds)) == 1, f"ranks called different collectives: {self.kinds}"
            self.result = combine(self.values)
        self.turn[(rank + 1) % self.world].release()
        self._wait(rank)
        return copy.deepcopy(self.result)  # each rank gets its own copy, as from a real process group

    def reduce_sum(self, rank: int) -> Callable[[Tensor], Tensor]:
        return lambda t: self.collective(rank, "reduce", t.clone(), lambda ts: sum(ts[1:], ts[0]))

    def gather(self, rank: int) -> Callable[[Any], list[Any]]:
        return lambda obj: self.collective(rank, "gather", copy.deepcopy(obj), list)

    def broadcast(self, rank: int) -> Callable[[Any], Any]:
        return lambda obj: self.collective(rank, "broadcast", copy.deepcopy(obj), lambda objs: objs[0])

    def run(self, jobs: list[Callable[[], None]]) -> None:
        """Runs ``jobs[r]`` as rank ``r``; re-raises the first error."""
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                self._wait(rank)
                jobs[rank]()
            except BaseException as e:  # noqa: BLE001 -- re-raised in the main thread
                errors.append(e)
            if rank < self.world - 1:
                self.turn[rank + 1].release()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        self.turn[0].release()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]


def _net(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, out)).to(torch.float64)


L1 = {"name": "l1", "mu": 0.01, "params": ["*weight"]}
MULTICLASS = dict(clients_per_round=4, local_steps=3, lr=0.2, batch_size=4, seed=1)
BINARY = dict(clients_per_round=3, local_steps=3, lr=0.2, batch_size=4, weighting="uniform")

# name -> (parts, binary task, extra config, client-state gathers per round, evaluation reduces per round)
CASES: dict[str, tuple[Callable[[], list], bool, dict, int, int]] = {
    "fedavg": (lambda: [], False, {}, 0, 0),
    "drfa": (lambda: [LambdaSampling(gamma=0.3, eval_batch=3)], False, {"weighting": "uniform"}, 0, 0),
    "drfa_ga": (
        lambda: [LambdaSampling(gamma=0.3, mode="ga", regularizer="chi2", rho=0.5)],
        False,
        {"weighting": "uniform"},
        0,
        0,
    ),
    "afl": (lambda: [LambdaSampling(gamma=0.3)], False, {"weighting": "uniform", "local_steps": 1}, 0, 0),
    "qffl": (lambda: [QFFL(q=1.5)], False, {}, 0, 0),
    "client_loss": (lambda: [ClientLoss()], False, {}, 0, 1),
    "codasca": (lambda: [Codasca(t0=6)], True, {}, 1, 0),
    "fedxl1": (
        lambda: [PassiveBuffer(b1=2, b2=3, loss="psm", compositional=False, beta=1.0), ClientNoise()],
        True,
        {},
        0,
        0,
    ),
    "fedxl2": (lambda: [PassiveBuffer(b1=2, b2=3, gamma=0.5, beta=0.5), ClientNoise()], True, {}, 1, 0),
    # the pFedFBE protocol's algorithms on fresh minibatches, as their configs (algo.minibatch=fresh)
    "fedmid": (lambda: [ProxStep(L1)], False, {"minibatch": "fresh"}, 0, 0),
    "feddualavg": (lambda: [DualAveraging(L1)], False, {"minibatch": "fresh"}, 0, 0),
    "pfedfbe": (lambda: [FBE(L1, lam=5.0)], False, {"weighting": "uniform", "minibatch": "fresh"}, 0, 0),
    "pfedme": (
        lambda: [PFedMe(L1, lam=5.0, personal_lr=0.05)],
        False,
        {"weighting": "uniform", "minibatch": "fresh"},
        1,
        0,
    ),
    "ditto": (lambda: [Ditto(L1, lam=1.0, personal_lr=0.05)], False, {"minibatch": "fresh"}, 1, 0),
    # the local layers (_net()'s head is its module "3"); FedBN on a net with BatchNorm (_build)
    "fedper": (lambda: [FedPer(local=["3"])], False, {}, 1, 0),
    "fedrep": (lambda: [FedRep(local=["3.*"], rep_steps=1)], False, {"momentum": 0.5}, 1, 0),
    "lg_fedavg": (lambda: [LGFedAvg(local=["*", "!3"])], False, {}, 1, 0),
    "fedbabu": (lambda: [FedBABU(frozen=["3"])], False, {}, 0, 0),
    "fedbn": (lambda: [FedBN()], False, {}, 1, 0),
    "augfl": (
        lambda: [MetaUpdate(alpha=0.1, rho=2.0), PMRegularizer(lam=0.5, rh="kd", batch_size=8)],
        False,
        {"aggregator": "admm_sum", "local_steps": 0, "weighting": "uniform", "lr": 1.0},
        1,
        0,
    ),
    "whale": (
        lambda: [Subnetwork(u_th=1e4, T=2.0, extractor="random", fisher_samples=None)],
        False,
        {"aggregator": "count_mean", "weighting": "uniform", "batch_size": 6},
        0,
        0,
    ),
}
BROADCASTS = {"augfl": 1}  # the server's R_h gradient: computed on rank 0 (fed.on_server), broadcast


def _build(name: str, **kw: Any) -> Federation:
    parts, binary, extra, _, _ = CASES[name]
    if binary:
        data = binary_store([4, 6, 5, 3, 5], [7, 5, 9, 6, 4], dim=5, seed=1, shift=0.5)
        return make_fed(_net(2), data, parts=parts(), **{**BINARY, **extra, **kw})
    data = toy_data([7, 12, 30, 4, 19, 25], dtype=torch.float64)
    if name == "augfl":  # support / query sets and a server split (the last client's rows) with a frozen PM
        rows = data.client_indices
        data = ClientStore(data.x, data.y, rows[:5], client_support=[r[: len(r) // 2] for r in rows[:5]])
        pm = _net().requires_grad_(False)
        with torch.no_grad():
            torch._foreach_mul_(list(pm.parameters()), 0.5)
        kw["resources"] = ServerResources(rows[5], {"pm": pm})
    if name == "whale":  # 8x8 images, a width-scalable CNN and simulated devices (the scheduler's requirements)
        data = ClientStore(data.x.repeat(1, 13)[:, :64].reshape(-1, 1, 8, 8), data.y, data.client_indices)
        torch.manual_seed(0)
        net = ScalableCNN(input_shape=(1, 8, 8), num_classes=3, widths=[4, 4, 8, 8]).to(torch.float64)
        cfg = {**MULTICLASS, **extra}
        system = LatencySimulator(cfg["batch_size"], cfg["local_steps"], types=list(MAX_LEVELS), trace_seed=1)
        return make_fed(net, data, parts=parts(), system=system, **{**cfg, **kw})
    net = _net()
    if name == "fedbn":
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).to(torch.float64)
    return make_fed(net, data, parts=parts(), **{**MULTICLASS, **extra, **kw})


def _evaluates(name: str) -> bool:
    return CASES[name][4] > 0


def _two_ranks(name: str) -> tuple[list[Federation], Group, list[list[Tensor]]]:
    group = Group(2)
    ranks = [
        _build(
            name,
            rank=r,
            world_size=2,
            reduce_sum=group.reduce_sum(r),
            gather=group.gather(r),
            broadcast=group.broadcast(r),
        )
        for r in (0, 1)
    ]
    losses: list[list[Tensor]] = [[], []]

    def job(rank: int) -> Callable[[], None]:
        def drive() -> None:
            fed = ranks[rank]
            for t in range(ROUNDS):
                group.where[rank] = (t, "round")
                run_rounds(fed, 1, start=t)
                if _evaluates(name):  # what ClientLoss does on a validated round
                    group.where[rank] = (t, "eval")
                    losses[rank].append(client_train_losses(fed))

        return drive

    group.run([job(0), job(1)])
    return ranks, group, losses


@pytest.mark.parametrize("name", list(CASES))
def test_a_round_is_one_reduce_and_two_ranks_equal_one(name: str) -> None:
    """Per round and rank: exactly one all-reduce, no gather except the core's client-state gather (parts that keep
    ``client.state``), and ClientLoss's one evaluation reduce on validated rounds. The 2-rank model, the parts' state
    (lambda, pools, server momentum, CODASCA's server state) and the client stores equal the 1-rank run."""
    _, _, _, gathers, evals = CASES[name]
    ranks, group, losses = _two_ranks(name)
    for rank in (0, 1):
        counts = Counter(group.log[rank])
        for t in range(ROUNDS):
            assert counts[(t, "round", "reduce")] == 1, (rank, t, group.log[rank])
            assert counts[(t, "round", "gather")] == gathers, (rank, t, group.log[rank])
            assert counts[(t, "eval", "reduce")] == evals, (rank, t, group.log[rank])
            assert counts[(t, "round", "broadcast")] == BROADCASTS.get(name, 0), (rank, t, group.log[rank])
        assert sum(counts.values()) == ROUNDS * (1 + gathers + evals + BROADCASTS.get(name, 0)), group.log[rank]

    single = _build(name)
    single_losses = []
    for t in range(ROUNDS):
        run_rounds(single, 1, start=t)
        if _evaluates(name):
            single_losses.append(client_train_losses(single))
    for fed in ranks:
        for a, b in zip(fed.net.state_dict().values(), single.net.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        for part, ref in zip(fed.parts, single.parts):  # relative: WHALE's Fisher windows are ~1e5
            torch.testing.assert_close(part.state_dict(), ref.state_dict(), rtol=1e-12, atol=1e-12)
        assert fed.store.client_ids() == single.store.client_ids()
        for cid in single.store.client_ids():
            torch.testing.assert_close(fed.store.get(cid), single.store.get(cid), rtol=0, atol=1e-12)
    for got in losses:
        torch.testing.assert_close(got, single_losses, rtol=0, atol=1e-12)


class _Repeat(FederatedCallback):
    """Test part: the same cohort every round, client 0 drawn three times."""

    def sample_clients(self, fed: Federation, round_idx: int, rng: Any) -> list[int]:
        return [0, 1, 0, 2, 0]


class _LastModel(FederatedCallback):
    """Test part: each local run stores its trained weights as the client's state (different for every copy)."""

    def on_client_end(self, fed: Federation, client: Any) -> None:
        client.state["w"] = torch.cat([p.detach().reshape(-1) for p in fed.params])


def test_repeated_copies_of_a_stateful_client_leave_every_rank_the_one_process_state() -> None:
    """A client drawn three times trains three copies, on whichever ranks; one process keeps the last copy's state
    (copies run in draw order). Two ranks must keep the same one on both ranks: the copy with the highest index,
    whichever rank trained it, not each rank its own."""

    def build(**kw: Any) -> Federation:
        data = toy_data([7, 12, 30, 4], dtype=torch.float64)
        parts = [_Repeat(), _LastModel()]
        return make_fed(_net(), data, parts=parts, duplicates="repeat", **{**MULTICLASS, "clients_per_round": 5}, **kw)

    group = Group(2)
    ranks = [build(rank=r, world_size=2, reduce_sum=group.reduce_sum(r), gather=group.gather(r)) for r in (0, 1)]

    def job(rank: int) -> Callable[[], None]:
        return lambda: run_rounds(ranks[rank], ROUNDS)

    group.run([job(0), job(1)])
    single = build()
    run_rounds(single, ROUNDS)
    assert single.store.client_ids() == [0, 1, 2]
    for fed in ranks:
        assert fed.store.client_ids() == [0, 1, 2]
        for cid in (0, 1, 2):
            torch.testing.assert_close(fed.store.get(cid)["w"], single.store.get(cid)["w"], rtol=0, atol=1e-12)
