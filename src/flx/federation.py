"""The round protocol: sample -> shard over ranks -> local train -> one reduce -> server step.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data", AISTATS 2017
(FedAvg, Algorithm 1), with the server step of Reddi et al. (ICLR 2021) and the parts of
:mod:`flx.parts`.

.. math::
    w_i^{t,k+1} = w_i^{t,k} - \\eta\\, \\nabla \\ell_i(w_i^{t,k}; \\xi_i^{t,k}),\\quad k = 0..K-1,
    \\qquad \\bar w^{t} = \\frac{\\sum_{i \\in P_t} p_i w_i^{t,K}}{\\sum_{i \\in P_t} p_i}

Every rank holds ONE model instance (the LightningModule's net). For each of its clients it copies the
global weights in place, runs the local steps and adds the weighted result to a preallocated buffer;
one all-reduce per round sums the buffers; the server step then runs identically on every rank.
Randomness is derived from ``(seed, round)`` for sampling and ``(seed, round, client)`` for a client (plus the
copy index for the second and later runs of a client drawn several times under ``duplicates=repeat``), so a run
gives the same model on 1 process or on N.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from flx import composition, evaluation, vectorized
from flx.aggregation import ReduceFn
from flx.clients import Sequential
from flx.context import ClientContext, ClientData, FederationConfig, FederationSpec, Round
from flx.faults import (
    DivergenceWatch,
    RoundFaults,
    check_global_model,
    distance,
    gather_faults,
    judge,
    optimizer_cause,
    reference_rows,
)
from flx.hooks import HOOKS, Build, FederatedCallback, RoundRefused, first_answer, overrides
from flx.round_buffer import COUNTERS
from flx.sampling import SAMPLE_TAG, derive_seed, derive_seeds, number_copies, shard_greedy, uniform_cohort
from flx.server import ServerOptimizer, StepMoves
from flx.services import PartServices
from flx.state import GlobalModel, ServerState, share_states
from flx.systems.clock import SimClock

__all__ = ["COUNTERS", "ClientContext", "ClientData", "Federation", "FederationConfig", "FederationSpec", "Round"]


class Federation(PartServices):
    """Runs rounds on one rank: the round engine, whole when built (the net, the data and the process group given).

    The round is its own object (:class:`~flx.context.Round`, :meth:`begin_round`); the clients train in the run's
    client runner (:mod:`flx.clients`); the round's one collective is :class:`~flx.round_buffer.RoundBuffer`; the global
    model and its snapshot are :class:`~flx.state.GlobalModel`'s. The helpers parts call besides the round are
    :class:`~flx.services.PartServices`'s (inherited). Parts see this object through
    :class:`flx.context.FederationView`.

    Args:
        spec: the settings, the client-state store and the simulator (:class:`FederationSpec`), or the settings alone.
        net: the (single, reused) net.
        data: the client store (:class:`flx.context.ClientData`) on the net's device.
        loss_fn: the task's batch-mean loss.
        parts: the algorithm's parts, in ``algo.parts`` order.
        reduce_sum, gather, broadcast: the process group's all-reduce of a tensor (sum), all-gather of a picklable
            object (rank order) and broadcast of rank 0's object; only called when ``world_size > 1``.
        rank, world_size: this process and the number of processes.
        step_context: the precision context of the local steps.
        resources: the server-side resources (:class:`flx.resources.ServerResources`: rows no client sees, frozen
            models), or None; ``fed.server`` is the server's state (:class:`flx.state.ServerState`), not these.
    """

    def __init__(
        self,
        spec: FederationSpec | FederationConfig,
        net: nn.Module,
        data: ClientData,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        parts: Sequence[FederatedCallback] = (),
        reduce_sum: ReduceFn | None = None,
        rank: int = 0,
        world_size: int = 1,
        step_context: Callable[[], AbstractContextManager] = nullcontext,
        gather: Callable[[Any], list[Any]] | None = None,
        broadcast: Callable[[Any], Any] | None = None,
        resources: Any = None,
    ) -> None:
        self.spec = spec if isinstance(spec, FederationSpec) else FederationSpec(spec)
        cfg, self.store, self.system = self.spec.cfg, self.spec.store, self.spec.system
        m = self.model = GlobalModel(net)  # the net's tensors and the global model's snapshot of them
        self.params, self.float_buffers, self.local_state = m.params, m.float_buffers, m.local_state
        self.global_params, self.global_state = m.global_params, m.global_state
        super().__init__(cfg, net, self.params, data, loss_fn, step_context, rank, world_size, broadcast)
        self.clock = SimClock(self.system) if self.system is not None else None
        self.server, self.divergence = ServerState(), DivergenceWatch(cfg.diverge_factor, cfg.diverge_rounds)
        self.rnd: Round | None = None  # the current round, or the last one trained; None before the first
        self.faults = RoundFaults()  # the last round's left-out clients
        self.reduce_sum, self.gather, self.resources = reduce_sum, gather, resources
        self.store.bind_rank(rank, world_size)
        self.parts = list(parts)
        checked = self.spec.checked  # the parts the run's build checked: a federation built directly checks its own
        if len(checked) != len(self.parts) or any(a is not b for a, b in zip(checked, self.parts)):
            composition.check(Build(cfg, net, tuple(self.parts), data, self.system, resources))
        self._hooked = {h: [p for p in self.parts if overrides(p, h)] for h in HOOKS}
        self._attaching: FederatedCallback | None = None  # the part whose on_attach runs (register_stat checks it)
        for part in self._hooked["on_attach"]:  # parts register their statistics before the buffer is laid out
            self._attaching = part
            part.on_attach(self)
        self._attaching = None
        self.aggregator = self.buffer.allocate(self.local_state, cfg.aggregator)
        self.server_opt = ServerOptimizer(self.global_params, cfg.server)
        # its lr derives from cfg.lr (algo.lr, the one source of eta); only a part's schedule moves it (CoDASCA stages)
        self.local_opt = torch.optim.SGD(self.params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self.runner = (vectorized.Stacked if cfg.vectorize else Sequential)(self)
        # the last server steps' measurements, by step (1-based), for divergence_cause: what the optimizer did, and
        # ||mean - w^t|| when a part answers divergence_cause; as many as a divergence streak reaches back
        self._steps: dict[int, tuple[StepMoves, Tensor | None]] = {}
        self._keep = (cfg.diverge_rounds if cfg.diverge_factor is not None else 0) + 1

    def register_stat(self, name: str, like: Tensor | Sequence[Tensor]) -> None:
        """:meth:`flx.services.PartServices.register_stat`, for the part being attached: a part that declares its
        uploads (``traits.uploads``) registers only the channels it declares (a statistic is what its clients send)."""
        part = self._attaching
        if part is not None and part.traits.declared and name not in part.traits.channels():
            declared = ", ".join(part.traits.channels()) or "none"
            raise ValueError(
                f"{type(part).__name__} registers the statistic {name!r}, a channel its traits do not declare "
                f"(PartTraits.uploads: {declared}); declare what its clients send"
            )
        super().register_stat(name, like)

    def divergence_cause(self, since: int = 0) -> str:
        """What a divergence message ends with: the cause and the keys to change, with their values.

        ``since``: the first round whose clients met the blow-up (0: the model of the last server step). Round 1's
        clients trained from the initial model, which no server step had touched: only their own ``algo.lr`` can be
        the cause. Otherwise, of the server step that made the model they met (``since - 1``): the first part's
        answer (``divergence_cause``: DP noise that dominated the update), else the server optimizer's keys when its
        step outran the clients' mean update, else ``algo.lr`` (:func:`flx.faults.optimizer_cause`).
        """
        if since == 1:
            return f"lower algo.lr (now {self.cfg.lr:g}): the blow-up began in round 1, before any server step"
        step = since - 1 if since else max(self._steps, default=self.server.round)
        answer = first_answer(self._hooked["divergence_cause"], "divergence_cause", self, step)
        if answer is not None:
            return answer
        moves = self._steps[step][0] if step in self._steps else self.server_opt.moves  # a resumed run: the last
        return optimizer_cause(self.cfg, moves.amplification, moves.denominator)

    def update_norm(self, step: int) -> float | None:
        """``||mean - w^t||`` of server step ``step`` (1-based): the clients' aggregate update (every uploaded
        tensor) as reduced, before the parts' ``on_server_step``; what a part's ``divergence_cause`` weighs its own
        contribution against. Kept for the last few steps of this process, and only when a part answers
        ``divergence_cause`` (else None); read on the host only when asked."""
        norm = self._steps.get(step, (None, None))[1]
        return None if norm is None else float(norm)

    # ------------------------------------------------------------------ the round
    def sample(self, round_idx: int) -> list[int]:
        """The round's cohort (with repeats if a sampling part draws with replacement)."""
        rng = np.random.default_rng(derive_seed(self.cfg.seed, round_idx, SAMPLE_TAG))
        cohort = first_answer(self._hooked["sample_clients"], "sample_clients", self, round_idx, rng)
        if cohort is None:
            return uniform_cohort(self.num_clients, self.cfg.clients_per_round, rng)
        return [int(c) for c in cohort]

    def _drawn(self, rnd: Round) -> Round:
        """``rnd`` with its draws: the distinct clients (``cohort``) and how often each was drawn."""
        rnd.draws = Counter(self.sample(rnd.round))
        rnd.cohort = tuple(sorted(rnd.draws))
        return rnd

    def refusal(self, round_idx: int) -> str | None:
        """Why round ``round_idx`` must not run (``refuse_round``), from the draws :meth:`begin_round` will make (the
        sampling is a function of the seed and the server state); None: it runs. Asked at the end of the round
        before it, so that the run stops there, with that round's checkpoint."""
        if not self._hooked["refuse_round"]:
            return None
        rnd = self._drawn(Round(round_idx, self.rank, self.world_size))
        return first_answer(self._hooked["refuse_round"], "refuse_round", self, rnd)

    def begin_round(self, round_idx: int) -> Round:
        """Plans the round (:class:`~flx.context.Round`): samples and shards the cohort, snapshots the global model,
        runs ``on_round_start``, then freezes the plan."""
        check = self.system.check_width if self.system is not None else None
        rnd = self._drawn(Round(round_idx, self.rank, self.world_size, check_width=check))
        refusal = first_answer(self._hooked["refuse_round"], "refuse_round", self, rnd)
        if refusal is not None:  # before anything of the round runs (its snapshot, on_round_start, the clients)
            raise RoundRefused(refusal)
        self.rnd = rnd
        rnd.weights = {c: self.base_weight(c, 1) for c in rnd.cohort}
        # a cohort with fewer distinct runs than ranks (e.g. drawn with replacement) leaves ranks idle: they run
        # an empty batch and add nothing to the aggregate
        repeat = self.cfg.duplicates == "repeat"
        runs = [c for c in rnd.cohort for _ in range(rnd.draws[c] if repeat else 1)]
        shards = shard_greedy(runs, [self.expected_cost(c) for c in runs], self.world_size)
        rnd.shard, rnd.slots = tuple(shards[self.rank]), max(len(s) for s in shards)
        rnd.copies, repeated = number_copies(shards, self.rank)
        rnd.start_states = {c: self.store.get(c, self.params[0].device) for c in repeated}
        mine = sorted(set(rnd.shard))  # copy 0's seeds, for all of them at once
        rnd.seeds = dict(zip(mine, derive_seeds(self.cfg.seed, round_idx, np.array(mine, dtype=np.int64)).tolist()))
        self.model.snapshot()
        # the weighted mean adds weights pre-divided by the round's expected total: one client's mean is its model
        self.aggregator.reset(sum(rnd.weights[c] * rnd.draws[c] for c in rnd.cohort))
        if self.divergence.needs_reference():  # the global model is the initial one: this rank's share of L_0
            rows = reference_rows(self.data.client_indices, rnd.cohort, self.rank, self.world_size)
            if rows is not None:
                self.buffer.count("initial_loss_sum", self.eval_loss(rows) * len(rows))
                self.buffer.count("initial_rows", len(rows))
        for part in self._hooked["on_round_start"]:
            part.on_round_start(self, rnd)
        rnd.freeze()
        return rnd

    def expected_cost(self, cid: int) -> int:
        """The rows client ``cid``'s local training processes, ``K_i * min(B, n_i)``: what the shards balance (with
        ``local_steps`` every client costs alike, whatever its size; with ``local_epochs`` the cost grows with
        ``n_i``)."""
        return self.client_steps(cid) * min(self.cfg.batch_size, self.num_samples(cid))

    def base_weight(self, cid: int, draws: int) -> float:
        """Aggregation weight before parts adjust it: ``n_i`` (or 1) times the times ``i`` was drawn."""
        return float((self.num_samples(cid) if self.cfg.weighting == "num_samples" else 1) * draws)

    def load_global(self) -> None:
        """Copies the round's global model into the net (in place, no allocation)."""
        self.model.load()

    def train_clients(self, cids: Sequence[int], after: Callable[[int], None] | None = None) -> None:
        """Trains ``cids`` (this rank's shard of the round) with the run's client runner (:mod:`flx.clients`: one
        after the other, or stacked with ``algo.vectorize``); ``after(cid)`` runs after each client (the progress
        bar's tick)."""
        self.runner.train(cids, after)

    def train_client(self, cid: int) -> Tensor | None:
        """Local training of one client alone (:meth:`flx.clients.ClientRunner.train_client`); returns its mean loss,
        or None for a client left out."""
        return self.runner.train_client(cid)

    def end_round(self) -> None:
        """One collective reduce, the parts' server hooks, the server optimizer step.

        Raises:
            ClientFault: a client was not finite and ``fault_policy="stop"``.
            Diverged: every client of the round was dropped, the training loss has blown up (the divergence rule,
                judged before the server step: the clients trained from the model of the previous one), or the new
                global model is not finite.
        """
        rnd = self.rnd
        self.buffer.sync(self.reduce_sum if self.world_size > 1 else None)
        counted = self.buffer.counted
        if self.world_size > 1 and self.gather is not None and counted["stored"] > 0:
            share_states(self.store, rnd.state_updates, self.gather, self.rank)
        faults = gather_faults(rnd.left_out, counted, self.gather if self.world_size > 1 else None)
        aggregated, r = int(counted["aggregated"]), rnd.round + 1
        cause = self.divergence_cause(r) if faults.dropped else ""
        self.faults = judge(faults, aggregated, len(rnd.cohort), r, self.cfg, warn=self.rank == 0, cause=cause)
        self.divergence.judge(counted, r, self.train_loss, self.divergence_cause)
        if counted["aggregated"] > 0:
            self._server_step()
        else:  # no client of the round had usable rows: the global model stays as it was
            self.load_global()
        self.server.round = rnd.round + 1
        if self.clock is not None:  # priced on the simulator: the clients that trained, at their widths and steps
            trained = [c for c in rnd.cohort if c not in self.faults.skipped]
            self.clock.advance(
                rnd.round, {c: rnd.width(c) for c in trained}, {c: self.client_steps(c) for c in trained}
            )
        for part in self._hooked["on_round_end"]:
            part.on_round_end(self, rnd)

    def _server_step(self) -> None:
        mean = self.aggregator.compute(self.model.global_state)
        update = distance(mean, self.model.global_state) if self._hooked["divergence_cause"] else None
        for part in self._hooked["on_server_step"]:
            part.on_server_step(self, self.rnd, mean)
        n = len(self.params)
        self.server_opt.step(mean[:n])
        step = self.rnd.round + 1
        self._steps[step] = (self.server_opt.moves, update)
        self._steps.pop(step - self._keep, None)
        self.model.commit(mean[n:])
        check_global_model(self.local_state, self.rnd.round + 1, self.divergence_cause)

    # ------------------------------------------------------------------ personalised evaluation
    def parts_with(self, hook: str) -> list[FederatedCallback]:
        """The parts that override ``hook``, in part order."""
        return list(self._hooked[hook])

    def personalize(self, cid: int) -> AbstractContextManager[None]:
        """Client ``cid``'s personalised model in the net, in a ``with`` block (:func:`flx.evaluation.personalized`)."""
        return evaluation.personalized(self, cid)

    def evaluate_clients(self, data: evaluation.ClientRows, metric: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """A metric of every client's personalised model on its own rows (:func:`flx.evaluation.evaluate_clients`)."""
        return evaluation.evaluate_clients(self, data, metric)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.server.round,
            "server_opt": self.server_opt.state_dict(),
            "store": self.store.state_dict(round=self.server.round),
            **({"sim_clock": self.clock.state_dict()} if self.clock is not None else {}),
            "divergence": self.divergence.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server.round = int(state["round"])
        self.server.optimizer = state["server_opt"]
        self.store.load_state_dict(state["store"])
        if self.clock is not None and "sim_clock" in state:
            self.clock.load_state_dict(state["sim_clock"])
        if "divergence" in state:  # a checkpoint of an older flx: the initial loss is measured at the next round
            self.divergence.load_state_dict(state["divergence"])
        self.server_opt.load_state_dict(self.server.optimizer)
