"""Aggregators: weighted sums in one preallocated flat buffer, reduced with one collective per round.

Shaped like torchmetrics metrics: declared state (a flat sum buffer and a weight), ``update`` once per
client, ``sync`` once per round (a single all-reduce over the whole flat buffer), ``compute`` once.

.. math::
    \\bar w = \\frac{\\sum_{i \\in P} p_i w_i}{\\sum_{i \\in P} p_i}
    \\qquad\\text{(weighted mean, FedAvg: } p_i = n_i)

    \\bar w[k] = \\frac{\\sum_{i:\\,k \\in I_i} w_i[k]}{|\\{i : k \\in I_i\\}|}
    \\qquad\\text{(count mean over index sets } I_i\\text{; entries no client touched keep their old value)}
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

ReduceFn = Callable[[Tensor], Tensor]


def flat_views(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views into ``flat`` with the shapes of ``like`` (in order)."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


def buffer_dtype(like: Sequence[Tensor]) -> torch.dtype:
    """fp32 accumulation, or fp64 when the model itself is fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in like) else torch.float32


class WeightedMean:
    """Weighted mean of a list of tensors over clients, accumulated in one flat buffer.

    Args:
        like: tensors giving the shapes (and device) of what clients contribute.
        extra: number of scalar counters (``self.extra``) summed over ranks in the same collective.
    """

    def __init__(self, like: Sequence[Tensor], extra: int = 0) -> None:
        numel = sum(t.numel() for t in like)
        device = like[0].device if like else torch.device("cpu")
        # layout: [sums | weight sum | extra counters]
        self._flat = torch.zeros(numel + 1 + extra, dtype=buffer_dtype(like), device=device)
        self._sums = flat_views(self._flat[:numel], like)
        self._weight = self._flat[numel : numel + 1]
        self.extra = self._flat[numel + 1 :]

    def reset(self) -> None:
        self._flat.zero_()

    def update(self, tensors: Sequence[Tensor], weight: float) -> None:
        """Adds ``weight * tensors`` to the sums."""
        torch._foreach_add_(self._sums, [t.detach() for t in tensors], alpha=float(weight))
        self._weight += weight

    def sync(self, reduce_sum: ReduceFn | None) -> None:
        """One collective: all-reduce (sum) the whole buffer across ranks."""
        if reduce_sum is not None:
            self._flat.copy_(reduce_sum(self._flat))

    @property
    def total_weight(self) -> float:
        return float(self._weight)

    def compute(self) -> list[Tensor]:
        """The weighted means (views into the buffer; valid until the next ``reset``)."""
        total = self._weight[0]
        if float(total) <= 0:
            raise RuntimeError("WeightedMean.compute() with zero total weight: no client contributed this round")
        torch._foreach_div_(self._sums, total)
        return self._sums


class CountMean:
    """Per-entry mean over the clients whose index set covers the entry (count-averaging).

    A client contributes ``tensors`` with 0/1 ``masks`` of the same shapes; an entry is the mean of the
    contributions of the clients whose mask covers it, and keeps ``previous`` where no mask does.
    Sums and counts live in one flat buffer, so ``sync`` is still one collective.
    """

    def __init__(self, like: Sequence[Tensor]) -> None:
        numel = sum(t.numel() for t in like)
        device = like[0].device if like else torch.device("cpu")
        self._flat = torch.zeros(2 * numel, dtype=buffer_dtype(like), device=device)
        self._sums = flat_views(self._flat[:numel], like)
        self._counts = flat_views(self._flat[numel:], like)

    def reset(self) -> None:
        self._flat.zero_()

    def update(self, tensors: Sequence[Tensor], masks: Sequence[Tensor]) -> None:
        torch._foreach_add_(self._sums, torch._foreach_mul([t.detach() for t in tensors], list(masks)))
        torch._foreach_add_(self._counts, list(masks))

    def sync(self, reduce_sum: ReduceFn | None) -> None:
        if reduce_sum is not None:
            self._flat.copy_(reduce_sum(self._flat))

    def compute(self, previous: Sequence[Tensor]) -> list[Tensor]:
        out = []
        for s, c, prev in zip(self._sums, self._counts, previous):
            out.append(torch.where(c > 0, s / c.clamp_min(1), prev.to(s.dtype)))
        return out
