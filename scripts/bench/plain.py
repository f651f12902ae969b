"""The baseline: FedAvg as a good engineer writes it by hand in plain PyTorch (no Lightning, no flx).

One model instance, one ``torch.optim.SGD`` (no momentum), the global weights copied in per client, minibatches
drawn by indexing the in-memory tensors with a shuffled permutation, the client models summed with weight
``n_i`` and averaged once per round. A net with buffers (BatchNorm) averages its float buffers (running statistics)
with its parameters and restarts every client from the global integer buffers (batch counters), as flx does. It
runs on the net's device (the caller passes the data tensors and client indices there). Only where the randomness
comes from can be swapped:
:class:`OwnRandomness` (one numpy and one torch generator, what the hand-written loop would use; timed) or
:class:`FlxRandomness` (flx's ``(seed, round[, client])`` streams, so that the plain loop draws exactly the
cohorts and minibatches of an flx run and the final models can be compared; untimed check).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flx.sampling import SAMPLE_TAG, derive_seed, local_batches, uniform_cohort


@dataclass(frozen=True)
class FedAvgSpec:
    """The FedAvg hyper-parameters the plain loop runs (read from the same config as the flx run)."""

    rounds: int
    clients_per_round: int
    batch_size: int
    lr: float
    local_steps: int
    local_epochs: int | None
    seed: int

    def steps(self, num_samples: int) -> int:
        """Local steps of a client with ``num_samples`` samples."""
        if self.local_epochs is None:
            return self.local_steps
        return self.local_epochs * -(-num_samples // self.batch_size)


class Randomness(Protocol):
    """Where the plain loop gets its cohorts and minibatch orders from."""

    def cohort(self, round_idx: int, num_clients: int, m: int) -> Sequence[int]: ...

    def batches(self, round_idx: int, cid: int, indices: Tensor, batch_size: int, steps: int) -> Iterator[Tensor]: ...


def minibatches(indices: Tensor, batch_size: int, steps: int, gen: torch.Generator) -> Iterator[Tensor]:
    """``steps`` minibatches of ``indices``: shuffled epochs, a fresh permutation each time the data runs out."""
    done = 0
    while True:
        for batch in indices[torch.randperm(len(indices), generator=gen)].split(batch_size):
            if done == steps:
                return
            done += 1
            yield batch


class OwnRandomness:
    """One numpy generator for cohorts, one torch generator for minibatch orders, seeded once."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.gen = torch.Generator().manual_seed(seed)

    def cohort(self, round_idx: int, num_clients: int, m: int) -> Sequence[int]:
        return self.rng.choice(num_clients, size=m, replace=False).tolist()

    def batches(self, round_idx: int, cid: int, indices: Tensor, batch_size: int, steps: int) -> Iterator[Tensor]:
        return minibatches(indices, batch_size, steps, self.gen)


class FlxRandomness:
    """flx's streams: cohort from ``(seed, round, tag)``, client ``cid``'s batches from ``(seed, round, cid)``.

    The cohort is visited in sorted order, as flx visits its (single-rank) shard.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.gen = torch.Generator()

    def cohort(self, round_idx: int, num_clients: int, m: int) -> Sequence[int]:
        rng = np.random.default_rng(derive_seed(self.seed, round_idx, SAMPLE_TAG))
        return sorted(uniform_cohort(num_clients, m, rng))

    def batches(self, round_idx: int, cid: int, indices: Tensor, batch_size: int, steps: int) -> Iterator[Tensor]:
        self.gen.manual_seed(derive_seed(self.seed, round_idx, cid))
        return local_batches(indices, batch_size, steps, self.gen)


def fedavg(net: nn.Module, x: Tensor, y: Tensor, clients: Sequence[Tensor], spec: FedAvgSpec, rand: Randomness) -> None:
    """Runs ``spec.rounds`` FedAvg rounds; ``net`` ends holding the final global model.

    Args:
        net: the model, holding the initial global weights.
        x: all training inputs (on the model's device).
        y: all training labels.
        clients: each client's row indices into ``x`` / ``y``.
        spec: the hyper-parameters.
        rand: cohorts and minibatch orders.
    """
    buffers = list(net.buffers())
    # averaged: the parameters and float buffers (running statistics); kept at the global: integer buffers (counters)
    params = [*net.parameters(), *(b for b in buffers if b.is_floating_point())]
    kept = [b for b in buffers if not b.is_floating_point()]
    global_params, global_kept = [p.detach().clone() for p in params], [b.detach().clone() for b in kept]
    sums = [torch.zeros_like(p) for p in params]
    opt = torch.optim.SGD(list(net.parameters()), lr=spec.lr)
    net.train()
    for r in range(spec.rounds):
        total = 0
        for s in sums:
            s.zero_()
        for cid in rand.cohort(r, len(clients), spec.clients_per_round):
            idx = clients[cid]
            with torch.no_grad():
                for p, g in zip([*params, *kept], [*global_params, *global_kept]):
                    p.copy_(g)
            for batch in rand.batches(r, cid, idx, spec.batch_size, spec.steps(len(idx))):
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(net(x[batch]), y[batch])
                loss.backward()
                opt.step()
            with torch.no_grad():
                for s, p in zip(sums, params):
                    s.add_(p, alpha=len(idx))
            total += len(idx)
        for g, s in zip(global_params, sums):
            torch.div(s, total, out=g)
    with torch.no_grad():
        for p, g in zip([*params, *kept], [*global_params, *global_kept]):
            p.copy_(g)
