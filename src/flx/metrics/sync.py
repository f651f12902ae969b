"""One collective for the evaluation metrics of N processes, instead of three per metric state.

Each rank evaluates its share of the rows (:class:`~flx.datamodules.datamodule.FederatedDataModule`), so a metric's
states hold that share's sums. torchmetrics syncs a metric when it computes, state by state (a barrier and two
all-gathers each): a split's loss, accuracy and per-client counts are eight states, ~20 collectives an evaluation,
which cost more than evaluating digits' validation rows. The metrics whose states are all sums are built with
:data:`LOCAL` (no sync on compute) and :func:`reduce_sums` adds all their states up across ranks in one all-reduce
before they compute; the values are then those of every rank's rows, as torchmetrics' sync would give. Metrics with
other reductions (AUROC's concatenated scores) keep torchmetrics' own sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torchmetrics import Metric

LOCAL = {"sync_on_compute": False}  # the constructor arguments of a metric that reduce_sums syncs


def summed(root: nn.Module) -> list[Metric]:
    """The metrics under ``root`` built with :data:`LOCAL`."""
    return [m for m in root.modules() if isinstance(m, Metric) and not m.sync_on_compute]


def reduce_sums(metrics: Sequence[Metric], reduce_sum: Callable[[Tensor], Tensor]) -> None:
    """Every state of ``metrics`` (tensors reduced by sum) replaced in place by its sum over the ranks, with one call
    of ``reduce_sum`` (an all-reduce) on the states packed in float64 (counts exact up to 2^53)."""
    states = [state for m in metrics for state in m.metric_state.values()]
    if not states:
        return
    flat = reduce_sum(torch.cat([s.reshape(-1).to(torch.float64) for s in states]))
    for state, total in zip(states, flat.split([s.numel() for s in states])):
        state.copy_(total.view_as(state))
