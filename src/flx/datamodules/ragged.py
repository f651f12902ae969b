"""Per-client index arrays stored back to back: one flat array and an offsets array (CSR).

A partition of a million clients as a million numpy arrays costs ~100 bytes of array header per client and per
split (train, test, support), and as torch tensors several hundred more; a :class:`Ragged` costs 8 bytes per client
(its offset) on top of the rows themselves. Client ``c``'s rows are a view, made when asked for: the federation asks
only for the clients a round samples.

A :class:`Ragged` reads like the list of arrays it replaces: ``len(r)``, ``r[c]`` (a view, numpy or torch as the
flat array is), iteration, ``r[a:b]`` and ``r + other`` (lists, as a list's slice and sum are); ``r.sizes()`` gives
every client's row count as one array, ``r.size(c)`` one client's.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

# torch is imported only where a tensor is made: the config check (flx.config.precheck) builds partitioners, and
# under trainer=ddp the other ranks start only after it, so it must not pay torch's import (~1.5 s)
A = TypeVar("A", np.ndarray, "Tensor")


def _is_tensor(values: Any) -> bool:
    """Whether ``values`` is a torch tensor (without importing torch: none exists before torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(values, torch.Tensor)


class Ragged(Sequence[A], Generic[A]):
    """``len(offsets) - 1`` arrays back to back: item ``c`` is ``values[offsets[c]:offsets[c + 1]]`` (a view).

    Args:
        values: ``(N,)`` the arrays' entries, client-major: an int64 numpy array or torch tensor.
        offsets: ``(C + 1,)`` int64, ``offsets[0] == 0``, non-decreasing, ``offsets[-1] == N``.
    """

    __slots__ = ("offsets", "values")

    def __init__(self, values: A, offsets: np.ndarray) -> None:
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or not len(offsets) or offsets[0] != 0 or offsets[-1] != len(values):
            raise ValueError(f"offsets must run from 0 to len(values) = {len(values)}")
        if len(offsets) > 1 and (np.diff(offsets) < 0).any():
            raise ValueError("offsets must be non-decreasing")
        self.values, self.offsets = values, offsets

    @classmethod
    def from_sizes(cls, values: A, sizes: np.ndarray | Sequence[int]) -> Ragged[A]:
        """Consecutive runs of ``values`` of lengths ``sizes``."""
        return cls(values, np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]))

    @classmethod
    def from_arrays(cls, arrays: Iterable[Any]) -> Ragged[np.ndarray]:
        """The int64 concatenation of ``arrays`` (array-likes, e.g. lists of ints)."""
        parts = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
        values = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return cls.from_sizes(values, [len(p) for p in parts])

    @classmethod
    def empty(cls, num: int) -> Ragged[np.ndarray]:
        """``num`` empty int64 arrays."""
        return cls(np.empty(0, dtype=np.int64), np.zeros(num + 1, dtype=np.int64))

    def sizes(self) -> np.ndarray:
        """``(C,)`` int64: each array's length."""
        return np.diff(self.offsets)

    def size(self, index: int) -> int:
        """The length of array ``index`` (``len(self[index])`` without making the view)."""
        if not 0 <= index < len(self.offsets) - 1:
            raise IndexError(f"index {index} out of range for {len(self)} arrays")
        return int(self.offsets[index + 1] - self.offsets[index])

    def owners(self) -> np.ndarray:
        """``(N,)`` int64: the array (client) each entry of ``values`` belongs to."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.sizes())

    def sorted(self) -> Ragged[np.ndarray]:
        """Each array sorted ascending (numpy values, non-negative): one sort of ``owner * M + value`` keys."""
        if not len(self.values):
            return Ragged(np.asarray(self.values, dtype=np.int64), self.offsets)
        scale = int(self.values.max()) + 1
        base = self.owners() * scale
        return Ragged(np.sort(base + self.values) - base, self.offsets)

    def torch(self) -> Ragged[Tensor]:
        """The same arrays as int64 tensors (sharing the numpy values' memory where they are int64)."""
        import torch

        values = self.values if _is_tensor(self.values) else torch.from_numpy(self.values)
        return Ragged(values.long(), self.offsets)

    def to(self, device: Any) -> Ragged[Tensor]:
        """The same arrays as int64 tensors on ``device`` (one copy of the flat values; the offsets stay on the host,
        so a client's row count never reads the device)."""
        return Ragged(self.torch().values.to(device), self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> A: ...

    @overload
    def __getitem__(self, index: slice) -> list[A]: ...

    def __getitem__(self, index: int | slice) -> A | list[A]:
        if isinstance(index, slice):
            return [self[c] for c in range(*index.indices(len(self)))]
        n = len(self)
        c = int(index) + n if index < 0 else int(index)
        if not 0 <= c < n:
            raise IndexError(f"index {index} out of range for {n} arrays")
        return self.values[int(self.offsets[c]) : int(self.offsets[c + 1])]

    def __iter__(self) -> Iterator[A]:
        bounds = self.offsets.tolist()
        return (self.values[a:b] for a, b in zip(bounds[:-1], bounds[1:]))

    def __add__(self, other: Iterable[A]) -> list[A]:
        return [*self, *other]

    def __radd__(self, other: Iterable[A]) -> list[A]:
        return [*other, *self]

    def __repr__(self) -> str:
        kind = "tensor" if _is_tensor(self.values) else "ndarray"
        return f"Ragged({len(self)} {kind} arrays, {len(self.values)} entries)"


def as_ragged(arrays: Ragged[np.ndarray] | Iterable[Any]) -> Ragged[np.ndarray]:
    """``arrays`` as an int64 numpy :class:`Ragged` (a list of arrays is concatenated; a Ragged is kept)."""
    if isinstance(arrays, Ragged) and isinstance(arrays.values, np.ndarray):
        return Ragged(arrays.values.astype(np.int64, copy=False), arrays.offsets)
    if isinstance(arrays, Ragged):
        return Ragged(arrays.values.long().numpy(), arrays.offsets)
    return Ragged.from_arrays(arrays)


def chunk_sizes(n: int, k: int) -> np.ndarray:
    """``(k,)`` the lengths of ``np.array_split(range(n), k)``: ``n mod k`` chunks of ``n // k + 1``, then
    ``n // k``."""
    q, r = divmod(n, k)
    return np.where(np.arange(k) < r, q + 1, q).astype(np.int64)


def chunk_of(position: np.ndarray, n: int, k: int) -> np.ndarray:
    """Which of the ``np.array_split(range(n), k)`` chunks each ``position`` in ``[0, n)`` falls in."""
    q, r = divmod(n, k)
    long_end = r * (q + 1)  # the first r chunks hold q + 1 entries
    return np.where(position < long_end, position // (q + 1), r + (position - long_end) // max(q, 1))
