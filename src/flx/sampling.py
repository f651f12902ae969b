"""Seeded draws of the round protocol: seeds per (seed, round, client), the cohort, the shards, the minibatches.

Every random choice of a round is a function of ``(seed, round)`` (the cohort) or ``(seed, round, client)`` (the
client's minibatches and dropout), so a run gives the same model on 1 process or on N.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

SAMPLE_TAG = 0x5A  # distinguishes the cohort stream from client streams in the seed sequence


def derive_seed(*words: int) -> int:
    """A 63-bit seed from integer words (``numpy.random.SeedSequence``): independent streams per tuple."""
    return int(np.random.SeedSequence([int(w) for w in words]).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


def uniform_cohort(num_clients: int, m: int, rng: np.random.Generator) -> list[int]:
    """``m`` distinct clients, uniformly without replacement."""
    return rng.choice(num_clients, size=m, replace=False).tolist()


def shard_greedy(cids: Sequence[int], sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Longest-processing-time greedy split of clients over ranks by sample count (deterministic).

    An id listed ``k`` times (copies of one client) is placed ``k`` times; equal loads spread the copies over ranks.
    """
    loads, shards = [0] * world_size, [[] for _ in range(world_size)]
    for size, cid in sorted(zip(sizes, cids), key=lambda t: (-t[0], t[1])):
        r = min(range(world_size), key=lambda k: (loads[k], k))
        shards[r].append(cid)
        loads[r] += size
    return [sorted(s) for s in shards]


def local_batches(
    indices: Tensor, batch_size: int, steps: int, gen: torch.Generator, min_rows: int = 1
) -> Iterator[Tensor]:
    """``steps`` minibatches of the client's indices, reshuffled each time the client's data is exhausted.

    A pass's last minibatch with fewer than ``min_rows`` rows is left out (``min_rows=2`` for BatchNorm nets); the
    client must hold at least ``min_rows`` rows.
    """
    done, n = 0, len(indices)
    if n < min_rows:
        raise ValueError(f"local_batches: {n} rows, fewer than min_rows={min_rows}")
    while done < steps:
        for batch in indices[torch.randperm(n, generator=gen)].split(batch_size):
            if done == steps:
                return
            if len(batch) < min_rows:
                continue
            done += 1
            yield batch
