"""A client's minibatches come from a lazily drawn permutation (flx.sampling.local_batches): a pass draws only the
rows its batches use, so a round costs what its batches cost, not the client's size."""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from scipy import stats

from flx.sampling import LAZY_MAX_FRACTION, LAZY_MIN_ROWS, local_batches, permutation_prefix


def _reshuffled_passes(indices: torch.Tensor, batch_size: int, steps: int, gen: torch.Generator, min_rows: int):
    """The draw of earlier flx versions: a full randperm per pass, its batches, short ones under min_rows skipped."""
    done, n = 0, len(indices)
    while done < steps:
        for batch in indices[torch.randperm(n, generator=gen)].split(batch_size):
            if done == steps:
                return
            if len(batch) < min_rows:
                continue
            done += 1
            yield batch


@pytest.mark.parametrize("min_rows", [1, 2])
def test_small_clients_draw_exactly_as_before(min_rows: int) -> None:
    """Below LAZY_MIN_ROWS rows every pass is one randperm: the same batches, bit for bit, as the full-permutation
    draw of earlier versions, and the generator ends in the same state (the next draw is the same), for clients of 2
    to 8191 rows, batch sizes 2 to 32 and 1 to 50 steps: results and checkpoints of small clients do not change."""
    for n, b, steps in itertools.product([2, 5, 7, 23, 100, LAZY_MIN_ROWS - 1], [2, 3, 10, 32], [1, 3, 5, 50]):
        rows = torch.arange(1000, 1000 + n)
        g_old, g_new = torch.Generator().manual_seed(n * 7 + b), torch.Generator().manual_seed(n * 7 + b)
        old = list(_reshuffled_passes(rows, b, steps, g_old, min_rows))
        new = list(local_batches(rows, b, steps, g_new, min_rows))
        assert len(new) == steps and all(torch.equal(x, y) for x, y in zip(old, new)), (n, b, steps)
        assert torch.equal(torch.rand(3, generator=g_old), torch.rand(3, generator=g_new))


def test_a_huge_client_costs_its_batches_not_its_size() -> None:
    """A client of 10**9 virtual rows (a range, never materialised): 5 batches of 10 are drawn with well under 1 MB of
    memory (a randperm of the client would take 8 GB), all distinct, all inside the client's rows."""
    rows = range(5 * 10**9, 6 * 10**9)
    tracemalloc.start()
    batches = list(local_batches(rows, 10, 5, torch.Generator().manual_seed(0)))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    drawn = torch.cat(batches)
    assert [len(b) for b in batches] == [10] * 5 and peak < 2**20
    assert len(torch.unique(drawn)) == 50 and bool(((drawn >= rows.start) & (drawn < rows.stop)).all())


def test_lazy_passes_never_repeat_a_row_and_reshuffle_after_a_pass() -> None:
    """A lazy pass (client of 2 * LAZY_MIN_ROWS rows, 1/32 of it per pass): no row twice inside a pass; the next call
    with another seed draws other rows; the same seed draws the same rows (deterministic)."""
    n = 2 * LAZY_MIN_ROWS
    rows = torch.arange(n)
    b, steps = 16, n // 32 // 16
    assert steps * b <= n * LAZY_MAX_FRACTION
    first = torch.cat(list(local_batches(rows, b, steps, torch.Generator().manual_seed(1))))
    again = torch.cat(list(local_batches(rows, b, steps, torch.Generator().manual_seed(1))))
    other = torch.cat(list(local_batches(rows, b, steps, torch.Generator().manual_seed(2))))
    assert len(torch.unique(first)) == len(first) == steps * b and torch.equal(first, again)
    assert not torch.equal(first, other)


def test_permutation_prefix_is_uniform() -> None:
    """The first k entries of a uniform permutation of range(n): every ordered position is uniform over the n values
    (chi-square over 20,000 draws, n=12, k=4, p > 1e-3 for each position), and the entries are distinct."""
    n, k, draws = 12, 4, 20000
    gen = torch.Generator().manual_seed(0)
    samples = torch.stack([permutation_prefix(n, k, gen) for _ in range(draws)])
    assert all(len(set(s.tolist())) == k for s in samples[:500])
    for pos in range(k):
        counts = np.bincount(samples[:, pos].numpy(), minlength=n)
        assert stats.chisquare(counts).pvalue > 1e-3, (pos, counts)
    # a pair's joint law too: ordered pairs (first, second) uniform over the n * (n - 1) distinct pairs
    pairs = np.bincount((samples[:, 0] * n + samples[:, 1]).numpy(), minlength=n * n).reshape(n, n)
    off = pairs[~np.eye(n, dtype=bool)]
    assert np.trace(pairs) == 0 and stats.chisquare(off).pvalue > 1e-3


def _drawn(rows: int, gen_seed: int) -> Iterator[int]:
    yield from torch.cat(
        list(local_batches(torch.arange(rows), 8, 4, torch.Generator().manual_seed(gen_seed)))
    ).tolist()


def test_lazy_first_batch_is_uniform_over_a_big_client() -> None:
    """Over 3,000 seeds the rows a lazy pass draws from a 16,384-row client fall uniformly into 16 equal blocks."""
    blocks = np.bincount([r * 16 // (2 * LAZY_MIN_ROWS) for s in range(3000) for r in _drawn(2 * LAZY_MIN_ROWS, s)])
    assert stats.chisquare(blocks).pvalue > 1e-3
