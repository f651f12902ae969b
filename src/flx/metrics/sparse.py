"""Structure of a learned parameter against a ground truth: support recovery (Lasso) and rank (matrix completion).

pFedFBE's §4.1-4.2 metrics: entries with :math:`|w_k| < \\tau` count
as zero (:math:`\\tau = 0.01`, the paper's), and the rank counts the singular values above :math:`\\tau`.

.. math::
    \\hat S = \\{k : |w_k| \\ge \\tau\\},\\ S = \\{k : w^*_k \\ne 0\\},\\quad
    \\text{precision} = \\frac{|\\hat S \\cap S|}{|\\hat S|},\\ \\text{recall} = \\frac{|\\hat S \\cap S|}{|S|},\\
    F_1 = \\frac{2 |\\hat S \\cap S|}{|\\hat S| + |S|},\\ \\text{density} = \\frac{|\\hat S|}{d}
"""

from __future__ import annotations

import torch
from torch import Tensor

THRESHOLD = 0.01  # the paper's: entries below it in magnitude count as zero


def support_scores(w: Tensor, truth: Tensor, threshold: float = THRESHOLD) -> dict[str, float]:
    """Precision, recall, F1 and density of the support of ``w`` (``|w_k| >= threshold``) against the nonzero
    entries of ``truth``. Empty sets give 1 where the ratio is 0/0 (nothing claimed, nothing missed)."""
    est, true = w.detach().flatten().abs() >= threshold, truth.detach().flatten() != 0
    hit, n_est, n_true = int((est & true).sum()), int(est.sum()), int(true.sum())
    precision = hit / n_est if n_est else 1.0
    recall = hit / n_true if n_true else 1.0
    f1 = 2 * hit / (n_est + n_true) if n_est + n_true else 1.0
    return {"precision": precision, "recall": recall, "f1": f1, "density": n_est / est.numel()}


def numerical_rank(w: Tensor, threshold: float = THRESHOLD) -> int:
    """The number of singular values of the matrix ``w`` above ``threshold``."""
    return int((torch.linalg.svdvals(w.detach().double()) > threshold).sum())


def recovery_error(w: Tensor, truth: Tensor) -> float:
    """The Euclidean (Frobenius) distance between ``w`` and ``truth``."""
    return float(torch.linalg.vector_norm(w.detach().double().flatten() - truth.detach().double().flatten()))
