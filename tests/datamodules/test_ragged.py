"""Tests for flx.datamodules.ragged: a Ragged reads like the list of arrays it stores, views share its memory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flx.datamodules.ragged import Ragged, as_ragged, chunk_of, chunk_sizes

ARRAYS = [[3, 1, 2], [], [7], [5, 4], []]


def test_items_are_views_equal_to_the_arrays() -> None:
    r = Ragged.from_arrays(ARRAYS)
    assert len(r) == 5 and r.values.dtype == np.int64 and r.offsets.tolist() == [0, 3, 3, 4, 6, 6]
    assert [a.tolist() for a in r] == ARRAYS == [r[c].tolist() for c in range(len(r))]
    assert all(np.shares_memory(r[c], r.values) for c in (0, 2, 3))
    assert r[-2].tolist() == [5, 4] and r.sizes().tolist() == [3, 0, 1, 2, 0]
    assert r.owners().tolist() == [0, 0, 0, 2, 3, 3]
    for bad in (5, -6):
        with pytest.raises(IndexError):
            r[bad]


def test_slices_and_sums_are_lists_as_for_a_list() -> None:
    r = Ragged.from_arrays(ARRAYS)
    assert isinstance(r[1:4], list) and [a.tolist() for a in r[1:4]] == ARRAYS[1:4]
    assert [a.tolist() for a in r[::-2]] == ARRAYS[::-2]
    both = r + Ragged.from_arrays([[9]])
    assert isinstance(both, list) and [a.tolist() for a in both] == [*ARRAYS, [9]]
    assert [a.tolist() for a in [np.array([8])] + r] == [[8], *ARRAYS]


def test_sorted_sorts_each_array_and_keeps_the_offsets() -> None:
    r = Ragged.from_arrays(ARRAYS).sorted()
    assert [a.tolist() for a in r] == [sorted(a) for a in ARRAYS]
    assert Ragged.empty(3).sorted().sizes().tolist() == [0, 0, 0]


def test_torch_views_share_the_numpy_memory() -> None:
    r = Ragged.from_arrays(ARRAYS)
    t = r.torch()
    assert t.values.dtype == torch.long and t.values.data_ptr() == r.values.ctypes.data
    assert [x.tolist() for x in t] == ARRAYS and isinstance(t[0], torch.Tensor)
    assert torch.cat(list(t)).tolist() == [3, 1, 2, 7, 5, 4]
    back = as_ragged(t)
    assert np.array_equal(back.values, r.values) and np.array_equal(back.offsets, r.offsets)
    assert as_ragged([np.array([2, 1], dtype=np.int32)]).values.dtype == np.int64


@pytest.mark.parametrize("offsets", [[1, 3], [0, 2], [0, 3, 2, 3], []])
def test_offsets_must_cover_the_values(offsets: list[int]) -> None:
    with pytest.raises(ValueError, match="offsets"):
        Ragged(np.arange(3), np.array(offsets))


@pytest.mark.parametrize(("n", "k"), [(10, 3), (3, 10), (12, 4), (1, 1), (0, 2), (1001, 7)])
def test_chunks_are_those_of_array_split(n: int, k: int) -> None:
    chunks = np.array_split(np.arange(n), k)
    assert chunk_sizes(n, k).tolist() == [len(c) for c in chunks]
    owner = np.concatenate([np.full(len(c), i) for i, c in enumerate(chunks)])
    assert chunk_of(np.arange(n), n, k).tolist() == owner.tolist()


def test_size_is_the_length_of_the_view_without_making_it() -> None:
    r = Ragged.from_arrays([[1, 2, 3], [], [4], [5, 6]])
    assert [r.size(c) for c in range(len(r))] == [len(a) for a in r] == [3, 0, 1, 2]
    for bad in (-1, 4):
        with pytest.raises(IndexError):
            r.size(bad)
