r"""Classification heads: the one place that turns a net's outputs into a loss, predictions and a binary score.

A net's outputs are logits ``(B, C)``. A binary task (``C = 2`` classes) has two heads (``model.binary_head``):

- ``two_logits`` (default): two columns ``(logit_0, logit_1)``, softmax cross-entropy, prediction ``argmax``;
  the binary margin is :math:`z = \text{logit}_1 - \text{logit}_0`.
- ``one_logit``: one column :math:`z` (the net is built with one output),
  :math:`\Pr(y = 1) = \sigma(z)`, binary cross-entropy with logits, prediction :math:`z > 0`.

The two are the same model family (:math:`\sigma(\text{logit}_1 - \text{logit}_0)` is the softmax's positive
probability), so with either head the score of a sample is :math:`h = \sigma(z)` (``kind="sigmoid"``) or :math:`z`
(``kind="logit"``); AUROC and pAUC only need the ranking, which :math:`\sigma` keeps. Functions dispatch on the
number of output columns, so the module, the metrics and the parts (FeDXL, CODASCA) need no head argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flx.models.head_spec import HEADS, num_outputs

__all__ = ["HEADS", "num_outputs", "binary_margin"]


def binary_margin(outputs: Tensor) -> Tensor:
    """``z``: ``logit_1 - logit_0`` of ``(B, 2)`` outputs, the single logit of ``(B, 1)`` outputs; shape ``(B,)``.

    Example:
        >>> binary_margin(torch.tensor([[0.5, 2.0], [1.0, -1.0]])).tolist()
        [1.5, -2.0]
    """
    if outputs.dim() != 2 or outputs.shape[1] not in (1, 2):
        raise ValueError(f"a binary score needs outputs of shape (B, 1) or (B, 2), got {tuple(outputs.shape)}")
    return outputs[:, 0] if outputs.shape[1] == 1 else outputs[:, 1] - outputs[:, 0]


def binary_score(outputs: Tensor, kind: str = "sigmoid") -> Tensor:
    """``h(w; z)``: ``sigmoid(z)`` (``kind="sigmoid"``, in (0, 1)) or the margin ``z`` itself (``"logit"``)."""
    z = binary_margin(outputs)
    return torch.sigmoid(z) if kind == "sigmoid" else z


def predict(outputs: Tensor) -> Tensor:
    """Predicted classes ``(B,)``: ``z > 0`` with one column, ``argmax`` otherwise."""
    return (outputs[:, 0] > 0).long() if outputs.shape[-1] == 1 else outputs.argmax(-1)


def classification_loss(outputs: Tensor, target: Tensor) -> Tensor:
    """Batch-mean loss: BCE with logits on ``z`` for one column, softmax cross-entropy otherwise."""
    if outputs.shape[-1] == 1:
        return F.binary_cross_entropy_with_logits(outputs[:, 0], target.to(outputs.dtype))
    return F.cross_entropy(outputs, target)
