"""The round protocol's narrow door: what parts receive and the one type of the federation they see.

- :class:`FederationConfig`: the settings (``algo.*``); :class:`FederationSpec`: what the federation is built from
  (its settings, store and simulator); :class:`Round`: one round's plan and accumulators;
  :class:`ClientContext`: one client's scope; :class:`Cohort`: stacked clients (``algo.vectorize``);
  :class:`ClientData`: the client store.
- :class:`RoundFaults`: a round's left-out clients (``fed.faults``); :class:`Part`: a part as ``fed.parts`` hands it
  out.
- :class:`FederationView`: the ``fed`` every hook receives, exactly the helpers of docs/round_protocol.md ("Core
  helpers for parts"); :class:`Core`: what the client runners (:mod:`flx.clients`) use besides.

The core (:mod:`flx.federation`), the hooks (:mod:`flx.hooks`), the client runners and every part import these
types from here, never the federation itself, so the import graph has no circle (``tests/test_imports.py``) and a
part that reaches past the door fails a test (``tests/test_context.py``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from flx.server import ServerOptConfig
from flx.state import ClientStateStore
from flx.systems.simulator import LatencySimulator

if TYPE_CHECKING:  # annotations only: none of these imports flx.context
    from flx.aggregation import Aggregator
    from flx.datamodules.client_eval import ClientRows
    from flx.resources import ServerResources
    from flx.round_buffer import RoundBuffer
    from flx.systems.clock import SimClock

T = TypeVar("T")


@dataclass(frozen=True)
class FederationConfig:
    """Round-protocol hyper-parameters (``algo.*``).

    Attributes:
        rounds: communication rounds ``T``.
        clients_per_round: cohort size ``m``.
        local_steps: local minibatch steps ``K`` (ignored when ``local_epochs`` is set).
        local_epochs: if set, ``K = local_epochs * ceil(n_i / batch_size)`` per client.
        lr: local step size ``eta``, its one source: ``fed.local_opt``'s groups start from it, stacked steps read it.
        batch_size: local minibatch size ``B``.
        minibatch: how the ``K`` local minibatches are drawn (:data:`flx.sampling.MINIBATCH_STREAMS`): ``epochs``,
            reshuffled passes over the client's rows (the last batch of a pass short when ``B`` does not divide
            ``n_i``); ``fresh``, ``B`` rows drawn uniformly without replacement at every step, independently across
            steps (all ``n_i`` rows, reshuffled, when ``n_i < B``). Both from ``client.generator``.
        momentum: local SGD momentum (reset for every client).
        weight_decay: local L2 weight decay.
        weighting: aggregation weight ``p_i``: ``num_samples`` (FedAvg, ``n_i``) or ``uniform``.
        duplicates: a client drawn ``k`` times in one cohort (samplers with replacement): ``multiplicity`` trains
            it once with weight ``k p_i``; ``repeat`` runs ``k`` independent local trainings from ``w^t``, each
            with weight ``p_i`` and its own random stream (copy ``j``: ``derive_seed(seed, t, i, j)`` for
            ``j >= 1``, copy 0 keeps ``derive_seed(seed, t, i)``), so the mean is over the ``m`` draws.
        seed: the run seed.
        server: server optimizer parameters.
        fault_policy: a client whose loss or update is not finite is ``drop``-ped from the round (counted, warned)
            or ``stop``-s the run (:class:`ClientFault`).
        diverge_factor: the finite-divergence rule (:class:`flx.faults.DivergenceWatch`): the run stops when the
            round's training loss exceeds this factor times the initial model's loss for ``diverge_rounds``
            consecutive rounds; None switches the rule off.
        diverge_rounds: the consecutive rounds of that rule.
        single_row_batch: ``drop`` a local minibatch of one row (the last of a pass; a client with one row is then
            skipped), ``keep`` it, or ``auto``: drop when the net has BatchNorm layers, which cannot train on one row.
        aggregator: how the round's uploads are combined (:data:`flx.aggregation.AGGREGATORS`): ``mean`` (weighted
            mean, FedAvg), ``count_mean`` (per-entry mean over the clients whose ``client.masks`` cover the entry;
            uncovered entries keep ``w^t``), ``admm_sum`` (``sum_i u_i / sum_i p_i``: uploads added unweighted, the
            weights summed apart, the ADMM server step).
        vectorize: train the rank's clients stacked, with ``torch.func`` (:mod:`flx.vectorized`), instead of one
            after the other; the same result up to summation order.
    """

    rounds: int = 30
    clients_per_round: int = 10
    local_steps: int = 10
    local_epochs: int | None = None
    lr: float = 0.05
    batch_size: int = 32
    minibatch: str = "epochs"
    momentum: float = 0.0
    weight_decay: float = 0.0
    weighting: str = "num_samples"
    duplicates: str = "multiplicity"
    seed: int = 0
    server: ServerOptConfig = field(default_factory=ServerOptConfig)
    fault_policy: str = "drop"
    diverge_factor: float | None = 100.0
    diverge_rounds: int = 2
    single_row_batch: str = "auto"
    aggregator: str = "mean"
    vectorize: bool = False


@dataclass
class FederationSpec:
    """What a run's federation is built from before the net and the process group exist: run.py makes it, the build
    checks its parts (:func:`flx.composition.check`), and the module builds the :class:`Federation` from it when the
    fit starts.

    Attributes:
        cfg: the round-protocol hyper-parameters.
        store: per-client persistent state (in memory by default).
        system: the device / latency simulator (``system=mobile20``; docs/systems.md), or None: ``fed.system``, which
            parts query, and the simulated clock ``fed.clock`` (``sim/round_time``, ``sim/clock``).
        checked: the parts the run's build already checked (:func:`flx.composition.check`); the federation checks
            any other list itself.
    """

    cfg: FederationConfig = field(default_factory=FederationConfig)
    store: ClientStateStore = field(default_factory=ClientStateStore)
    system: LatencySimulator | None = None
    checked: tuple[object, ...] = ()


class Round:
    """What belongs to one round: its plan and its accumulators. :meth:`flx.federation.Federation.begin_round` makes
    it; parts receive it (``rnd``, ``client.round``).

    The plan is written while the round is planned (``sample_clients``, ``on_round_start``, which run alike on every
    rank) and frozen after (:meth:`freeze`): a client hook runs on one rank only, so what every rank must agree on
    cannot change there. Then setting an attribute, or a width, raises.

    Attributes:
        round: the round index ``t`` (0-based).
        rank, world_size: this process and the number of processes.
        cohort: the distinct sampled client ids, sorted.
        shard: the ids this rank trains (an id repeats when ``duplicates=repeat`` gives it copies here).
        slots: the clients of the busiest shard (every rank knows it: the round's length on the slowest rank).
        draws: the times each cohort client was drawn, by id (in cohort order:
            ``tuple(rnd.draws[c] for c in rnd.cohort)``).
        weights: each cohort client's aggregation weight for one draw, ``p_i`` (``n_i``, or 1: ``algo.weighting``).
        seeds: this rank's clients' seeds for their first copy, ``derive_seed(seed, t, i)``.
        copies: this rank's copy numbers of each client, in training order (``duplicates=repeat``; else empty).
        steps: the local steps a part set for a client this round (:meth:`set_steps`); the others take their
            configured work (``fed.client_steps``).
        start_states: the round-start state of the clients with more than one copy (every copy starts from it).
        left_out: the accumulator of this rank's clients left out of the aggregate, ``dropped`` and ``skipped``.
        state_updates: the accumulator of the client states this rank stored (sent to the other ranks at the end).
    """

    def __init__(
        self, round: int, rank: int = 0, world_size: int = 1, check_width: Callable[[float], None] | None = None
    ):
        self.round, self.rank, self.world_size = round, rank, world_size
        self.cohort: tuple[int, ...] = ()
        self.shard: tuple[int, ...] = ()
        self.slots = 0
        self.draws: dict[int, int] = {}
        self.weights: dict[int, float] = {}
        self.seeds: dict[int, int] = {}
        self.copies: dict[int, list[int]] = {}
        self.start_states: dict[int, dict[str, Tensor]] = {}
        self.widths: dict[int, float] = {}
        self.steps: dict[int, int] = {}
        self.left_out: dict[str, list[int]] = {"dropped": [], "skipped": []}
        self.state_updates: dict[int, dict[str, Tensor]] = {}
        self._check_width = check_width
        self._frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"round {self.round} is planned: rnd.{name} is set in sample_clients / on_round_start")
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"Round({self.round}, cohort={self.cohort}, shard={self.shard}, rank={self.rank}/{self.world_size})"

    @property
    def planning(self) -> bool:
        """Whether the plan may still change (before :meth:`freeze`)."""
        return not self._frozen

    def freeze(self) -> None:
        """Ends the planning (after ``on_round_start``): the plan reads the same on every rank from here on."""
        self._frozen = True

    def set_width(self, cid: int, ratio: float) -> None:
        """Records that client ``cid`` trains at width ratio ``ratio`` this round (default 1.0, the full model):
        what the sub-network part trains and what the simulated clock prices (docs/systems.md).

        Only while the round is planned (``sample_clients`` / ``on_round_start``, the same on every rank); with a
        device simulator, ``ratio`` must be one of its profiled widths.
        """
        if self._frozen:
            raise RuntimeError("rnd.set_width is for sample_clients / on_round_start (the same on every rank)")
        if not 0 < ratio <= 1:
            raise ValueError(f"width ratio {ratio!r}: must be in (0, 1]")
        if self._check_width is not None:
            self._check_width(ratio)
        self.widths[int(cid)] = float(ratio)

    def set_steps(self, cid: int, steps: int) -> None:
        """Records that client ``cid`` takes ``steps`` local steps this round, in place of its configured work
        (``fed.client_steps``, which the client runners, the simulated clock and the parts read): heterogeneous local
        work drawn per round (FedNova's). Only while the round is planned (``sample_clients`` / ``on_round_start``, the
        same on every rank); the round's shards were balanced with the configured work."""
        if self._frozen:
            raise RuntimeError("rnd.set_steps is for sample_clients / on_round_start (the same on every rank)")
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"local steps {steps!r}: must be an integer >= 0")
        self.steps[int(cid)] = int(steps)

    def width(self, cid: int) -> float:
        """The width ratio client ``cid`` trains at this round (:meth:`set_width`; 1.0 when none was set)."""
        return self.widths.get(int(cid), 1.0)

    def next_copy(self, cid: int) -> int:
        """The copy number of ``cid``'s next local run on this rank (0 when it has one run, or under
        ``multiplicity``)."""
        mine = self.copies.get(cid)
        return mine.pop(0) if mine else 0


@dataclass
class ClientContext:
    """One client's local-training scope. Parts read it and may set ``weight``, ``state``, ``extras`` and ``masks``.

    ``masks``: 0/1 tensors shaped like ``fed.local_state`` (parameters, then float buffers) saying which entries this
    client holds; the ``count_mean`` aggregator averages each entry over the clients that hold it (None: all).

    ``stands_for``: the cohort draws this local run counts for, the factor of its weight: ``rnd.draws[cid]`` (``k``)
    under ``algo.duplicates=multiplicity`` (one run for ``k`` draws), 1 under ``repeat`` (one run per draw). Not named
    ``draws`` or ``multiplicity``: both would read as the client's count in the cohort (``rnd.draws[cid]``), which
    under ``repeat`` is ``k`` while each run stands for one draw. Parts that scale by the draws read this.
    """

    cid: int
    round: Round
    num_samples: int
    num_steps: int
    weight: float
    generator: torch.Generator
    state: dict[str, Tensor]
    step: int = 0
    batch: tuple[Tensor, Tensor] | None = None
    rows: Tensor | None = None  # the step's row indices into the store (``batch`` is ``x[rows], y[rows]``)
    outputs: Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    stands_for: int = 1  # the draws this run counts for (see above): k (multiplicity) or 1 (repeat)
    copy: int = 0  # which of the client's k runs this is (duplicates=repeat), 0 otherwise
    masks: list[Tensor] | None = None


@dataclass
class Cohort:
    """A group of clients trained together; what ``on_cohort_grad`` / ``on_cohort_step_end`` receive.

    Attributes:
        clients: the clients, in the order of the stacked dimension.
        params: the clients' current parameters, one ``(m, *p.shape)`` tensor per trainable parameter of the net.
        grads: at ``on_cohort_grad``, the step's gradients shaped like ``params`` (edit in place); None otherwise.
        step: the local step ``k`` (0-based).
        rows: the step's minibatch rows, ``(m, B)``: client ``i``'s are ``rows[i, :sizes[i]]`` (the rest pads).
        sizes: the clients' minibatch sizes at this step.
    """

    clients: list[ClientContext]
    params: list[Tensor]
    grads: list[Tensor] | None = None
    step: int = 0
    rows: Tensor | None = None
    sizes: list[int] = field(default_factory=list)

    def local_state(self, fed: FederationView, i: int) -> list[Tensor]:
        """Client ``i``'s upload as the sequential path has it in ``fed.local_state``: its parameters (views into
        :attr:`params`), then the net's float buffers (which no vectorisable net changes in training)."""
        return [p[i] for p in self.params] + [b.detach() for b in fed.float_buffers]


class ClientData:
    """What the federation needs from the data: one tensor store and per-client index views (a sequence of int64
    tensors: a list, or the datamodule's :class:`~flx.datamodules.ragged.Ragged`, which makes a view when asked for);
    the first ``num_train_clients`` clients train, the others are evaluation-only; ``client_support``: each client's
    support rows (few-shot tasks) or ``None`` (``flx.datamodules.datamodule.ClientStore``). ``x`` and ``y`` are
    tensors on the net's device, or :class:`~flx.datamodules.placement.HostRows` for a store kept on the host (indexing
    gives the rows on the net's device; row indices then live on the host: ``index_device``)."""

    x: Tensor
    y: Tensor
    client_indices: Sequence[Tensor]
    num_train_clients: int
    client_support: Sequence[Tensor] | None

    def support_rows(self, cid: int) -> Tensor:
        """Client ``cid``'s support rows (few-shot tasks, ``partition=few_shot``), else all its rows."""
        support = self.client_support
        return self.client_indices[cid] if support is None else support[cid]

    def query_rows(self, cid: int) -> Tensor:
        """Client ``cid``'s query rows: its rows outside the support set (empty without a support/query split)."""
        rows = self.client_indices[cid]
        return rows[~torch.isin(rows, self.support_rows(cid))]


@dataclass(frozen=True)
class RoundFaults:
    """What the round left out, identical on every rank: ``dropped`` (non-finite loss or update) and ``skipped``
    (no usable rows) client ids (``fed.faults``; :func:`flx.faults.judge` makes it)."""

    dropped: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()


class Part(Protocol):
    """A part as the door hands it out (``fed.parts``, ``fed.parts_with``): the hooks that the client runners and the
    evaluation call on it directly (the first-answer hooks go through :func:`flx.hooks.first_answer`).
    :class:`flx.hooks.FederatedCallback` is one (``tests/test_types.py`` asks mypy); :mod:`flx.hooks` imports this
    module, so the door names its parts by this Protocol rather than import it (``tests/test_imports.py``: no circle,
    not even for annotations)."""

    def on_client_start(self, fed: FederationView, client: ClientContext) -> None: ...

    def local_loss(self, fed: FederationView, client: ClientContext, loss: Tensor) -> Tensor: ...

    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None: ...

    def on_local_step_end(self, fed: FederationView, client: ClientContext) -> None: ...

    def on_client_end(self, fed: FederationView, client: ClientContext) -> None: ...

    def on_cohort_grad(self, fed: FederationView, cohort: Cohort) -> None: ...

    def on_cohort_step_end(self, fed: FederationView, cohort: Cohort) -> None: ...

    def personalize(self, fed: FederationView, cid: int) -> AbstractContextManager[object] | None: ...


class Gather(Protocol):
    """The process group's all-gather of a picklable object: every rank's, in rank order."""

    def __call__(self, obj: T, /) -> list[T]: ...


class FederationView(Protocol):
    """The federation as parts see it: the ``fed`` of every hook. Its members are the table "Core helpers for parts"
    of docs/round_protocol.md, and nothing else; ``tests/test_context.py`` fails when a part uses another, and mypy
    (``make lint``, ``tests/test_types.py``) when one uses a member as another type."""

    # settings, the round, the parts
    cfg: FederationConfig
    rnd: Round | None  # the current round (the last one trained between rounds); None before the first
    faults: RoundFaults  # the last round's left-out clients

    @property
    def parts(self) -> Sequence[Part]: ...  # every part, in algo.parts order

    def parts_with(self, hook: str) -> Sequence[Part]: ...

    # the model
    net: nn.Module
    params: list[Tensor]  # the net's trainable parameters
    global_params: list[Tensor]  # w^t, the round-start snapshot
    float_buffers: list[Tensor]
    local_state: list[Tensor]  # params then float buffers: what a client uploads
    global_state: list[Tensor]  # the round-start snapshot of local_state (global_params, then the float buffers')
    local_opt: torch.optim.SGD  # the sequential steps' optimizer (a part may set its groups' lr per round)
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    step_context: Callable[[], AbstractContextManager[object]]

    # the data
    data: ClientData

    @property
    def num_clients(self) -> int: ...

    def num_samples(self, cid: int) -> int: ...

    def client_steps(self, cid: int) -> int: ...

    def client_batches(self, client: ClientContext) -> Iterator[Tensor]: ...

    def batch(self, rows: Tensor) -> tuple[Tensor, Tensor]: ...

    # derivatives and losses at any parameters
    def grad_at(self, params: Sequence[Tensor], rows: Tensor, create_graph: bool = False) -> list[Tensor]: ...

    def value_and_grad_at(self, params: Sequence[Tensor], rows: Tensor) -> tuple[Tensor, list[Tensor]]: ...

    def hvp(
        self,
        v: Sequence[Tensor],
        rows: Tensor,
        mode: str = "exact",
        params: Sequence[Tensor] | None = None,
        eps: float | Tensor | None = None,
    ) -> list[Tensor]: ...

    def eval_loss(self, rows: Tensor, chunk: int = 4096) -> float: ...

    def eval_loss_tensor(self, rows: Tensor, chunk: int = 4096) -> Tensor: ...

    # statistics and collectives
    rank: int
    world_size: int
    gather: Gather | None  # only called when world_size > 1
    aggregator: Aggregator  # total_weight: the round's weight sum

    def register_stat(self, name: str, like: Tensor | Sequence[Tensor]) -> None: ...

    def stat(self, name: str) -> Tensor | list[Tensor]: ...

    @property
    def train_loss(self) -> float | None: ...

    def update_norm(self, step: int) -> float | None: ...  # server step's ||mean - w^t||, before on_server_step

    def all_reduce_(self, t: Tensor) -> Tensor: ...  # in place: the sum over the processes (one process: t as is)

    def broadcast(self, obj: T) -> T: ...

    def on_server(self, fn: Callable[[], T]) -> T: ...

    # personalised evaluation
    def personalize(self, cid: int) -> AbstractContextManager[None]: ...

    def evaluate_clients(self, data: ClientRows, metric: Callable[[Tensor, Tensor], Tensor]) -> Tensor: ...

    # the system, the state
    system: LatencySimulator | None
    clock: SimClock | None  # the simulated clock (with a system)
    store: ClientStateStore  # per-client state
    resources: ServerResources | None  # rows no client sees, frozen models


class Core(FederationView, Protocol):
    """What the client runners (:mod:`flx.clients`, :mod:`flx.vectorized`) use of the federation besides the parts'
    door: the least rows a client trains on, loading ``w^t`` into the net, and the round's buffer
    (:class:`flx.round_buffer.RoundBuffer`) a client's end adds to."""

    min_rows: int
    buffer: RoundBuffer

    def load_global(self) -> None: ...
