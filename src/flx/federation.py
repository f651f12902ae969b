"""The round protocol: sample -> shard over ranks -> local train -> one reduce -> server step.

McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data", AISTATS 2017
(FedAvg, Algorithm 1), with the server step of Reddi et al. (ICLR 2021) and the parts of
:mod:`flx.callbacks`.

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

from flx import autodiff, evaluation, vectorized
from flx.aggregation import AGGREGATORS, ReduceFn, RoundStats, buffer_dtype
from flx.clients import Sequential
from flx.context import ClientContext, ClientData, FederationConfig, FederationSpec, Round
from flx.datamodules.ragged import Ragged
from flx.faults import DivergenceWatch, RoundFaults, all_finite, check_global_model, judge, knob
from flx.hooks import HOOKS, FederatedCallback, overrides
from flx.sampling import (
    MINIBATCH_STREAMS,
    SAMPLE_TAG,
    derive_seed,
    derive_seeds,
    local_batches,
    number_copies,
    shard_greedy,
    uniform_cohort,
)
from flx.server import ServerOptimizer
from flx.state import ServerState
from flx.systems.clock import SimClock

__all__ = [
    "ClientContext",
    "ClientData",
    "Federation",
    "FederationConfig",
    "FederationSpec",
    "Round",
    "derive_seed",
    "local_batches",
    "shard_greedy",
    "uniform_cohort",
]
# the federation's own scalars in the round's all-reduce, before the parts' registered statistics; "stored" counts the
# clients whose state went to the store, so every rank knows whether the round needs the state all-gather; "aggregated"
# and "loss_count" are adjacent, so an aggregated client adds 1 to both in one op; "initial_*": the divergence rule's
# initial loss, each rank's share of the rows (Federation._measure_reference), summed in the first round's reduce
COUNTERS = ("dropped", "skipped", "aggregated", "loss_count", "loss_sum", "stored", "initial_loss_sum", "initial_rows")


REFERENCE_ROWS = 512
"""Rows of the first cohort on which the divergence rule's ``L_0`` is measured: its standard error is a few percent of
the loss, against a threshold of ``fault.diverge_factor`` (100) times it. 4096 rows cost the default CNN's 2-round
bench a fifth of its time (one forward of 4096 3x32x32 rows on one thread, ~1.4 s)."""


def _copy(dst: list[Tensor], src: Sequence[Tensor]) -> None:
    """In-place list copy (``_foreach_copy_`` rejects empty lists, e.g. a net without buffers)."""
    if dst:
        torch._foreach_copy_(dst, list(src))


class Federation:
    """Runs rounds on one rank: the round engine, whole when built (the net, the data and the process group given).

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
        self.server = ServerState()
        self.clock = SimClock(self.system) if self.system is not None else None
        self.rnd: Round | None = None  # the current round, or the last one trained; None before the first
        self.divergence = DivergenceWatch(self.cfg.diverge_factor, self.cfg.diverge_rounds)
        self.net, self.data, self.loss_fn = net, data, loss_fn
        # where row indices into the store live: the store's device, or the host for a store kept there (HostRows)
        self.index_device: torch.device = getattr(data.x, "index_device", data.x.device)
        indices = data.client_indices
        # a client's row count without making its view (a Ragged reads two offsets): asked ~6 times per client
        self._rows_of: Callable[[int], int] = (
            indices.size if isinstance(indices, Ragged) else lambda cid: len(indices[cid])
        )
        self.reduce_sum, self.rank, self.world_size, self.step_context = reduce_sum, rank, world_size, step_context
        self.gather, self._broadcast, self.resources = gather, broadcast, server
        self.store.bind_rank(rank, world_size)
        self.parts = list(parts)
        self._hooked = {h: [p for p in self.parts if overrides(p, h)] for h in HOOKS}
        self.params = [p for p in net.parameters() if p.requires_grad]
        buffers = [b for b in net.buffers()]
        self.float_buffers = [b for b in buffers if b.is_floating_point()]
        self.other_buffers = [b for b in buffers if not b.is_floating_point()]
        self.global_params = [p.detach().clone() for p in self.params]
        self.global_other = [b.detach().clone() for b in self.other_buffers]
        self.local_state = self.params + self.float_buffers  # what a client uploads
        self.stats = RoundStats(COUNTERS)
        self.counted: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)  # the last round's, read once after its reduce
        for part in self._hooked["on_attach"]:
            part.on_attach(self)
        self._allocate_round_buffer()
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
        policy = self.cfg.single_row_batch
        self.min_rows = 2 if policy == "drop" or (policy == "auto" and has_bn) else 1
        self.faults = RoundFaults()
        self.server_opt = ServerOptimizer(self.global_params, self.cfg.server)
        self.server_opt.load_state_dict(self.server.optimizer)
        self.local_opt = torch.optim.SGD(
            self.params, lr=self.cfg.lr, momentum=self.cfg.momentum, weight_decay=self.cfg.weight_decay
        )
        self.runner = (vectorized.Stacked if self.cfg.vectorize else Sequential)(self)
        self._global_floats = [b.detach().clone() for b in self.float_buffers]

    # ------------------------------------------------------------------ the round's one collective
    def register_stat(self, name: str, like: Tensor | Sequence[Tensor]) -> None:
        """Declares a per-round statistic that rides in the round's single all-reduce (call it in ``on_attach``).

        ``fed.stat(name)`` then gives views shaped like ``like`` (a tensor, or a list of tensors), valid for the
        whole run: zeroed when each round starts (before ``on_round_start``), summed over ranks by the round's
        all-reduce, read in ``on_server_step`` and ``on_round_end``. Each rank writes its share in place
        (``stat[i] += x``). The buffer's dtype is the widest of the model's and the statistics' (fp64 statistics make
        it fp64).
        """
        self.stats.register(name, like)

    def stat(self, name: str) -> Tensor | list[Tensor]:
        """The views of a registered statistic (see :meth:`register_stat`)."""
        return self.stats[name]

    def _allocate_round_buffer(self) -> None:
        """One flat buffer per round: the aggregator's sums, then :data:`COUNTERS`, then the registered statistics."""
        dtype = buffer_dtype(self.local_state + self.stats.likes())
        self.aggregator = AGGREGATORS[self.cfg.aggregator](self.local_state, extra=self.stats.numel(), dtype=dtype)
        self.counters = self.stats.bind(self.aggregator.extra)
        # views of the counters an aggregated client adds to (in place, two ops a client)
        i = COUNTERS.index("aggregated")
        self._aggregated_and_losses, self._loss_sum = (
            self.counters[i : i + 2],
            self.counters[COUNTERS.index("loss_sum")],
        )

    @property
    def train_loss(self) -> float | None:
        """The round's mean local training loss over the aggregated clients of every rank (after the reduce)."""
        n = self.counted["loss_count"]
        return self.counted["loss_sum"] / n if n > 0 else None

    def _read_counters(self) -> None:
        """The reduced counters as Python numbers (:attr:`counted`): one device-to-host copy for the round."""
        self.counted = dict(zip(COUNTERS, self.counters.cpu().tolist()))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled through the process group; identity on one process)."""
        if self.world_size == 1 or self._broadcast is None:
            return obj
        return self._broadcast(obj)

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

    # ------------------------------------------------------------------ server
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
        if self.divergence.needs_reference():  # the global model is the initial one: nothing has trained yet
            self._measure_reference(rnd.cohort)
        for part in self._hooked["on_round_start"]:
            part.on_round_start(self, rnd)
        rnd.freeze()
        return rnd

    def _measure_reference(self, cohort: Sequence[int], limit: int = REFERENCE_ROWS) -> None:
        """This rank's share of the divergence rule's ``L_0`` (:class:`flx.faults.DivergenceWatch`): the task loss of
        the global model on rows ``rank, rank + world_size, ...`` of the first ``limit`` rows of ``cohort``'s clients
        (in cohort order), added to the round's counters. The round's one all-reduce sums the shares, so every rank
        gets the same ``L_0`` (:meth:`end_round`) without a collective of its own."""
        rows, count = [], 0
        for cid in cohort:
            if count >= limit:
                break
            rows.append(self.data.client_indices[cid])
            count += len(rows[-1])
        mine = torch.cat(rows)[:limit][self.rank :: self.world_size] if rows else None
        if mine is not None and len(mine):
            self.counters[COUNTERS.index("initial_loss_sum")] += self.eval_loss(mine) * len(mine)
            self.counters[COUNTERS.index("initial_rows")] += len(mine)

    def _judge_divergence(self) -> None:
        """Sets ``L_0`` after the first round's reduce (a cohort without rows leaves it to the next round), then
        counts the round's training loss against the divergence rule."""
        if self.divergence.factor is None:
            return
        if self.divergence.needs_reference():
            rows = self.counted["initial_rows"]
            if rows > 0:
                self.divergence.set_reference(self.counted["initial_loss_sum"] / rows)
        self.divergence.observe(self.rnd.round + 1, self.train_loss, self.knob)

    def knob(self) -> str:
        """The setting a divergence message names, with its value (:func:`flx.faults.knob`): ``algo.server.lr``
        when the last server step moved the global model farther than the clients' mean update, else ``algo.lr``."""
        return knob(self.cfg, self.server_opt.amplification)

    def end_round(self) -> None:
        """One collective reduce, the parts' server hooks, the server optimizer step.

        Raises:
            ClientFault: a client was not finite and ``fault_policy="stop"``.
            Diverged: every client of the round was dropped, the training loss has blown up (the divergence rule,
                judged before the server step: the clients trained from the model of the previous one), or the new
                global model is not finite.
        """
        self.aggregator.sync(self.reduce_sum if self.world_size > 1 else None)
        self._read_counters()
        self._share_client_states()
        self.faults = self._round_faults()
        self._judge_divergence()
        if self.counted["aggregated"] > 0:
            self._server_step()
        else:  # no client of the round had usable rows: the global model stays as it was
            self.load_global()
        self.server.round = self.rnd.round + 1
        if self.clock is not None:
            self._advance_clock()
        for part in self._hooked["on_round_end"]:
            part.on_round_end(self, self.rnd)

    def _advance_clock(self) -> None:
        """Prices the round on the simulator: the clients that trained (skipped ones had no rows), at their widths
        and local iterations (docs/systems.md)."""
        trained = [c for c in self.rnd.cohort if c not in self.faults.skipped]
        widths = {c: self.rnd.width(c) for c in trained}
        self.clock.advance(self.rnd.round, widths, {c: self.client_steps(c) for c in trained})

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

    def _round_faults(self) -> RoundFaults:
        """The round's dropped / skipped client ids on every rank (gathered only when the counters say so), judged
        by the fault policy (:func:`flx.faults.judge`)."""
        dropped, skipped, aggregated = (int(self.counted[k]) for k in COUNTERS[:3])
        mine = self.rnd.left_out
        if (dropped or skipped) and self.world_size > 1 and self.gather is not None:
            everyone = self.gather(mine)
            mine = {k: [c for part in everyone for c in part[k]] for k in mine}
        faults = RoundFaults(tuple(sorted(mine["dropped"])), tuple(sorted(mine["skipped"])))
        r, lower = self.rnd.round + 1, self.knob() if dropped else ""
        return judge(faults, aggregated, len(self.rnd.cohort), r, self.cfg, warn=self.rank == 0, lower=lower)

    def _share_client_states(self) -> None:
        """Under N processes, every rank's store receives the client states updated on the other ranks.

        A client may train on another rank next time it is sampled, so each rank keeps every client's state. The
        all-gather runs only in rounds where some rank stored a client state (the reduced ``stored`` counter), so
        parts without per-client state cost no collective beyond the round's reduce.
        """
        if self.world_size == 1 or self.gather is None or self.counted["stored"] == 0:
            return
        # the store's host copies (the state it was just given): no device read per tensor
        updates = self.rnd.state_updates
        cpu = {cid: self.store.get(cid) for cid in updates}
        for rank, theirs in enumerate(self.gather(cpu)):
            if rank == self.rank:
                continue
            for cid, state in theirs.items():
                # a client drawn more than once keeps its last copy's state, as on one process: copies are numbered
                # in rank order, so a later rank's copy wins and an earlier rank's does not replace this rank's own
                if rank > self.rank or cid not in updates:
                    self.store.put(cid, state)

    # ------------------------------------------------------------------ client
    def client_steps(self, cid: int) -> int:
        if self.cfg.local_epochs is None:
            return self.cfg.local_steps
        return self.cfg.local_epochs * -(-self.num_samples(cid) // self.cfg.batch_size)

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

    def collect(self, cid: int, client: ClientContext | None, loss: Tensor | None) -> Tensor | None:
        """A client's end, with its local model in the net (both client runners end a client here): ``on_client_end``,
        the fault checks, the aggregate, the stored state; ``client`` None: skipped for too few rows. Returns
        ``loss``, or None for a client left out."""
        if client is None:
            self._leave_out(cid, "skipped")
            return None
        # checked before on_client_end, so parts do not record a faulty client's statistics (scores, losses), and
        # after it when parts may have changed the upload
        if not all_finite([*self.local_state, loss]):
            self._leave_out(cid, "dropped")
            return None
        for part in self._hooked["on_client_end"]:
            part.on_client_end(self, client)
        if self._hooked["on_client_end"] and not all_finite(self.local_state):
            self._leave_out(cid, "dropped")
            return None
        self.aggregator.update(self.local_state, client.weight, client.masks)
        self._loss_sum += loss if loss.dtype == self._loss_sum.dtype else loss.to(self._loss_sum.dtype)
        self._aggregated_and_losses += 1
        if client.state:
            self.store.put(cid, client.state)
            if self.world_size > 1:  # for the all-gather at the round end (one process holds no second copy)
                self.rnd.state_updates[cid] = client.state
            self.counters[COUNTERS.index("stored")] += 1
        return loss

    def _leave_out(self, cid: int, why: str) -> None:
        """Leaves a client out of the round's aggregate and state updates; counted in the round's collective."""
        self.rnd.left_out[why].append(cid)
        self.counters[COUNTERS.index(why)] += 1

    def client_batches(self, client: ClientContext) -> Iterator[Tensor]:
        """The default minibatch stream of ``client``: its ``num_steps`` minibatches (row indices into the store),
        drawn from ``client.generator`` as ``algo.minibatch`` says (reshuffled passes over its rows, or a fresh draw of
        ``B`` rows per step; :data:`flx.sampling.MINIBATCH_STREAMS`). The one source of the local steps' rows: the
        sequential steps, the stacked ones (:mod:`flx.vectorized`) and parts that replace the local steps."""
        stream = MINIBATCH_STREAMS[self.cfg.minibatch]
        idx = self.data.client_indices[client.cid]
        return stream(idx, self.cfg.batch_size, client.num_steps, client.generator, self.min_rows)

    def batch(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``(x, y)`` of ``rows`` of the tensor store (rows held on the host, e.g. the server's, are copied to the
        store's device first; the clients' rows are there already)."""
        rows = rows.to(self.index_device)
        return self.data.x[rows], self.data.y[rows]

    # ------------------------------------------------------------------ derivatives at other parameters
    def grad_at(self, params: Sequence[Tensor], rows: Tensor, create_graph: bool = False) -> list[Tensor]:
        """``grad f(params; rows)`` of ``loss_fn`` for the net's trainable parameters at ``params`` (not the net's
        values), without touching BatchNorm statistics, the net or the training step's RNG stream
        (:func:`flx.autodiff.grad_at`)."""
        with self.step_context():
            return autodiff.grad_at(self.net, params, self.batch(rows), self.loss_fn, create_graph=create_graph)

    def value_and_grad_at(self, params: Sequence[Tensor], rows: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The loss (detached) and :meth:`grad_at` of ``rows`` at ``params``, from one forward and backward pass."""
        with self.step_context():
            return autodiff.value_and_grad_at(self.net, params, self.batch(rows), self.loss_fn)

    def hvp(
        self, v: Sequence[Tensor], rows: Tensor, mode: str = "exact", params: Sequence[Tensor] | None = None, **kw: Any
    ) -> list[Tensor]:
        """``H(params) v`` of ``loss_fn`` on ``rows`` (``params`` default: the net's current values); ``mode``:
        ``exact`` (double backward), ``fd`` (finite differences of gradients) or ``none`` (zeros)
        (:func:`flx.autodiff.hvp`)."""
        at = [p.detach() for p in self.params] if params is None else list(params)
        with self.step_context():
            return autodiff.hvp(self.net, at, list(v), self.batch(rows), self.loss_fn, mode=mode, **kw)

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

    def eval_loss(self, rows: Tensor, chunk: int = 4096) -> float:
        """Mean ``loss_fn`` of the net's current model over ``rows`` of the store, outside training.

        The net runs in eval mode (no dropout, no BatchNorm statistics update) inside the step context and is put
        back in its previous mode; no random number is drawn. ``loss_fn`` must return a batch mean.
        """
        return float(self.eval_loss_tensor(rows, chunk))

    @torch.no_grad()
    def eval_loss_tensor(self, rows: Tensor, chunk: int = 4096) -> Tensor:
        """:meth:`eval_loss` as a float64 scalar on the net's device (no host sync: for use inside local steps)."""
        was_training = self.net.training
        rows = rows.to(self.index_device)
        self.net.eval()
        try:
            with self.step_context():
                total = sum(
                    self.loss_fn(self.net(self.data.x[r]), self.data.y[r]).double() * len(r) for r in rows.split(chunk)
                )
        finally:
            self.net.train(was_training)
        return total / len(rows)

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
