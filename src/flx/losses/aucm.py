r"""The min-max square-loss AUC surrogate (AUC-M) optimised by CODASCA.

Yuan, Guo, Xu, Ying, Yang, "Federated Deep AUC Maximization for Heterogeneous Data with a Constant
Communication Complexity", ICML 2021; the margin form of Yuan, Yan, Sonka, Yang, "Large-scale Robust Deep AUC
Maximization", ICCV 2021 (the ``AUCMLoss`` of LibAUC). For a minibatch of scores :math:`h_j = h(w; x_j)` with
labels :math:`y_j \in \{0, 1\}` and the positive ratio :math:`p`:

.. math::
    F(w, a, b, \alpha) = \frac1n \sum_j \Big[(1-p)(h_j - a)^2 [y_j{=}1] + p (h_j - b)^2 [y_j{=}0]\Big]
        + 2\alpha\Big(p(1-p)m + \frac1n \sum_j \big(p\,h_j [y_j{=}0] - (1-p)\,h_j [y_j{=}1]\big)\Big)
        - p(1-p)\alpha^2,

minimised over :math:`(w, a, b)` and maximised over :math:`\alpha \ge 0`. Partial derivatives (closed form,
checked against autograd in the tests), with :math:`n_+` / :math:`n_-` the batch's positives / negatives:

.. math::
    \partial_a F = -\tfrac{2(1-p)}{n} \sum_{y_j=1} (h_j - a), \qquad
    \partial_b F = -\tfrac{2p}{n} \sum_{y_j=0} (h_j - b), \qquad
    \partial_\alpha F = 2\Big(p(1-p)m + \tfrac1n \sum_j (p h_j [y_j{=}0] - (1-p) h_j [y_j{=}1])\Big) - 2p(1-p)\alpha,

    \partial_{h_j} F = \tfrac{2}{n}\Big((1-p)(h_j - a - \alpha) [y_j{=}1] + p (h_j - b + \alpha) [y_j{=}0]\Big).

Why it is an AUC loss: when the batch ratio equals :math:`p`, the saddle point is :math:`a = \mu_+`,
:math:`b = \mu_-` (class means of the scores) and :math:`\alpha = m - (\mu_+ - \mu_-)` (if :math:`\ge 0`), and the
saddle value is :math:`p(1-p)` times the mean over all positive-negative pairs of :math:`(m - (h_i - h_j))^2`, the
pairwise square loss (Ying et al., NeurIPS 2016). ``alpha_grad_ab`` is the dual gradient the authors' code uses
instead of the stochastic one: the expectation of :math:`\partial_\alpha F / (p(1-p))` with the class means
replaced by :math:`a, b` (their values at the saddle), :math:`2(m + b - a) - 2\alpha`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def aucm(h: Tensor, y: Tensor, a: Tensor, b: Tensor, alpha: Tensor, p: float, margin: float = 1.0) -> Tensor:
    """The AUC-M objective ``F(w, a, b, alpha)`` of a minibatch (scores ``h``, 0/1 labels ``y``)."""
    pos, neg = (y == 1).to(h), (y != 1).to(h)
    return (
        ((1 - p) * (h - a) ** 2 * pos + p * (h - b) ** 2 * neg).mean()
        + 2 * alpha * (p * (1 - p) * margin + (p * h * neg - (1 - p) * h * pos).mean())
        - p * (1 - p) * alpha**2
    )


def aucm_grads(
    h: Tensor, y: Tensor, a: Tensor, b: Tensor, alpha: Tensor, p: float, margin: float = 1.0
) -> dict[str, Tensor]:
    """Closed-form partial derivatives of :func:`aucm` with respect to ``h`` (per sample), ``a``, ``b``, ``alpha``."""
    pos, neg, n = (y == 1).to(h), (y != 1).to(h), len(h)
    return {
        "h": 2 / n * ((1 - p) * (h - a - alpha) * pos + p * (h - b + alpha) * neg),
        "a": -2 * (1 - p) / n * ((h - a) * pos).sum(),
        "b": -2 * p / n * ((h - b) * neg).sum(),
        "alpha": 2 * (p * (1 - p) * margin + (p * h * neg - (1 - p) * h * pos).mean()) - 2 * p * (1 - p) * alpha,
    }


def alpha_grad_ab(a: Tensor, b: Tensor, alpha: Tensor, margin: float = 1.0) -> Tensor:
    """The authors' dual gradient ``2 (m + b - a) - 2 alpha`` (see the module docstring)."""
    return 2 * (margin + b - a) - 2 * alpha


def pairwise_square(h: Tensor, y: Tensor, margin: float = 1.0) -> Tensor:
    """Mean over positive-negative pairs of ``(m - (h_i - h_j))^2``: the AUC loss that AUC-M reformulates."""
    hp, hn = h[y == 1], h[y != 1]
    return ((margin - (hp[:, None] - hn[None, :])) ** 2).mean()


def saddle_point(h: Tensor, y: Tensor, margin: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(a*, b*, alpha*)`` for fixed scores: class means and ``max(0, m - (mu_+ - mu_-))``."""
    a, b = h[y == 1].mean(), h[y != 1].mean()
    return a, b, torch.clamp(margin - (a - b), min=0)
