"""The round's one collective: the aggregate, the federation's counters and the parts' statistics in one flat buffer.

Layout ``[aggregate | COUNTERS | statistics]`` (the aggregator's sums and weight first, :mod:`flx.aggregation`), in
the widest dtype of the model and the statistics. Every rank adds its clients' shares in place; one all-reduce
(:meth:`RoundBuffer.sync`) sums the whole buffer, so every rank reads the same counters and statistics after it
without a collective of its own (docs/round_protocol.md, step 5).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from flx.aggregation import AGGREGATORS, Aggregator, ReduceFn, RoundStats, buffer_dtype

COUNTERS = ("dropped", "skipped", "aggregated", "loss_count", "loss_sum", "stored", "initial_loss_sum", "initial_rows")
"""The federation's own scalars in the round's all-reduce, before the parts' registered statistics. ``stored`` counts
the clients whose state went to the store, so every rank knows whether the round needs the state all-gather;
``aggregated`` and ``loss_count`` are adjacent, so an aggregated client adds 1 to both in one op; ``initial_*``: the
divergence rule's initial loss, each rank's share of the rows (:func:`flx.faults.reference_rows`), summed in the
first round's reduce."""


class RoundBuffer:
    """The round's flat buffer. Parts register statistics first (``on_attach``); :meth:`allocate` then lays it out
    once for the run; :meth:`reset` zeroes it at every round start."""

    def __init__(self) -> None:
        self.stats = RoundStats(COUNTERS)
        self.counted: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)  # the last round's, read once after its reduce

    def register(self, name: str, like: Tensor | Sequence[Tensor]) -> None:
        """A per-round statistic shaped like ``like`` (:meth:`flx.federation.Federation.register_stat`)."""
        self.stats.register(name, like)

    def allocate(self, local_state: Sequence[Tensor], aggregator: str) -> Aggregator:
        """Lays out the buffer: the ``aggregator``'s sums of tensors like ``local_state``, then :data:`COUNTERS`, then
        the registered statistics. Returns the aggregator."""
        dtype = buffer_dtype(list(local_state) + self.stats.likes())
        self.aggregator = AGGREGATORS[aggregator](list(local_state), extra=self.stats.numel(), dtype=dtype)
        self.counters = self.stats.bind(self.aggregator.extra)
        i = COUNTERS.index("aggregated")
        self._aggregated_and_losses, self._loss_sum = (
            self.counters[i : i + 2],
            self.counters[COUNTERS.index("loss_sum")],
        )
        return self.aggregator

    def add(self, local_state: Sequence[Tensor], weight: float, masks: Sequence[Tensor] | None, loss: Tensor) -> None:
        """An aggregated client: its upload, its weight and its mean loss (two ops for the counters)."""
        self.aggregator.update(local_state, weight, masks)
        self._loss_sum += loss if loss.dtype == self._loss_sum.dtype else loss.to(self._loss_sum.dtype)
        self._aggregated_and_losses += 1

    def count(self, name: str, value: float | Tensor = 1) -> None:
        """Adds ``value`` to the counter ``name`` (this rank's share)."""
        self.counters[COUNTERS.index(name)] += value

    def sync(self, reduce_sum: ReduceFn | None) -> None:
        """The round's one all-reduce (none on one process), then the counters as Python numbers
        (:attr:`counted`): one device-to-host copy for the round."""
        self.aggregator.sync(reduce_sum)
        self.counted = dict(zip(COUNTERS, self.counters.cpu().tolist()))

    @property
    def train_loss(self) -> float | None:
        """The round's mean local training loss over the aggregated clients of every rank (after :meth:`sync`)."""
        n = self.counted["loss_count"]
        return self.counted["loss_sum"] / n if n > 0 else None
