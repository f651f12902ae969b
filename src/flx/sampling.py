"""Seeded draws of the round protocol: seeds per (seed, round, client), the cohort, the shards, the minibatches.

Every random choice of a round is a function of ``(seed, round)`` (the cohort) or ``(seed, round, client)`` (the
client's minibatches and dropout), so a run gives the same model on 1 process or on N.

A client's ``K`` local minibatches come from one of two streams (``algo.minibatch``, :data:`MINIBATCH_STREAMS`):
``epochs`` (:func:`local_batches`, reshuffled passes over the rows: with 128 rows and ``B = 50``, batches of 50, 50,
28, 50, 50, 28, ...) or ``fresh`` (:func:`fresh_batches`, ``B`` rows drawn anew without replacement at every step, the
"sample a minibatch of size ``B``" of the pFedFBE, pFedMe, Ditto and FedMiD/FedDualAvg algorithms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from flx import choices

SAMPLE_TAG = 0x5A  # distinguishes the cohort stream from client streams in the seed sequence


def derive_seed(*words: int) -> int:
    """A 63-bit seed from integer words (``numpy.random.SeedSequence``): independent streams per tuple."""
    return int(np.random.SeedSequence([int(w) for w in words]).generate_state(2, np.uint32).view(np.uint64)[0] >> 1)


# numpy.random.SeedSequence's hash constants (numpy/random/bit_generator.pyx), for derive_seeds
_MASK32, _XSHIFT = 0xFFFFFFFF, 16
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _POOL = 0xCA01F9DD, 0x4973F715, 4
NUMPY_FROM = 16
"""Below this many tuples :func:`derive_seeds` makes one SeedSequence per tuple: cheaper than its numpy path's ~40
array operations (docs/performance.md#costs-behind-the-codes-choices)."""


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
    ``[0, 2**32)`` (one SeedSequence word each). From :data:`NUMPY_FROM` tuples on, SeedSequence's entropy mixing and
    ``generate_state`` are computed with numpy over the arrays (uint64 arithmetic masked to 32 bits), ~40 array
    operations in all, instead of one SeedSequence per tuple; fewer tuples get one SeedSequence each.
    """
    n = max((len(w) for w in words if isinstance(w, np.ndarray)), default=1)
    for w in words:
        if isinstance(w, np.ndarray) and len(w) and (w.min() < 0 or w.max() > _MASK32):
            raise ValueError("derive_seeds: array words must lie in [0, 2**32)")
    if n < NUMPY_FROM:  # one SeedSequence each: cheaper than the ~40 array operations below for a few tuples
        lanes = [w.tolist() if isinstance(w, np.ndarray) else [w] * n for w in words]
        return np.array([derive_seed(*t) for t in zip(*lanes)], dtype=np.int64).reshape(n)
    entropy: list[np.ndarray] = []
    for w in words:
        if isinstance(w, np.ndarray):
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


def number_copies(shards: Sequence[Sequence[int]], rank: int) -> tuple[dict[int, list[int]], set[int]]:
    """The copies of each client (an id placed more than once: ``duplicates=repeat``) numbered over the ranks in rank
    order, the same on every rank. Returns ``rank``'s copy numbers per client, in its shard's order, and the ids with
    more than one copy (which all start from the client's round-start state)."""
    seen: dict[int, int] = {}
    mine: dict[int, list[int]] = {}
    for r, shard in enumerate(shards):
        for cid in shard:
            j = seen[cid] = seen.get(cid, -1) + 1
            if r == rank:
                mine.setdefault(cid, []).append(j)
    return mine, {cid for cid, last in seen.items() if last > 0}


LAZY_MIN_ROWS = 8192
"""Clients with fewer rows always draw each pass as one ``torch.randperm`` (today's exact draw, bitwise)."""
LAZY_MAX_FRACTION = 1 / 16
"""A pass of a client with at least :data:`LAZY_MIN_ROWS` rows that needs at most this fraction of its rows draws only
those rows (:func:`permutation_prefix`); otherwise the whole ``randperm``. Both give the same distribution; the
constants only pick the cheaper one: a ``randperm`` costs in proportion to the client's rows, the lazy draw a fixed
start plus a sort of the drawn rows, and the lazy draw wins from about these values on (the timings:
docs/performance.md#costs-behind-the-codes-choices)."""


class RowsLike(Protocol):
    """What :func:`local_batches` needs of a client's rows: their number and a gather by positions."""

    def __len__(self) -> int: ...

    def __getitem__(self, positions: Tensor) -> Tensor: ...


Rows = Tensor | range | RowsLike
"""A client's rows: a 1-D int64 tensor, a ``range`` (virtual rows, never materialised) or any object with ``len()``
whose ``[positions]`` (an int64 tensor of positions) gives the rows at those positions."""


def take(rows: Rows, positions: Tensor) -> Tensor:
    """``rows[positions]``; a ``range`` is computed (``start + step * positions``), never materialised.

    ``positions`` are drawn on the host (a CPU generator); rows held on a device (the store's, docs/loop.md "Devices")
    get them in one copy per pass, so the minibatches are slices of a device tensor and a step copies nothing.
    """
    if isinstance(rows, range):
        return rows.start + rows.step * positions
    if isinstance(rows, Tensor) and rows.device != positions.device:
        positions = positions.to(rows.device, non_blocking=True)
    return rows[positions]


def permutation_prefix(n: int, k: int, gen: torch.Generator) -> Tensor:
    """The first ``k`` entries of a uniformly random permutation of ``range(n)``, in ``O(k log k)`` time and memory.

    Draws i.i.d. uniform positions and keeps each position's first occurrence, in draw order, until ``k`` distinct
    positions are drawn: given the first ``j``, the next new position is uniform over the ``n - j`` unseen ones, which
    is the law of a permutation's first ``k`` entries (sequential sampling without replacement). Chunk sizes only
    change how many draws are consumed, not the law. Expected draws: about ``k + k**2 / (2 n)``.
    """
    out = torch.empty(0, dtype=torch.long)
    while len(out) < k:
        miss = k - len(out)
        out = torch.cat([out, torch.randint(n, (miss + miss * k // max(n - k, 1) + 1,), generator=gen)])
        value, at = torch.sort(out, stable=True)  # equal values in draw order: the first of each run is kept
        later = at[1:][value[1:] == value[:-1]]
        if len(later):
            keep = torch.ones(len(out), dtype=torch.bool)
            keep[later] = False
            out = out[keep]
    return out[:k]


def _pass_positions(n: int, need: int, gen: torch.Generator) -> Tensor:
    """Positions of one pass: the first ``need`` of a fresh uniform permutation of ``range(n)`` (all ``n`` drawn by
    ``randperm`` unless the pass is lazy, see :data:`LAZY_MAX_FRACTION`)."""
    if n >= LAZY_MIN_ROWS and need <= n * LAZY_MAX_FRACTION:
        return permutation_prefix(n, need, gen)
    return torch.randperm(n, generator=gen)[:need]


def local_batches(
    indices: Rows, batch_size: int, steps: int, gen: torch.Generator, min_rows: int = 1
) -> Iterator[Tensor]:
    """``steps`` minibatches of the client's rows: passes over them, each a fresh uniformly random permutation cut into
    batches of ``batch_size``, reshuffled each time the rows run out.

    A pass's last minibatch with fewer than ``min_rows`` rows is left out (``min_rows=2`` for BatchNorm nets); the
    client must hold at least ``min_rows`` rows. A pass draws only the rows its batches use: one ``randperm`` of the
    client, or, for a client of at least :data:`LAZY_MIN_ROWS` rows whose pass uses at most
    :data:`LAZY_MAX_FRACTION` of them, that prefix of a permutation alone (:func:`permutation_prefix`), so the cost
    is that of the batches, not of the client. Clients below :data:`LAZY_MIN_ROWS` rows get exactly the batches of
    ``indices[randperm(n)].split(batch_size)`` of earlier flx versions. Every draw comes from ``gen``.

    Args:
        indices: the client's rows (:data:`Rows`: a tensor, a ``range``, or a gather-by-positions object).
        batch_size: rows per minibatch.
        steps: minibatches to yield.
        gen: the client's generator (seeded per (seed, round, client) by the caller).
        min_rows: the least rows of a pass's last, short minibatch.
    """
    n = len(indices)
    if n < max(min_rows, 1):
        raise ValueError(f"local_batches: {n} rows, fewer than min_rows={min_rows}")
    short = n % batch_size
    per_pass = n // batch_size + (short >= max(min_rows, 1))  # the minibatches one pass yields
    while steps > 0:
        used = min(steps, per_pass)
        need = n if used == per_pass else used * batch_size  # a partly used pass uses full batches only
        yield from take(indices, _pass_positions(n, need, gen)).split(batch_size)[:used]
        steps -= used


def fresh_rows(indices: Rows, size: int, gen: torch.Generator) -> Tensor:
    """``min(size, n)`` of the client's ``n`` rows drawn uniformly without replacement, in random order: the first
    ``min(size, n)`` entries of a fresh uniform permutation (one ``randperm``, or :func:`permutation_prefix` for a
    client of at least :data:`LAZY_MIN_ROWS` rows when ``size`` is at most :data:`LAZY_MAX_FRACTION` of them, so a draw
    costs its rows, not the client's). ``size >= n`` gives all ``n`` rows in a fresh random order. Every draw comes
    from ``gen``."""
    n = len(indices)
    return take(indices, _pass_positions(n, min(size, n), gen))


def fresh_batches(
    indices: Rows, batch_size: int, steps: int, gen: torch.Generator, min_rows: int = 1
) -> Iterator[Tensor]:
    """``steps`` minibatches of the client's rows, each ``batch_size`` rows drawn uniformly without replacement
    (:func:`fresh_rows`), independently of the other steps: a row can appear in consecutive steps, and each step's
    rows are distinct. A client with fewer than ``batch_size`` rows gets all its rows at every step, each time in a
    fresh random order.

    No minibatch is short, so ``min_rows`` only asks the client to hold that many rows (as :func:`local_batches`
    does; the federation skips smaller clients). Arguments as for :func:`local_batches`.
    """
    n = len(indices)
    if n < max(min_rows, 1):
        raise ValueError(f"fresh_batches: {n} rows, fewer than min_rows={min_rows}")
    for _ in range(steps):
        yield fresh_rows(indices, batch_size, gen)


BatchStream = Callable[[Rows, int, int, torch.Generator, int], Iterator[Tensor]]
"""``stream(indices, batch_size, steps, gen, min_rows)``: a client's ``steps`` minibatches (row indices)."""
MINIBATCH_STREAMS: dict[str, BatchStream] = dict(zip(choices.MINIBATCH, (local_batches, fresh_batches), strict=True))
"""``algo.minibatch``: how a client's local minibatches are drawn (:func:`local_batches`, :func:`fresh_batches`); the
names are :data:`flx.choices.MINIBATCH`."""
