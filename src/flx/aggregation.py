"""Aggregators: what the round's uploads become, accumulated in one preallocated flat buffer, one collective a round.

Shaped like torchmetrics metrics: declared state (a flat buffer), ``update`` once per client, ``sync`` once per round
(a single all-reduce over the whole flat buffer), ``compute`` once. The buffer ends with ``extra`` scalars that the
federation lends to its counters and to the parts' registered statistics, so they ride in the same collective.
``algo.aggregator`` picks one of :data:`AGGREGATORS`:

.. math::
    \\bar w = \\frac{\\sum_{i \\in P} p_i w_i}{\\sum_{i \\in P} p_i}
    \\qquad\\text{(weighted mean, FedAvg: } p_i = n_i)

    \\bar w[k] = \\frac{\\sum_{i:\\,k \\in I_i} w_i[k]}{|\\{i : k \\in I_i\\}|}
    \\qquad\\text{(count mean over index sets } I_i\\text{; entries no client touched keep their old value)}

    \\bar w = \\frac{\\sum_{i \\in P} u_i}{\\sum_{i \\in P} p_i}
    \\qquad\\text{(ADMM server sum: } u_i = y_i + \\rho_i \\theta_i,\\ p_i = \\rho_i
    \\text{; AugFL Eq. 13 without } \\lambda G\\text{)}
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor

from flx import choices

ReduceFn = Callable[[Tensor], Tensor]


def flat_views(flat: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Views into ``flat`` with the shapes of ``like`` (in order)."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


def numel(tensors: Iterable[Tensor]) -> int:
    """The entries of ``tensors`` together: the length of their flat vector (of the model's, for ``fed.params``)."""
    return sum(t.numel() for t in tensors)


def buffer_dtype(like: Sequence[Tensor]) -> torch.dtype:
    """fp32 accumulation, or fp64 when the model itself is fp64."""
    return torch.float64 if any(t.dtype == torch.float64 for t in like) else torch.float32


class _FlatBuffer:
    """``regions`` tensor-list views plus ``extra`` scalars in one zero-initialised flat buffer."""

    def __init__(self, like: Sequence[Tensor], regions: int, extra: int, dtype: torch.dtype | None) -> None:
        n = numel(like)
        device = like[0].device if like else torch.device("cpu")
        self._flat = torch.zeros(regions * n + extra, dtype=dtype or buffer_dtype(like), device=device)
        self._regions = [flat_views(self._flat[k * n : (k + 1) * n], like) for k in range(regions)]
        self.extra = self._flat[regions * n :]

    def reset(self, expected_weight: float = 1.0) -> None:
        """Zeroes the buffer at a round start; ``expected_weight`` is the round's total weight if every client
        contributes (the weighted mean adds its weights pre-divided by it)."""
        self._flat.zero_()

    def sync(self, reduce_sum: ReduceFn | None) -> None:
        """One collective: all-reduce (sum) the whole buffer across ranks."""
        if reduce_sum is not None:
            self._flat.copy_(reduce_sum(self._flat))


class WeightedMean(_FlatBuffer):
    """Weighted mean of a list of tensors over clients (``algo.aggregator=mean``).

    Weights are added pre-divided by the round's expected total (``reset(expected_weight)``), so the sums stay near 1
    and a single client's "mean" is its model exactly.

    Args:
        like: tensors giving the shapes (and device) of what clients contribute.
        extra: number of scalars (``self.extra``) summed over ranks in the same collective.
        dtype: the buffer's dtype (default: fp32, or fp64 when a ``like`` tensor is fp64).
    """

    def __init__(self, like: Sequence[Tensor], extra: int = 0, dtype: torch.dtype | None = None) -> None:
        # layout: [sums | weight sum | extra]
        super().__init__(like, 1, 1 + extra, dtype)
        self._sums, self._weight, self.extra = self._regions[0], self.extra[:1], self.extra[1:]
        self._scale = 1.0

    def reset(self, expected_weight: float = 1.0) -> None:
        super().reset()
        self._scale = 1.0 / expected_weight if expected_weight > 0 else 1.0

    def update(self, tensors: Sequence[Tensor], weight: float, masks: Sequence[Tensor] | None = None) -> None:
        """Adds ``weight * tensors`` to the sums."""
        if masks is not None:
            raise ValueError("client.masks need algo.aggregator=count_mean (the weighted mean averages every entry)")
        w = float(weight) * self._scale
        torch._foreach_add_(self._sums, [t.detach() for t in tensors], alpha=w)
        self._weight += w

    @property
    def total_weight(self) -> float:
        """The weight sum (pre-divided by the expected weight: 1 when every client contributed as expected)."""
        return float(self._weight)

    def compute(self, previous: Sequence[Tensor] = ()) -> list[Tensor]:
        """The weighted means (views into the buffer; valid until the next ``reset``)."""
        total = self._weight[0]
        if float(total) <= 0:
            name = type(self).__name__
            raise RuntimeError(f"{name}.compute() with zero total weight: no client contributed this round")
        torch._foreach_div_(self._sums, total)
        return self._sums


class CountMean(_FlatBuffer):
    """Per-entry mean over the clients whose 0/1 mask covers the entry (``algo.aggregator=count_mean``).

    A client contributes ``tensors`` with ``masks`` of the same shapes (None: every entry); an entry is the mean of
    the contributions of the clients whose mask covers it, and keeps ``previous`` where no mask does. Unweighted
    (WHALE-FL Eq. 1, HeteroFL), or weighted by the clients' weights with ``weighted=True``. Sums and counts live in
    one flat buffer, so ``sync`` is still one collective.
    """

    def __init__(
        self, like: Sequence[Tensor], extra: int = 0, dtype: torch.dtype | None = None, weighted: bool = False
    ) -> None:
        super().__init__(like, 2, extra, dtype)
        self._sums, self._counts = self._regions
        self.weighted = weighted

    def update(self, tensors: Sequence[Tensor], weight: float = 1.0, masks: Sequence[Tensor] | None = None) -> None:
        w = float(weight) if self.weighted else 1.0
        tensors = [t.detach() for t in tensors]
        if masks is None:
            torch._foreach_add_(self._sums, tensors, alpha=w)
            torch._foreach_add_(self._counts, w)
            return
        masks = [m.to(s.dtype) for m, s in zip(masks, self._sums)]
        torch._foreach_add_(self._sums, torch._foreach_mul(tensors, masks), alpha=w)
        torch._foreach_add_(self._counts, masks, alpha=w)

    def compute(self, previous: Sequence[Tensor]) -> list[Tensor]:
        out = []
        for s, c, prev in zip(self._sums, self._counts, previous):
            out.append(torch.where(c > 0, s / c.clamp_min(torch.finfo(s.dtype).tiny), prev.to(s.dtype)))
        return out


class AdmmSum(WeightedMean):
    """``sum_i u_i / sum_i p_i``: uploads added unweighted, weights summed apart (``algo.aggregator=admm_sum``).

    The ADMM server step of AugFL (Eq. 13): a client uploads ``u_i = y_i + rho_i theta_i`` with weight ``rho_i``; a
    part subtracts ``lambda G / sum rho`` in ``on_server_step`` (``total_weight`` is ``sum rho``, not pre-divided).
    """

    def reset(self, expected_weight: float = 1.0) -> None:
        super().reset()  # the weights are not pre-divided: total_weight is the plain sum of the rho_i

    def update(self, tensors: Sequence[Tensor], weight: float, masks: Sequence[Tensor] | None = None) -> None:
        if masks is not None:
            raise ValueError("client.masks need algo.aggregator=count_mean")
        torch._foreach_add_(self._sums, [t.detach() for t in tensors])
        self._weight += float(weight)


Aggregator = WeightedMean | CountMean | AdmmSum
AGGREGATORS: dict[str, type[Aggregator]] = dict(
    zip(choices.AGGREGATORS, (WeightedMean, CountMean, AdmmSum), strict=True)
)
"""``algo.aggregator``: the names are :data:`flx.choices.AGGREGATORS` (the pre-run check reads them there)."""


class RoundStats:
    """Named scalars and tensors that ride in the round's one all-reduce, in the ``extra`` part of its buffer.

    The first ``len(counters)`` scalars are the federation's counters; then each registered statistic, in
    registration order. Register everything first, then :meth:`bind` the buffer's ``extra`` once.
    """

    def __init__(self, counters: Sequence[str]) -> None:
        self.counter_names = tuple(counters)
        self._like: dict[str, Tensor | list[Tensor]] = {}
        self._views: dict[str, Tensor | list[Tensor]] = {}
        self.bound = False

    def register(self, name: str, like: Tensor | Sequence[Tensor]) -> None:
        if self.bound:
            raise RuntimeError(f"register_stat({name!r}): call it in on_attach, before the round buffer exists")
        if name in self._like:
            raise ValueError(f"register_stat({name!r}): a statistic of that name is already registered")
        self._like[name] = like if isinstance(like, Tensor) else list(like)

    def likes(self) -> list[Tensor]:
        """Every registered tensor, in layout order."""
        return [t for v in self._like.values() for t in ([v] if isinstance(v, Tensor) else v)]

    def numel(self) -> int:
        """Scalars needed in ``extra``: the counters and every statistic."""
        return len(self.counter_names) + numel(self.likes())

    def bind(self, extra: Tensor) -> Tensor:
        """Lays the statistics out in ``extra`` and returns the counters' view."""
        views = iter(flat_views(extra[len(self.counter_names) :], self.likes()))
        for name, like in self._like.items():
            self._views[name] = next(views) if isinstance(like, Tensor) else [next(views) for _ in like]
        self.bound = True
        return extra[: len(self.counter_names)]

    def __getitem__(self, name: str) -> Tensor | list[Tensor]:
        return self._views[name]
