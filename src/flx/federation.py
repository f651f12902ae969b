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
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from flx import evaluation, vectorized
from flx.aggregation import ReduceFn
from flx.clients import Sequential
from flx.context import ClientContext, ClientData, FederationConfig, FederationSpec, Round
from flx.datamodules.ragged import Ragged
from flx.faults import DivergenceWatch, RoundFaults, check_global_model, gather_faults, judge, knob, reference_rows
from flx.hooks import HOOKS, FederatedCallback, overrides
from flx.probe import LossProbe
from flx.round_buffer import COUNTERS, RoundBuffer
from flx.sampling import (
    MINIBATCH_STREAMS,
    SAMPLE_TAG,
    derive_seed,
    derive_seeds,
    number_copies,
    shard_greedy,
    uniform_cohort,
)
from flx.server import ServerOptimizer
from flx.state import ServerState, share_states
from flx.systems.clock import SimClock

__all__ = ["COUNTERS", "ClientContext", "ClientData", "Federation", "FederationConfig", "FederationSpec", "Round"]


def _copy(dst: list[Tensor], src: Sequence[Tensor]) -> None:
    """In-place list copy (``_foreach_copy_`` rejects empty lists, e.g. a net without buffers)."""
    if dst:
        torch._foreach_copy_(dst, list(src))


class Federation:
    """Runs rounds on one rank: the round engine, whole when built (the net, the data and the process group given).

    The round is its own object (:class:`~flx.context.Round`, :meth:`begin_round`); the clients train in the run's
    client runner (:mod:`flx.clients`); the round's one collective is :class:`~flx.round_buffer.RoundBuffer`; losses
    and derivatives on store rows are :class:`~flx.probe.LossProbe`'s. Parts see this object through
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
        server: the server-side resources (:class:`flx.resources.ServerResources`: rows no client sees, frozen
            models), or None.
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
        server: Any = None,
    ) -> None:
        self.spec = spec if isinstance(spec, FederationSpec) else FederationSpec(spec)
        self.cfg, self.store, self.system = self.spec.cfg, self.spec.store, self.spec.system
        self.clock = SimClock(self.system) if self.system is not None else None
        self.server, self.divergence = ServerState(), DivergenceWatch(self.cfg.diverge_factor, self.cfg.diverge_rounds)
        self.rnd: Round | None = None  # the current round, or the last one trained; None before the first
        self.faults = RoundFaults()  # the last round's left-out clients
        self.net, self.data, self.loss_fn, self.step_context = net, data, loss_fn, step_context
        self.reduce_sum, self.gather, self._broadcast, self.resources = reduce_sum, gather, broadcast, server
        self.rank, self.world_size = rank, world_size
        self.store.bind_rank(rank, world_size)
        indices = data.client_indices  # a client's row count without its view (a Ragged reads two offsets)
        self._rows_of: Callable[[int], int] = indices.size if isinstance(indices, Ragged) else lambda c: len(indices[c])
        self.parts = list(parts)
        self._hooked = {h: [p for p in self.parts if overrides(p, h)] for h in HOOKS}
        self.params = [p for p in net.parameters() if p.requires_grad]
        buffers = list(net.buffers())
        self.float_buffers = [b for b in buffers if b.is_floating_point()]
        self.other_buffers = [b for b in buffers if not b.is_floating_point()]
        self.local_state = self.params + self.float_buffers  # what a client uploads
        self.global_params = [p.detach().clone() for p in self.params]
        self._global_floats = [b.detach().clone() for b in self.float_buffers]
        self.global_other = [b.detach().clone() for b in self.other_buffers]
        self.probe = LossProbe(net, self.params, data, loss_fn, step_context)
        self.buffer = RoundBuffer()
        for part in self._hooked["on_attach"]:  # parts register their statistics before the buffer is laid out
            part.on_attach(self)
        self.aggregator = self.buffer.allocate(self.local_state, self.cfg.aggregator)
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
        policy = self.cfg.single_row_batch
        self.min_rows = 2 if policy == "drop" or (policy == "auto" and has_bn) else 1
        self.server_opt = ServerOptimizer(self.global_params, self.cfg.server)
        cfg = self.cfg
        self.local_opt = torch.optim.SGD(self.params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        self.runner = (vectorized.Stacked if cfg.vectorize else Sequential)(self)

    # ------------------------------------------------------------------ services for parts
    def register_stat(self, name: str, like: Tensor | Sequence[Tensor]) -> None:
        """Declares a per-round statistic that rides in the round's single all-reduce (call it in ``on_attach``).

        ``fed.stat(name)`` then gives views shaped like ``like`` (a tensor, or a list of tensors), valid for the
        whole run: zeroed when each round starts (before ``on_round_start``), summed over ranks by the round's
        all-reduce, read in ``on_server_step`` and ``on_round_end``. Each rank writes its share in place
        (``stat[i] += x``). The buffer's dtype is the widest of the model's and the statistics' (fp64 statistics make
        it fp64).
        """
        self.buffer.register(name, like)

    def stat(self, name: str) -> Tensor | list[Tensor]:
        """The views of a registered statistic (see :meth:`register_stat`)."""
        return self.buffer.stats[name]

    @property
    def train_loss(self) -> float | None:
        """The round's mean local training loss over the aggregated clients of every rank (after the reduce)."""
        return self.buffer.train_loss

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled through the process group; identity on one process)."""
        return obj if self.world_size == 1 or self._broadcast is None else self._broadcast(obj)

    def on_server(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on rank 0 only and returns its result on every rank: server-side work (training with a
        pretrained model on the server rows) runs once, not once per rank."""
        return self.broadcast(fn() if self.rank == 0 else None)

    @property
    def num_clients(self) -> int:
        """The clients that train (client ids ``0..num_clients-1``); held-out evaluation clients follow them."""
        return self.data.num_train_clients

    def num_samples(self, cid: int) -> int:
        return self._rows_of(cid)

    @property
    def cohort(self) -> tuple[int, ...]:
        """The distinct clients sampled in the current round, or in the last round trained (the one the global model
        now being evaluated comes from); sorted; ``()`` before this process's first round."""
        return self.rnd.cohort if self.rnd is not None else ()

    def client_steps(self, cid: int) -> int:
        if self.cfg.local_epochs is None:
            return self.cfg.local_steps
        return self.cfg.local_epochs * -(-self.num_samples(cid) // self.cfg.batch_size)

    def client_batches(self, client: ClientContext) -> Iterator[Tensor]:
        """The default minibatch stream of ``client``: its ``num_steps`` minibatches (row indices into the store),
        drawn from ``client.generator`` as ``algo.minibatch`` says (reshuffled passes over its rows, or a fresh draw of
        ``B`` rows per step; :data:`flx.sampling.MINIBATCH_STREAMS`). The one source of the local steps' rows: both
        client runners and the parts that replace the local steps."""
        stream = MINIBATCH_STREAMS[self.cfg.minibatch]
        idx = self.data.client_indices[client.cid]
        return stream(idx, self.cfg.batch_size, client.num_steps, client.generator, self.min_rows)

    # the loss of the net on store rows, at any parameters (flx.probe.LossProbe: the training state is untouched)
    def batch(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``(x, y)`` of ``rows`` of the tensor store (:meth:`flx.probe.LossProbe.batch`)."""
        return self.probe.batch(rows)

    def grad_at(self, params: Sequence[Tensor], rows: Tensor, create_graph: bool = False) -> list[Tensor]:
        """``grad f(params; rows)`` at any ``params`` (:meth:`flx.probe.LossProbe.grad_at`)."""
        return self.probe.grad_at(params, rows, create_graph)

    def value_and_grad_at(self, params: Sequence[Tensor], rows: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The loss and :meth:`grad_at` from one pass (:meth:`flx.probe.LossProbe.value_and_grad_at`)."""
        return self.probe.value_and_grad_at(params, rows)

    def hvp(
        self, v: Sequence[Tensor], rows: Tensor, mode: str = "exact", params: Any = None, **kw: Any
    ) -> list[Tensor]:
        """``H(params) v`` on ``rows``, ``mode`` exact / fd / none (:meth:`flx.probe.LossProbe.hvp`)."""
        return self.probe.hvp(v, rows, mode, params, **kw)

    def eval_loss(self, rows: Tensor, chunk: int = 4096) -> float:
        """The net's mean loss on ``rows`` in eval mode, no RNG drawn (:meth:`flx.probe.LossProbe.eval_loss`)."""
        return self.probe.eval_loss(rows, chunk)

    def eval_loss_tensor(self, rows: Tensor, chunk: int = 4096) -> Tensor:
        """:meth:`eval_loss` as a float64 scalar on the net's device, no host sync."""
        return self.probe.eval_loss_tensor(rows, chunk)

    def knob(self) -> str:
        """The setting a divergence message names, with its value (:func:`flx.faults.knob`): ``algo.server.lr``
        when the last server step moved the global model farther than the clients' mean update, else ``algo.lr``."""
        return knob(self.cfg, self.server_opt.amplification)

    # ------------------------------------------------------------------ the round
    def sample(self, round_idx: int) -> list[int]:
        """The round's cohort (with repeats if a sampling part draws with replacement)."""
        rng = np.random.default_rng(derive_seed(self.cfg.seed, round_idx, SAMPLE_TAG))
        for part in self._hooked["sample_clients"]:
            cohort = part.sample_clients(self, round_idx, rng)
            if cohort is not None:
                return [int(c) for c in cohort]
        return uniform_cohort(self.num_clients, self.cfg.clients_per_round, rng)

    def begin_round(self, round_idx: int) -> Round:
        """Plans the round (:class:`~flx.context.Round`): samples and shards the cohort, snapshots the global model,
        runs ``on_round_start``, then freezes the plan."""
        check = self.system.check_width if self.system is not None else None
        rnd = self.rnd = Round(round_idx, self.rank, self.world_size, check_width=check)
        rnd.draws = Counter(self.sample(round_idx))  # the distinct clients and how often each was drawn
        rnd.cohort = tuple(sorted(rnd.draws))
        rnd.multiplicity = tuple(rnd.draws[c] for c in rnd.cohort)
        rnd.weights = {c: self.base_weight(c, 1) for c in rnd.cohort}
        # a cohort with fewer distinct runs than ranks (e.g. drawn with replacement) leaves ranks idle: they run
        # an empty batch and add nothing to the aggregate
        repeat = self.cfg.duplicates == "repeat"
        runs = [c for c, k in zip(rnd.cohort, rnd.multiplicity) for _ in range(k if repeat else 1)]
        shards = shard_greedy(runs, [self.expected_cost(c) for c in runs], self.world_size)
        rnd.shard, rnd.slots = tuple(shards[self.rank]), max(len(s) for s in shards)
        rnd.copies, repeated = number_copies(shards, self.rank)
        rnd.start_states = {c: self.store.get(c, self.params[0].device) for c in repeated}
        mine = sorted(set(rnd.shard))  # copy 0's seeds, for all of them at once
        rnd.seeds = dict(zip(mine, derive_seeds(self.cfg.seed, round_idx, np.array(mine, dtype=np.int64)).tolist()))
        with torch.no_grad():
            _copy(self.global_params, [p.detach() for p in self.params])
            _copy(self._global_floats, [b.detach() for b in self.float_buffers])
            _copy(self.global_other, [b.detach() for b in self.other_buffers])
        # the weighted mean adds weights pre-divided by the round's expected total: one client's mean is its model
        self.aggregator.reset(sum(rnd.weights[c] * k for c, k in zip(rnd.cohort, rnd.multiplicity)))
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

    def base_weight(self, cid: int, multiplicity: int) -> float:
        """Aggregation weight before parts adjust it: ``n_i`` (or 1) times the times ``i`` was drawn."""
        return float((self.num_samples(cid) if self.cfg.weighting == "num_samples" else 1) * multiplicity)

    @torch.no_grad()
    def load_global(self) -> None:
        """Copies the round's global model into the net (in place, no allocation)."""
        _copy(self.params, self.global_params)
        _copy(self.float_buffers, self._global_floats)
        _copy(self.other_buffers, self.global_other)

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
        lower = self.knob() if faults.dropped else ""
        aggregated, r = int(counted["aggregated"]), rnd.round + 1
        self.faults = judge(faults, aggregated, len(rnd.cohort), r, self.cfg, warn=self.rank == 0, lower=lower)
        self.divergence.judge(counted, rnd.round + 1, self.train_loss, self.knob)
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
        mean = self.aggregator.compute(self.global_params + self._global_floats)
        for part in self._hooked["on_server_step"]:
            part.on_server_step(self, self.rnd, mean)
        n = len(self.params)
        self.server_opt.step(mean[:n])
        with torch.no_grad():
            _copy(self.params, self.global_params)
            _copy(self.float_buffers, [m.to(b.dtype) for b, m in zip(self.float_buffers, mean[n:])])
            _copy(self.other_buffers, self.global_other)
        check_global_model(self.local_state, self.rnd.round + 1, self.knob)

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
