r"""Pairwise X-risk losses and the active-passive surrogates of FeDXL.

Z. Guo, R. Jin, J. Luo, T. Yang, "FeDXL: Provable Federated Learning for Deep X-Risk Optimization", ICML 2023,
arXiv:2210.14396. The deep X-risk objective (Eq. 1) over positives :math:`S_1` and negatives :math:`S_2`, with scores
:math:`a = h(w, z)` of a positive and :math:`b = h(w, z')` of a negative, is

.. math::
    F(w) = \frac{1}{|S_1|} \sum_{z \in S_1} f\Big(\underbrace{\frac{1}{|S_2|} \sum_{z' \in S_2}
        \ell\big(h(w, z), h(w, z')\big)}_{g(w, z)}\Big).

The pairwise losses (each with its partials ``*_d1``, ``*_d2`` in closed form): PSM :math:`\ell = (1 + e^{a - b})^{-1}`
(FeDXL1, Table 3), squared hinge :math:`(m - (a - b))_+^2`, and KL-OPAUC's :math:`\exp((m - (a - b))_+^2 / \lambda)`
with :math:`f(u) = \lambda \log u` (Eq. 17, FeDXL2, Table 2). The surrogates make one ``backward()`` give
:math:`G_1 + G_2`, every passive score :math:`\tilde h` and weight :math:`\nabla f(u)` a detached constant. FeDXL1
(Eq. 5-6) and FeDXL2 (Eq. 12-13, :math:`\mathrm{sg}` the stop-gradient), with the moving average of Eq. 11:

.. math::
    \mathcal L_1 = \frac{1}{B_1 P_2} \sum_{s,p} \ell(a_s, \tilde h^{(2)}_p)
        + \frac{1}{P_1 B_2} \sum_{q,t} \ell(\tilde h^{(1)}_q, b_t),

    \mathcal L_2 = \frac{1}{B_1} \sum_s \mathrm{sg}\big[\nabla f(u_s)\big] \frac{1}{P_2} \sum_p
        \ell(a_s, \tilde h^{(2)}_p)
        + \frac{1}{P_1} \sum_q \mathrm{sg}\big[\nabla f(\tilde u_q)\big] \frac{1}{B_2} \sum_t
        \ell(\tilde h^{(1)}_q, b_t),
    \qquad
    u_s \leftarrow (1 - \gamma)\, u_s + \gamma\, \frac{1}{P_2} \sum_p \ell(a_s, \tilde h^{(2)}_p).

Symbols: ``a``, ``b`` (:math:`B_1`, :math:`B_2`) active scores, ``passive_pos``, ``passive_neg`` (:math:`P_1`,
:math:`P_2`) passive ones, ``u_active``/``u_passive`` aligned with ``a``/``passive_pos``, ``lam``, ``margin``,
``gamma``. Deviations (docs/fedxl.md#objective-and-updates): the paper's sign typo in the KL-OPAUC loss is fixed as
in the authors' code; every active sample meets every passive partner of the step; :math:`\nabla f(u) = \lambda / u`
keeps the :math:`\lambda` the authors' code drops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from flx.errors import not_binary

PairLoss = Callable[[Tensor, Tensor], Tensor]
"""An elementwise pairwise loss ``ell(a, b)`` on broadcastable score tensors."""


def check_binary_labels(y: Tensor, algo: str) -> None:
    """One clear error when an AUC / X-risk algorithm is given labels other than 0/1 (e.g. a 10-class dataset)."""
    if y.numel() and (int(y.min()) < 0 or int(y.max()) > 1):
        raise not_binary(algo, int(torch.unique(y).numel()))


def _hinge(a: Tensor, b: Tensor, margin: float) -> Tensor:
    """Returns :math:`(m - (a - b))_+`, elementwise."""
    return torch.clamp(margin - (a - b), min=0.0)


def psm(a: Tensor, b: Tensor) -> Tensor:
    r"""Pairwise sigmoid loss (symmetric: :math:`\ell(a, b) + \ell(b, a) = 1`).

    .. math::
        \ell(a, b) = \big(1 + e^{a - b}\big)^{-1} = \sigma(b - a), \qquad
        \nabla_1 \ell = -\sigma(b - a)\big(1 - \sigma(b - a)\big), \qquad \nabla_2 \ell = -\nabla_1 \ell.

    Args:
        a: Scores of positives.
        b: Scores of negatives, broadcastable with ``a``.

    Returns:
        The elementwise loss.
    """
    return torch.sigmoid(b - a)


def psm_d1(a: Tensor, b: Tensor) -> Tensor:
    """Partial derivative of :func:`psm` in ``a``: ``-s (1 - s)`` with ``s = sigmoid(b - a)``."""
    s = torch.sigmoid(b - a)
    return -s * (1.0 - s)


def psm_d2(a: Tensor, b: Tensor) -> Tensor:
    """Partial derivative of :func:`psm` in ``b``: ``s (1 - s)`` with ``s = sigmoid(b - a)``."""
    return -psm_d1(a, b)


def squared_hinge(a: Tensor, b: Tensor, margin: float = 1.0) -> Tensor:
    r"""Squared hinge loss on the score gap.

    .. math::
        \ell(a, b) = (m - (a - b))_+^2, \qquad \nabla_1 \ell = -2\,(m - a + b)_+, \qquad
        \nabla_2 \ell = 2\,(m - a + b)_+.

    Both derivatives are exactly 0 where the hinge is inactive (:math:`a - b \ge m`).

    Args:
        a: Scores of positives.
        b: Scores of negatives, broadcastable with ``a``.
        margin: The margin :math:`m`.

    Returns:
        The elementwise loss.
    """
    return _hinge(a, b, margin) ** 2


def squared_hinge_d1(a: Tensor, b: Tensor, margin: float = 1.0) -> Tensor:
    """Partial derivative of :func:`squared_hinge` in ``a``: ``-2 (m - a + b)_+``."""
    return -2.0 * _hinge(a, b, margin)


def squared_hinge_d2(a: Tensor, b: Tensor, margin: float = 1.0) -> Tensor:
    """Partial derivative of :func:`squared_hinge` in ``b``: ``2 (m - a + b)_+``."""
    return 2.0 * _hinge(a, b, margin)


def kl_opauc_inner(a: Tensor, b: Tensor, lam: float, margin: float = 1.0) -> Tensor:
    r"""Inner loss of KL-OPAUC (Eq. 17, sign corrected as in the module docstring).

    .. math::
        \ell(a, b) = \exp\big((m - a + b)_+^2 / \lambda\big), \qquad
        \nabla_1 \ell = -\frac{2}{\lambda}\,(m - a + b)_+\,\ell(a, b), \qquad \nabla_2 \ell = -\nabla_1 \ell.

    :math:`\ell \ge 1`, so a moving average :math:`u` started at 1 stays :math:`\ge 1`.

    Args:
        a: Scores of positives.
        b: Scores of negatives, broadcastable with ``a``.
        lam: The KL-DRO temperature :math:`\lambda > 0`.
        margin: The margin :math:`m`.

    Returns:
        The elementwise loss.
    """
    return torch.exp(_hinge(a, b, margin) ** 2 / lam)


def kl_opauc_inner_d1(a: Tensor, b: Tensor, lam: float, margin: float = 1.0) -> Tensor:
    """Partial derivative of :func:`kl_opauc_inner` in ``a``: ``-(2 / lam) (m - a + b)_+ ell(a, b)``."""
    h = _hinge(a, b, margin)
    return -2.0 / lam * h * torch.exp(h**2 / lam)


def kl_opauc_inner_d2(a: Tensor, b: Tensor, lam: float, margin: float = 1.0) -> Tensor:
    """Partial derivative of :func:`kl_opauc_inner` in ``b``: ``(2 / lam) (m - a + b)_+ ell(a, b)``."""
    return -kl_opauc_inner_d1(a, b, lam, margin)


def kl_opauc_outer(u: Tensor, lam: float) -> Tensor:
    r"""Outer function of KL-OPAUC, :math:`f(u) = \lambda \log u`."""
    return lam * torch.log(u)


def kl_opauc_outer_prime(u: Tensor, lam: float) -> Tensor:
    r"""Derivative of :func:`kl_opauc_outer`, :math:`\nabla f(u) = \lambda / u`."""
    return lam / u


def _pair_means(a: Tensor, b: Tensor, passive_neg: Tensor, passive_pos: Tensor, ell: PairLoss) -> tuple[Tensor, Tensor]:
    """Per-sample pair means: ``(B1,)`` over passive negatives and ``(P1,)`` over active negatives."""
    pos_side = ell(a[:, None], passive_neg.detach()[None, :]).mean(dim=1)  # (B1, P2) -> (B1,)
    neg_side = ell(passive_pos.detach()[:, None], b[None, :]).mean(dim=1)  # (P1, B2) -> (P1,)
    return pos_side, neg_side


def linear_surrogate(a: Tensor, b: Tensor, passive_neg: Tensor, passive_pos: Tensor, ell: PairLoss) -> Tensor:
    r"""FeDXL1 surrogate (Eq. 5-6) whose gradient is :math:`G_1 + G_2`.

    .. math::
        \frac{\partial \mathcal L}{\partial a_s} = \frac{1}{B_1 P_2} \sum_p \nabla_1 \ell(a_s, \tilde h^{(2)}_p),
        \qquad
        \frac{\partial \mathcal L}{\partial b_t} = \frac{1}{P_1 B_2} \sum_q \nabla_2 \ell(\tilde h^{(1)}_q, b_t).

    Args:
        a: ``(B1,)`` active positive scores, with grad.
        b: ``(B2,)`` active negative scores, with grad.
        passive_neg: ``(P2,)`` passive negative scores; detached here.
        passive_pos: ``(P1,)`` passive positive scores; detached here.
        ell: Pairwise loss, e.g. :func:`psm`.

    Returns:
        The scalar surrogate.
    """
    pos_side, neg_side = _pair_means(a, b, passive_neg, passive_pos, ell)
    return pos_side.mean() + neg_side.mean()


def compositional_surrogate(
    a: Tensor,
    b: Tensor,
    passive_neg: Tensor,
    passive_pos: Tensor,
    u_active: Tensor,
    u_passive: Tensor,
    ell: PairLoss,
    f_prime: Callable[[Tensor], Tensor],
) -> Tensor:
    r"""FeDXL2 surrogate (Eq. 12-13) whose gradient is :math:`G_1 + G_2`.

    .. math::
        \frac{\partial \mathcal L}{\partial a_s} = \frac{1}{B_1} \nabla f(u_s) \frac{1}{P_2} \sum_p
            \nabla_1 \ell(a_s, \tilde h^{(2)}_p),
        \qquad
        \frac{\partial \mathcal L}{\partial b_t} = \frac{1}{P_1} \sum_q \nabla f(\tilde u_q) \frac{1}{B_2}
            \nabla_2 \ell(\tilde h^{(1)}_q, b_t).

    Args:
        a: ``(B1,)`` active positive scores, with grad.
        b: ``(B2,)`` active negative scores, with grad.
        passive_neg: ``(P2,)`` passive negative scores; detached here.
        passive_pos: ``(P1,)`` passive positive scores; detached here.
        u_active: ``(B1,)`` post-update :math:`u` of the active positives (Algorithm 2 line 16).
        u_passive: ``(P1,)`` :math:`u` values aligned with ``passive_pos``.
        ell: Pairwise loss, e.g. ``functools.partial(kl_opauc_inner, lam=lam)``.
        f_prime: :math:`\nabla f`, e.g. ``functools.partial(kl_opauc_outer_prime, lam=lam)``.

    Returns:
        The scalar surrogate.
    """
    pos_side, neg_side = _pair_means(a, b, passive_neg, passive_pos, ell)
    w_active = f_prime(u_active.detach())  # (B1,)
    w_passive = f_prime(u_passive.detach())  # (P1,)
    return (w_active * pos_side).mean() + (w_passive * neg_side).mean()


@torch.no_grad()
def update_u(u: Tensor, a: Tensor, passive_neg: Tensor, ell: PairLoss, gamma: float) -> Tensor:
    r"""Moving-average estimate of the inner function per active positive (Eq. 11).

    .. math::
        u_s \leftarrow (1 - \gamma)\, u_s + \gamma\, \frac{1}{P_2} \sum_p \ell(a_s, \tilde h^{(2)}_p).

    Args:
        u: ``(B1,)`` current :math:`u` of the active positives; not modified.
        a: ``(B1,)`` active positive scores (no gradient flows).
        passive_neg: ``(P2,)`` passive negative scores.
        ell: Pairwise loss.
        gamma: Averaging weight :math:`\gamma \in (0, 1]`.

    Returns:
        The new ``(B1,)`` :math:`u`, without grad.
    """
    inner = ell(a[:, None], passive_neg[None, :]).mean(dim=1)  # (B1,)
    return (1.0 - gamma) * u + gamma * inner


@torch.no_grad()
def update_u_table(table: Tensor, rows: Tensor, a: Tensor, partners: Tensor, ell: PairLoss, gamma: float) -> Tensor:
    r"""Eq. 11 on a client's :math:`u` table, in place, for the drawn positives ``rows``; returns their new :math:`u`.

    A positive drawn :math:`n_s > 1` times in one minibatch (sampling with replacement) is updated once, with the
    mean of the estimates of its copies :math:`c`, and every copy reads that one value (Algorithm 2 line 16 reads
    the table after the update):

    .. math::
        u_s \leftarrow (1 - \gamma)\, u_s + \gamma\, \frac{1}{n_s} \sum_{c=1}^{n_s} \frac{1}{P} \sum_p
            \ell(a_{s,c}, \tilde h_p).

    Without repeats this is :func:`update_u` written into the table.

    Args:
        table: The client's ``u`` table, one entry per local positive; updated in place.
        rows: ``(B1,)`` entries of ``table`` drawn at the step (may repeat).
        a: ``(B1,)`` active positive scores of the draws (copies may differ: input noise, dropout).
        partners: ``(P,)`` partner scores (passive negatives, or the step's own negatives for Local Pair).
        ell: Pairwise loss.
        gamma: Averaging weight :math:`\gamma \in (0, 1]`.

    Returns:
        The ``(B1,)`` post-update :math:`u` of the draws, on ``a``'s device and dtype, without grad.
    """
    inner = ell(a[:, None], partners[None, :]).mean(dim=1)  # (B1,)
    uniq, inv = torch.unique(rows, return_inverse=True)  # on the rows' device: the host's, so no device sync
    uniq, inv = uniq.to(table.device), inv.to(inner.device)
    total = inner.new_zeros(len(uniq)).index_add_(0, inv, inner)
    count = inner.new_zeros(len(uniq)).index_add_(0, inv, torch.ones_like(inner))
    new = (1.0 - gamma) * table[uniq].to(inner) + gamma * total / count
    table[uniq] = new.to(table)
    return new[inv]
