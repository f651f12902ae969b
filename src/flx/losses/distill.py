r"""Knowledge-transfer regularisers :math:`R_h(\theta, \theta_p)` towards a server-only pretrained model (PM).

AugFL (Yue, Qin, Deng, Ren, Zhang, Zhang, "AugFL: Augmenting Federated Learning with Pretrained Models") regularises
the meta-model :math:`\theta` by :math:`\lambda R_h(\theta,
\theta_p)`, and the server step (Eq. 13) needs only :math:`G^t = \nabla_\theta R_h(\theta^t, \theta_p)`, computed
on a labelled server set with the PM. The paper leaves :math:`R_h` generic; the options here (``RH_OPTIONS``):

- ``l2``, the theory's case (§IV-C; needs the same architecture), with its closed-form gradient:

  .. math::
      R_h = \sum_k \lVert \theta_k - \theta_{p,k} \rVert^2, \qquad \nabla_{\theta_k} R_h = 2\,(\theta_k - \theta_{p,k}).

- ``kd``, logit distillation (Hinton, Vinyals, Dean, "Distilling the Knowledge in a Neural Network", 2015) on a
  batch of :math:`B` student logits :math:`s_b` and PM logits :math:`t_b`, :math:`p = \mathrm{softmax}(\cdot / T)`:

  .. math::
      R_h = \frac{T^2}{B} \sum_b \mathrm{KL}\big(p(t_b) \,\Vert\, p(s_b)\big), \qquad
      \frac{\partial R_h}{\partial s_b} = \frac{T}{B}\big(p(s_b) - p(t_b)\big).

  The :math:`T^2` keeps the gradient's scale independent of :math:`T` (Hinton et al.). In the authors' code
  this term has weight :math:`\alpha_{KD} = 0`; :math:`T = 4` is the CRD repository's default.

- ``crd``, Contrastive Representation Distillation (Tian, Krishnan, Isola, ICLR 2020) on penultimate features,
  the paper's Section V instantiation: :class:`flx.losses.crd.CRD` (critic, NCE loss, memory banks, :math:`Z` and
  every choice there are in :mod:`flx.losses.crd`).

Choices the AugFL paper leaves open (Section V gives the loss only): :math:`\tau`, :math:`N`, the embedding size
:math:`d` and the bank momentum :math:`m` are not given; the defaults are the authors' code (:math:`d = 128`,
:math:`N = 16384`, :math:`\tau = 0.07`, :math:`m = 0.5`, "exact" positives). The theory's :math:`R_h` is ``l2``;
its smoothness constant is 2, and it is impossible across architectures (ResNet8x4 vs ResNet32x4). The authors'
server gradient also adds a supervised cross-entropy term and averages over one epoch of SGD steps: that
belongs to the caller, not to these building blocks.

Every option is pure: it takes tensors (parameters, logits or features), never nets. :data:`RH_INPUTS` names what
each one takes, so the caller branches on the input kind, not on the name; :func:`make_rh` builds one from config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flx.errors import bad_value
from flx.losses.crd import CRD, KEY

__all__ = ["KEY", "RH_INPUTS", "RH_OPTIONS", "l2_to_pm", "l2_to_pm_grad", "logit_kd", "logit_kd_grad", "make_rh"]

RH_OPTIONS = ("l2", "kd", "crd")
RH_INPUTS = {"l2": "params", "kd": "logits", "crd": "features"}
"""What each option's callable takes: ``params`` ``(params, pm_params)``; ``logits`` ``(student_logits,
teacher_logits)``; ``features`` ``(s_feat, c_feat, idx, generator)``."""


def _check_paired(params: Sequence[Tensor], pm_params: Sequence[Tensor]) -> None:
    """One line when the meta-model and the PM do not have the same architecture."""
    if len(params) != len(pm_params):
        raise bad_value(KEY, "l2", f"needs the PM's architecture: {len(params)} vs {len(pm_params)} tensors")
    for k, (p, q) in enumerate(zip(params, pm_params)):
        if p.shape != q.shape:
            raise bad_value(
                KEY, "l2", f"needs the PM's architecture: tensor {k} is {tuple(p.shape)} vs {tuple(q.shape)}"
            )


def l2_to_pm(params: Sequence[Tensor], pm_params: Sequence[Tensor]) -> Tensor:
    r""":math:`\sum_k \lVert \theta_k - \theta_{p,k} \rVert^2` over paired tensors (the PM's side is detached).

    Args:
        params: The meta-model's tensors :math:`\theta_k` (e.g. ``list(net.parameters())``).
        pm_params: The PM's tensors, same count and shapes, in the same order.

    Returns:
        The scalar regulariser.
    """
    _check_paired(params, pm_params)
    return sum(((p - q.detach()) ** 2).sum() for p, q in zip(params, pm_params))


def l2_to_pm_grad(params: Sequence[Tensor], pm_params: Sequence[Tensor]) -> list[Tensor]:
    r"""Closed-form :math:`\nabla_{\theta_k} R_h = 2 (\theta_k - \theta_{p,k})`, one tensor per pair, without grad."""
    _check_paired(params, pm_params)
    return [2 * (p.detach() - q.detach()) for p, q in zip(params, pm_params)]


def logit_kd(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 4.0) -> Tensor:
    r""":math:`\frac{T^2}{B} \sum_b \mathrm{KL}(\mathrm{softmax}(t_b / T) \Vert \mathrm{softmax}(s_b / T))`.

    Args:
        student_logits: ``(B, C)`` meta-model logits :math:`s`.
        teacher_logits: ``(B, C)`` PM logits :math:`t` (detached here: the PM is frozen).
        temperature: :math:`T > 0`.

    Returns:
        The scalar loss, 0 when the logits are equal up to a per-row constant.
    """
    log_p_s = F.log_softmax(student_logits / temperature, dim=1)
    log_p_t = F.log_softmax(teacher_logits.detach() / temperature, dim=1)
    return temperature**2 * F.kl_div(log_p_s, log_p_t, reduction="batchmean", log_target=True)


def logit_kd_grad(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 4.0) -> Tensor:
    r"""Closed-form :math:`\partial R_h / \partial s = \frac{T}{B}(\mathrm{softmax}(s/T) - \mathrm{softmax}(t/T))`."""
    p_s = torch.softmax(student_logits.detach() / temperature, dim=1)
    p_t = torch.softmax(teacher_logits.detach() / temperature, dim=1)
    return temperature * (p_s - p_t) / len(student_logits)


def _make_kd(temperature: float = 4.0) -> Callable[[Tensor, Tensor], Tensor]:
    if not temperature > 0:
        raise bad_value(f"{KEY}.temperature", temperature, "must be > 0")
    return partial(logit_kd, temperature=temperature)


_BUILDERS: dict[str, Callable[..., Callable[..., Tensor]]] = {"l2": lambda: l2_to_pm, "kd": _make_kd, "crd": CRD}


def make_rh(name: str, **kwargs: Any) -> Callable[..., Tensor]:
    """The :math:`R_h` option ``name`` (``algo.rh``), built with ``kwargs``; its inputs are ``RH_INPUTS[name]``.

    ``l2`` takes no arguments; ``kd`` takes ``temperature``; ``crd`` takes :class:`~flx.losses.crd.CRD`'s arguments
    and returns the module (its heads go to an optimiser, its buffers into the checkpoint).
    """
    if name not in _BUILDERS:
        raise bad_value(KEY, name, f"allowed: {', '.join(RH_OPTIONS)}")
    return _BUILDERS[name](**kwargs)
