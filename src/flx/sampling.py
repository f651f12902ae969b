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


# numpy.random.SeedSequence's hash constants (numpy/random/bit_generator.pyx), for derive_seeds
_MASK32, _XSHIFT = 0xFFFFFFFF, 16
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _POOL = 0xCA01F9DD, 0x4973F715, 4


def _uint32_words(n: int) -> list[int]:
    """``n`` as SeedSequence reads an int: its 32-bit words, least significant first (``[0]`` for 0)."""
    out = [] if n else [0]
    while n > 0:
        out, n = [*out, n & _MASK32], n >> 32
    return out


def derive_seeds(*words: int | np.ndarray) -> np.ndarray:
    """:func:`derive_seed` of many tuples at once: ``derive_seeds(seed, round, cids)[k] == derive_seed(seed, round,
    cids[k])``, bit for bit.

    Each word is an int or an array (the same length for every array word); array entries must lie in
    ``[0, 2**32)`` (one SeedSequence word each). SeedSequence's entropy mixing and ``generate_state`` are computed
    with numpy over the arrays (uint64 arithmetic masked to 32 bits), ~40 array operations in all, instead of one
    SeedSequence (~30 us) per client.
    """
    n = max((len(w) for w in words if isinstance(w, np.ndarray)), default=1)
    entropy: list[np.ndarray] = []
    for w in words:
        if isinstance(w, np.ndarray):
            if len(w) and (w.min() < 0 or w.max() > _MASK32):
                raise ValueError("derive_seeds: array words must lie in [0, 2**32)")
            entropy.append(w.astype(np.uint64))
        else:
            entropy += [np.full(n, v, dtype=np.uint64) for v in _uint32_words(int(w))]
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = (value ^ hash_const) & _MASK32
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = (value * hash_const) & _MASK32
        return value ^ (value >> _XSHIFT)

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = (_MIX_MULT_L * x - _MIX_MULT_R * y) & _MASK32
        return result ^ (result >> _XSHIFT)

    zero = np.zeros(n, dtype=np.uint64)
    pool = [hashmix(entropy[i] if i < len(entropy) else zero) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL, len(entropy)):
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))
    state, hash_b = [], _INIT_B
    for word in pool[:2]:  # generate_state(2, uint32), read as one little-endian uint64
        value = word ^ hash_b
        hash_b = (hash_b * _MULT_B) & _MASK32
        value = (value * hash_b) & _MASK32
        state.append(value ^ (value >> _XSHIFT))
    return (((state[1] << np.uint64(32)) | state[0]) >> np.uint64(1)).astype(np.int64)


def uniform_cohort(num_clients: int, m: int, rng: np.random.Generator) -> list[int]:
    """``m`` distinct clients, uniformly without replacement."""
    return rng.choice(num_clients, size=m, replace=False).tolist()


def shard_greedy(cids: Sequence[int], sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Longest-processing-time greedy split of clients over ranks by their costs ``sizes`` (deterministic).

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
