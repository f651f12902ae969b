"""Binary AUROC and McClish-standardised partial AUROC, as reported in FeDXL (Guo et al., ICML 2023).

The paper's Tables 2-3 report pAUC at FPR <= 0.3 / 0.5 and AUROC without naming the estimator; ours is
``sklearn.metrics.roc_auc_score(y, s, max_fpr=...)``, i.e. the partial area up to ``max_fpr`` standardised by McClish
(1989):

.. math::

    \\mathrm{pAUC}_{\\alpha} = \\tfrac12 + \\tfrac12\\,\\frac{A_\\alpha - \\alpha^2/2}{\\alpha - \\alpha^2/2},
    \\qquad A_\\alpha = \\int_0^\\alpha \\mathrm{TPR}\\,d\\mathrm{FPR},

with the ROC curve interpolated linearly at ``alpha = max_fpr`` and tied scores forming one ROC step. ``max_fpr=1``
is the full AUROC.

The maths is torchmetrics' ``binary_auroc`` (it matches sklearn to ~1e-7 on scores in [0, 1], ties included: it
builds the ROC curve in the default dtype, float32; :class:`AUROCs` with ``value_dtype`` float64, as in a float64 run,
builds it in float64 and agrees with sklearn to ~1e-16), with
one deviation: torchmetrics applies a sigmoid when any score lies outside [0, 1], and the sigmoid saturates to exactly
1.0 above ~17 in float32 (~37 in float64). Distinct large logits then become ties and the AUROC is wrong (e.g.
0.667 instead of 1.0). Since AUROC depends only on the ranking, scores are first replaced by their dense rank scaled
into [0, 1] (an order- and tie-preserving map computed in float64), so torchmetrics never applies the sigmoid.

Degenerate targets: when only one class is present the ROC curve is undefined and every value is ``nan`` (the same
as sklearn >= 1.3, which warns and returns nan; torchmetrics would warn and return 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.functional.classification import binary_auroc as _tm_binary_auroc
from torchmetrics.utilities import dim_zero_cat

from flx.metrics.dtype import default_dtype


def _check(scores: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """Flatten to (N,) and validate: finite scores, target in {0, 1}; returns (scores, long target)."""
    scores, target = scores.detach().reshape(-1), target.detach().reshape(-1)
    if scores.numel() != target.numel():
        raise ValueError(f"scores and target differ in size: {scores.numel()} vs {target.numel()}")
    if not torch.isfinite(scores).all():
        raise ValueError("scores must be finite (no nan or inf)")
    if not ((target == 0) | (target == 1)).all():
        raise ValueError("target must hold only 0 and 1")
    return scores, target.long()


def _dense_rank01(scores: Tensor) -> Tensor:
    """Dense rank of each score scaled into [0, 1] (float64); equal scores keep equal values."""
    _, rank = torch.unique(scores, sorted=True, return_inverse=True)
    return rank.double() / max(int(rank.max()), 1) if rank.numel() else rank.double()


def _is_degenerate(target: Tensor) -> bool:
    """True when only one class (or none) is present, so that the ROC curve is undefined."""
    pos = int(target.sum())
    return pos == 0 or pos == target.numel()


def _pauc_from_ranks(ranks: Tensor, target: Tensor, max_fpr: float | None) -> Tensor:
    """AUROC (``max_fpr`` None or 1) or standardised pAUC of already validated, rank-scaled scores."""
    if _is_degenerate(target):
        return torch.tensor(math.nan, dtype=torch.float64, device=ranks.device)
    if max_fpr is not None and not 0 < max_fpr <= 1:
        raise ValueError(f"max_fpr must be in (0, 1], got {max_fpr}")
    max_fpr = None if max_fpr == 1 else max_fpr
    return _tm_binary_auroc(ranks, target, max_fpr=max_fpr, validate_args=False).double()


def partial_auroc(scores: Tensor, target: Tensor, max_fpr: float) -> Tensor:
    """McClish-standardised partial AUROC up to ``max_fpr``, equal to ``roc_auc_score(y, s, max_fpr=max_fpr)``.

    Args:
        scores: (N,) real scores, higher means more positive (logits or probabilities alike).
        target: (N,) labels in {0, 1} (bool, int or float).
        max_fpr: upper end of the FPR range, in (0, 1]; 1 gives the full AUROC.

    Returns:
        0-dim float64 tensor in [0, 1] (0.5 for a random ranking); ``nan`` if ``target`` has one class only.

    Example:
        >>> round(partial_auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]), max_fpr=0.5).item(), 6)
        0.666667
    """
    scores, target = _check(scores, target)
    return _pauc_from_ranks(_dense_rank01(scores), target, max_fpr)


def binary_auroc(scores: Tensor, target: Tensor) -> Tensor:
    """Area under the ROC curve, equal to ``roc_auc_score(y, s)``; same arguments and return as ``partial_auroc``.

    Example:
        >>> binary_auroc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])).item()
        0.75
    """
    scores, target = _check(scores, target)
    return _pauc_from_ranks(_dense_rank01(scores), target, None)


def _key(max_fpr: float) -> str:
    return f"pauc_{max_fpr:g}"


class AUROCs(Metric):
    """Full AUROC and standardised pAUCs of all scores seen, from one shared ranking.

    Scores and targets are kept whole (list states, concatenated across processes), since AUROC does not decompose
    over batches; ``compute()`` returns ``{"auroc": ..., "pauc_0.3": ..., "pauc_0.5": ...}`` (nan values if only
    one class was seen), keys meant to be logged as ``test/auroc``, ``test/pauc_0.3``.

    Args:
        max_fprs: FPR bounds of the reported partial AUROCs, each in (0, 1].
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    def __init__(self, max_fprs: Sequence[float] = (0.3, 0.5), **kwargs) -> None:
        super().__init__(**kwargs)
        if not all(0 < m <= 1 for m in max_fprs):
            raise ValueError(f"max_fprs must lie in (0, 1], got {tuple(max_fprs)}")
        self.max_fprs = tuple(float(m) for m in max_fprs)
        self.add_state("scores", [], dist_reduce_fx="cat")
        self.add_state("target", [], dist_reduce_fx="cat")
        # what the ROC curve is computed in: float32 (torchmetrics' default), float64 in a float64 run
        self.value_dtype = torch.float32

    def keys(self) -> tuple[str, ...]:
        """The keys :meth:`compute` returns: ``("auroc", "pauc_0.3", "pauc_0.5")`` by default."""
        return ("auroc", *(_key(m) for m in self.max_fprs))

    def update(self, scores: Tensor, target: Tensor) -> None:
        scores, target = _check(scores, target)
        self.scores.append(scores)
        self.target.append(target)

    def compute(self) -> dict[str, Tensor]:
        """AUROC and pAUCs over every sample passed to ``update`` (on every process)."""
        scores, target = dim_zero_cat(self.scores), dim_zero_cat(self.target)
        ranks = _dense_rank01(scores)
        with default_dtype(self.value_dtype):
            out = {"auroc": _pauc_from_ranks(ranks, target, None)}
            out.update({_key(m): _pauc_from_ranks(ranks, target, m) for m in self.max_fprs})
        return out
