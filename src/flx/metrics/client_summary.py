"""Per-client accuracy of the global model and its summary (mean, worst, std over clients).

A torchmetrics ``Metric``: per-client ``correct``/``total`` counts are declared states reduced by sum,
so a summary computed on N processes equals the one on 1.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class PerClientAccuracy(Metric):
    """Accuracy of each client's test samples.

    Args:
        num_clients: number of clients (size of the count vectors).
    """

    full_state_update = False

    def __init__(self, num_clients: int) -> None:
        super().__init__()
        self.add_state("correct", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(num_clients, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor, client: Tensor) -> None:
        """``preds``: predicted classes ``(B,)`` (``flx.models.heads.predict``), or logits ``(B, C)`` (argmax)."""
        preds = preds.argmax(-1) if preds.dim() > 1 else preds
        self.correct.index_add_(0, client, (preds == target).long())
        self.total.index_add_(0, client, torch.ones_like(client))

    def compute(self) -> Tensor:
        """Accuracy per client; NaN for a client without test samples."""
        return self.correct.float() / self.total.float()


def summarize(acc: Tensor) -> dict[str, Tensor]:
    """Mean, worst (min) and std (population) over the clients that have test samples."""
    acc = acc[~torch.isnan(acc)]
    return {"mean": acc.mean(), "worst": acc.min(), "std": acc.std(unbiased=False)}
