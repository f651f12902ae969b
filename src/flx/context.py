"""The data the round protocol hands to parts: its settings, the round's facts, one client's scope.

These types are shared by the core (:mod:`flx.federation`) and the parts (:mod:`flx.hooks`), so neither has to
import the other to name them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from flx.server import ServerOptConfig


@dataclass(frozen=True)
class FederationConfig:
    """Round-protocol hyper-parameters (``algo.*``).

    Attributes:
        rounds: communication rounds ``T``.
        clients_per_round: cohort size ``m``.
        local_steps: local minibatch steps ``K`` (ignored when ``local_epochs`` is set).
        local_epochs: if set, ``K = local_epochs * ceil(n_i / batch_size)`` per client.
        lr: local step size ``eta``.
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


@dataclass(frozen=True)
class RoundContext:
    """Read-only facts about the current round, handed to parts."""

    round: int
    cohort: tuple[int, ...]  # unique client ids, sorted
    multiplicity: tuple[int, ...]  # times each cohort id was drawn
    shard: tuple[int, ...]  # the ids this rank trains (an id repeats when duplicates=repeat gives it copies here)
    rank: int
    world_size: int
    slots: int  # clients in the busiest shard (every rank knows it: the round's length on the slowest rank)


@dataclass
class ClientContext:
    """One client's local-training scope. Parts read it and may set ``weight``, ``state``, ``extras`` and ``masks``.

    ``masks``: 0/1 tensors shaped like ``fed.local_state`` (parameters, then float buffers) saying which entries this
    client holds; the ``count_mean`` aggregator averages each entry over the clients that hold it (None: all).
    """

    cid: int
    round: RoundContext
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
    draws: int = 1  # cohort draws this local run stands for (its weight's factor): k (multiplicity) or 1 (repeat)
    copy: int = 0  # which of the client's k runs this is (duplicates=repeat), 0 otherwise
    masks: list[Tensor] | None = None


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
