r"""Contrastive Representation Distillation (CRD), the regulariser :math:`R_h` of AugFL's experiments.

Y. Tian, D. Krishnan, P. Isola, "Contrastive Representation Distillation", ICLR 2020, arXiv:1910.10699; used as
:math:`R_h(\theta, \theta_p)` by Yue, Qin, Deng, Ren, Zhang, Zhang, "AugFL: Augmenting Federated Learning with
Pretrained Models", arXiv:2503.02154, Section V. Student features :math:`s_i = g^\theta(x_i)` and frozen teacher
(PM) features :math:`c_i` are embedded on the unit sphere by two heads, :math:`v^s_i = f^s(s_i)`, :math:`v^c_i =
f^c(\mathrm{sg}[c_i])` (``Linear`` then :math:`\ell_2` normalisation); two memory banks :math:`M^s, M^c \in
\mathbb R^{D \times d}` hold one unit vector per server sample. In the student direction, with :math:`N` negatives
:math:`J_i`,

.. math::
    e^s_{ij} = \frac{\exp(v^{s\top}_i M^c_j / \tau)}{Z_s}, \qquad h^s_{ij} = \frac{e^s_{ij}}{e^s_{ij} + N / D},
    \qquad
    \mathcal L^s = -\frac{1}{|B|} \sum_{i \in B} \Big[\log h^s_{ii} + \sum_{j \in J_i} \log\big(1 - h^s_{ij}\big)\Big],

the teacher direction :math:`\mathcal L^c` swaps the roles, the loss is :math:`\mathcal L^s + \mathcal L^c`, and then,
without gradient, :math:`M_i \leftarrow \mathrm{normalise}(m M_i + (1 - m) v_i)` for :math:`i \in B` in both banks.
:math:`Z` is estimated once on the first call and kept (buffer ``z``; ``normalize=False``: :math:`Z = 1`).

The file owns the heads, the banks and :math:`Z` (all in the module's state, so checkpointed) and the loss. Defaults
for :math:`\tau, N, d, m` (the paper gives none) are the authors' code's; the positives, the negatives drawn with
replacement, the initialisation, the stable log forms and the memory layout are chosen as docs/augfl.md#crd-details
states. A batch must not repeat an index (the bank update would be ambiguous): a ``ValueError`` says so.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flx.errors import bad_value

KEY = "algo.rh"  # the config node every message names


def draw_negatives(idx: Tensor, num_data: int, num_negatives: int, generator: torch.Generator) -> Tensor:
    """``(B, N)`` indices uniform with replacement over ``{0..D-1}`` minus each row's own ``idx`` (on ``idx``'s device).

    Draws :math:`r \\in \\{0..D-2\\}` and shifts :math:`r \\ge i` up by one: a bijection onto the other indices.
    """
    r = torch.randint(num_data - 1, (len(idx), num_negatives), generator=generator, device=generator.device)
    r = r.to(idx.device)
    return r + (r >= idx[:, None]).long()


def nce_loss(pos: Tensor, neg: Tensor, num_data: int, temperature: float, z: Tensor) -> Tensor:
    r"""The NCE loss :math:`-\mathrm{mean}_i[\log h_{ii} + \sum_j \log(1 - h_{ij})]` of one direction.

    Args:
        pos: ``(B,)`` positive inner products :math:`v_i^\top M_i`.
        neg: ``(B, N)`` negative inner products :math:`v_i^\top M_j`, :math:`j \in J_i`.
        num_data: :math:`D`.
        temperature: :math:`\tau`.
        z: The scalar normalisation :math:`Z`.

    Returns:
        The scalar loss.
    """
    log_noise = math.log(neg.shape[1] / num_data)  # log(N / D)
    log_z = torch.log(z)
    a_pos, a_neg = pos / temperature - log_z, neg / temperature - log_z  # log e
    return (F.softplus(log_noise - a_pos) + F.softplus(a_neg - log_noise).sum(dim=1)).mean()


class CRD(nn.Module):
    r"""CRD loss with its two heads, two memory banks and normalisation constants (module docstring).

    Symbols: :math:`D` ``num_data``, :math:`d` ``feat_dim``, :math:`N` ``num_negatives``, :math:`\tau`
    ``temperature``, :math:`m` ``momentum``. Buffers (in ``state_dict``): ``bank_s``, ``bank_c`` (:math:`D \times d`)
    and ``z`` (:math:`(Z_s, Z_c)`, NaN until estimated). Heads: ``head_s`` (:math:`f^s`), ``head_c`` (:math:`f^c`).

    Args:
        student_dim: Feature size of the meta-model's penultimate layer.
        teacher_dim: Feature size of the PM's penultimate layer.
        num_data: :math:`D`, the size of the server set; ``idx`` indexes it.
        feat_dim: :math:`d`, the embedding size.
        num_negatives: :math:`N`; may exceed :math:`D - 1` (drawn with replacement).
        temperature: :math:`\tau > 0`.
        momentum: :math:`m \in [0, 1]` of the bank update.
        normalize: Estimate :math:`Z` on the first call (True, CRD) or fix :math:`Z = 1` (False).
        generator: Draws the initial heads and banks (None: torch's global generator).
    """

    def __init__(
        self,
        student_dim: int,
        teacher_dim: int,
        num_data: int,
        feat_dim: int = 128,
        num_negatives: int = 16384,
        temperature: float = 0.07,
        momentum: float = 0.5,
        normalize: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        _check_args(num_data, feat_dim, num_negatives, temperature, momentum)
        self.num_data, self.num_negatives = num_data, num_negatives
        self.temperature, self.momentum, self.normalize = temperature, momentum, normalize
        self.head_s, self.head_c = nn.Linear(student_dim, feat_dim), nn.Linear(teacher_dim, feat_dim)
        with torch.no_grad():
            for head in (self.head_s, self.head_c):
                bound = 1.0 / math.sqrt(head.in_features)
                head.weight.uniform_(-bound, bound, generator=generator)
                head.bias.uniform_(-bound, bound, generator=generator)
        self.register_buffer("bank_s", F.normalize(torch.randn(num_data, feat_dim, generator=generator), dim=1))
        self.register_buffer("bank_c", F.normalize(torch.randn(num_data, feat_dim, generator=generator), dim=1))
        self.register_buffer("z", torch.full((2,), math.nan) if normalize else torch.ones(2))

    def forward(
        self, s_feat: Tensor, c_feat: Tensor, idx: Tensor, generator: torch.Generator, update: bool = True
    ) -> Tensor:
        r"""The CRD loss :math:`\mathcal L^s + \mathcal L^c` of a batch; then the banks' rows ``idx`` move (``update``).

        Args:
            s_feat: ``(B, student_dim)`` meta-model features (gradient flows into them).
            c_feat: ``(B, teacher_dim)`` PM features (detached here).
            idx: ``(B,)`` distinct indices of the samples in the server set, in ``[0, num_data)``.
            generator: Draws the negatives.
            update: Move the banks' rows ``idx`` after computing the loss (False: no side effect on the banks;
                ``z`` is still estimated on the first call).

        Returns:
            The scalar loss.
        """
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError("CRD: idx repeats a sample within the batch; the bank update needs distinct indices")
        v_s, v_c = F.normalize(self.head_s(s_feat), dim=1), F.normalize(self.head_c(c_feat.detach()), dim=1)
        cols = torch.cat([idx[:, None], draw_negatives(idx, self.num_data, self.num_negatives, generator)], dim=1)
        scores_s = (v_s @ self.bank_c.T).gather(1, cols)  # (B, 1 + N): student against the teacher bank, positive first
        scores_c = (v_c @ self.bank_s.T).gather(1, cols)  # (B, 1 + N): teacher against the student bank
        if self.normalize and bool(torch.isnan(self.z).any()):
            self._estimate_z(scores_s.detach(), scores_c.detach())
        loss_s = nce_loss(scores_s[:, 0], scores_s[:, 1:], self.num_data, self.temperature, self.z[0])
        loss_c = nce_loss(scores_c[:, 0], scores_c[:, 1:], self.num_data, self.temperature, self.z[1])
        if update:
            self._update_banks(idx, v_s.detach(), v_c.detach())
        return loss_s + loss_c

    @torch.no_grad()
    def _estimate_z(self, scores_s: Tensor, scores_c: Tensor) -> None:
        """``Z = D * mean(exp(score / tau))`` per direction, computed in log space (exp(1 / 0.07) ~ 1.6e6)."""
        for k, sc in enumerate((scores_s, scores_c)):
            log_mean = torch.logsumexp(sc.flatten() / self.temperature, dim=0) - math.log(sc.numel())
            self.z[k] = torch.exp(log_mean + math.log(self.num_data))

    @torch.no_grad()
    def _update_banks(self, idx: Tensor, v_s: Tensor, v_c: Tensor) -> None:
        """Momentum update of the rows ``idx``, out of place: autograd saved the old banks for the backward pass."""
        m = self.momentum
        self.bank_s = self.bank_s.index_copy(0, idx, F.normalize(m * self.bank_s[idx] + (1 - m) * v_s, dim=1))
        self.bank_c = self.bank_c.index_copy(0, idx, F.normalize(m * self.bank_c[idx] + (1 - m) * v_c, dim=1))


def _check_args(num_data: int, feat_dim: int, num_negatives: int, temperature: float, momentum: float) -> None:
    """One-line errors for values that make the critic or the bank update meaningless."""
    if num_data < 2:
        raise bad_value(f"{KEY}.num_data", num_data, "must be >= 2 (a sample needs another sample as a negative)")
    for name, value in (("feat_dim", feat_dim), ("num_negatives", num_negatives)):
        if value < 1:
            raise bad_value(f"{KEY}.{name}", value, "must be an integer >= 1")
    if not temperature > 0:
        raise bad_value(f"{KEY}.temperature", temperature, "must be > 0")
    if not 0 <= momentum <= 1:
        raise bad_value(f"{KEY}.momentum", momentum, "must be in [0, 1]")
