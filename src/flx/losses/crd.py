r"""Contrastive Representation Distillation (CRD), the regulariser :math:`R_h` of AugFL's experiments.

Tian, Krishnan, Isola, "Contrastive Representation Distillation", ICLR 2020; used as :math:`R_h(\theta, \theta_p)`
by Yue, Qin, Deng, Ren, Zhang, Zhang, "AugFL: Augmenting Federated Learning with Pretrained Models", Section V. On a
server set of :math:`D` samples, the student (meta-model) features
:math:`s_i = g^\theta(x_i)` and teacher (PM) features :math:`c_i = g^{\theta_p}(x_i)` are embedded on the unit
sphere of :math:`\mathbb R^d` by two heads :math:`f^s, f^c` (``Linear`` then :math:`\ell_2` normalisation), the
teacher's features detached (:math:`\mathrm{sg}`: the PM is frozen):

.. math::
    v^s_i = f^s(s_i) = \frac{W_s s_i + b_s}{\lVert W_s s_i + b_s \rVert}, \qquad
    v^c_i = f^c(\mathrm{sg}[c_i]).

Two memory banks :math:`M^s, M^c \in \mathbb R^{D \times d}` hold one unit vector per sample. In the student
direction, sample :math:`i` is scored against row :math:`j` of the teacher bank by the critic of Section V,

.. math::
    e^s_{ij} = \frac{\exp(v^{s\top}_i M^c_j / \tau)}{Z_s}, \qquad h^s_{ij} = \frac{e^s_{ij}}{e^s_{ij} + N / D},

with :math:`j = i` the positive and :math:`j \in J_i` the :math:`N` negatives, and the NCE loss of a batch
:math:`B` (the empirical :math:`D_h` of Eq. 75) is

.. math::
    \mathcal L^s = -\frac{1}{|B|} \sum_{i \in B} \Big[\log h^s_{ii} + \sum_{j \in J_i} \log\big(1 - h^s_{ij}\big)\Big].

The teacher direction :math:`\mathcal L^c` swaps the roles (:math:`v^c_i` against :math:`M^s`, its own
:math:`Z_c`), the loss is :math:`\mathcal L^s + \mathcal L^c` (CRD sums both), and afterwards, without gradient,

.. math::
    M^s_i \leftarrow \frac{m M^s_i + (1 - m) v^s_i}{\lVert m M^s_i + (1 - m) v^s_i \rVert}, \qquad
    M^c_i \leftarrow \frac{m M^c_i + (1 - m) v^c_i}{\lVert m M^c_i + (1 - m) v^c_i \rVert}, \qquad i \in B.

:math:`Z` (``normalize=True``, CRD's default) is estimated once, on the first call, as
:math:`D \cdot \mathrm{mean}_{i \in B,\, j \in \{i\} \cup J_i} \exp(\cdot / \tau)` per direction and then kept
fixed (buffer ``z``, so checkpointed); ``normalize=False`` fixes :math:`Z = 1`.

Choices (the paper gives none of :math:`\tau, N, d, m`; defaults are the authors' released code,
github.com/zerui981105/AugFL, which takes CRD's):

- Positive ("exact" mode of CRD): the sample's own bank row :math:`M_i`, read before this call's update, not the
  other network's current embedding. During the first pass over the data the positives are the random initial rows.
- Negatives: :math:`N` indices drawn uniformly **with replacement** from :math:`\{0..D-1\} \setminus \{i\}`, from
  the caller's generator (deterministic given its seed). :math:`N > D - 1` is allowed and not clipped: the
  authors run :math:`N = 16384` on :math:`D = 10000` server samples, and their sampler then draws with
  replacement too. CRD's dataset draws negatives from the *other classes* only; here any other sample is a
  negative, the paper's definition (:math:`(x_i, x_j)` negative iff :math:`i \ne j`).
- Banks start uniform on the sphere (normalised Gaussian rows) and heads uniform in
  :math:`\pm 1/\sqrt{\text{in}}` (``nn.Linear``'s bound), both from the constructor's generator; CRD starts its
  banks uniform in a cube, unnormalised.
- :math:`\log h = -\mathrm{softplus}(\log\frac{N}{D} - a)` and :math:`\log(1 - h) = -\mathrm{softplus}(a -
  \log\frac{N}{D})` with :math:`a = \log e`: exact and stable, no :math:`\epsilon` (CRD adds 1e-7).
- Scores are :math:`v M^\top` over all :math:`D` rows, then gathered: the same numbers as gathering
  :math:`N + 1` rows per sample, in :math:`O(|B| D)` memory instead of :math:`O(|B| N d)` (1 GB at the defaults).
- A batch must not repeat an index (the bank update would be ambiguous): a ``ValueError`` says so.
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
