r"""pFedMe's personalised model solved to a tolerance: the minimiser of the client's Moreau-envelope problem.

T. Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020 (arXiv:2006.08848),
Eqs. 2-3 define client :math:`i`'s personalised model at the global model :math:`w` as

.. math::
    \theta_i(w) = \arg\min_\theta\; \phi(\theta) + h(\theta), \qquad
    \phi(\theta) = f_i(\theta) + \tfrac{\lambda}{2} \lVert \theta - w \rVert^2

(:math:`h = 0` in the paper; flx's composite extension adds the regulariser). :func:`moreau_solve` computes it on the
client's training rows (full batch, eval mode: deterministic) by accelerated proximal gradient (FISTA, Beck and
Teboulle 2009, with the backtracking step of their §4 and O'Donoghue and Candès' 2015 gradient restart, so that it
needs no estimate of the smoothness :math:`L` and a non-convex :math:`f_i` cannot make the momentum climb):

.. math::
    \theta^+ = \mathrm{prox}_{s h}\big(y - s \nabla\phi(y)\big), \qquad
    \phi(\theta^+) \le \phi(y) + \langle \nabla\phi(y), \theta^+ - y \rangle + \tfrac{1}{2s} \lVert \theta^+ - y
    \rVert^2 \ \text{(else } s \leftarrow s/2\text{)},

starting at :math:`\theta = y = w` with :math:`s = 1/\lambda` (never increased; the bound holds once
:math:`s \le 1/(L + \lambda)`). It stops when the gradient mapping :math:`G_s(y) = (y - \theta^+)/s` (zero exactly at
the minimiser) has fallen to ``tol`` times its value at the start, :math:`\lVert G_s(y) \rVert \le \mathrm{tol}\,
\lVert G_{s_0}(w) \rVert`, or when :data:`PATIENCE` iterations have not lowered the residual (a piecewise-smooth
:math:`f_i`, a ReLU net, has gradient jumps at its kinks that floor the residual, near 1e-2 on the digits MLP), or
after ``max_steps`` iterations, and returns :math:`\theta^+`; for :math:`\lambda`-strongly convex :math:`\phi` (convex
:math:`f_i`) that bounds :math:`\lVert \theta^+ - \theta_i(w) \rVert` by about :math:`\mathrm{tol}\,
\lVert w - \theta_i(w) \rVert` times the condition number :math:`(L + \lambda)/\lambda`. ``tol`` None is
:func:`default_tol` of the parameters' dtype. The line search's comparison allows the dtype's round-off of
:math:`\phi`, so float32 does not halve :math:`s` on noise. Two host reads of scalars per iteration (the step's
acceptance with the residual, the restart test): it runs at evaluation only. Cost: on the Lasso (II) protocol (30
clients x 128 rows, 1,025 parameters, float64, lambda = 15) about 290 iterations a client at the default tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flx.autodiff import loss_at as autodiff_loss_at
from flx.autodiff import sq_norm, value_and_grad_at
from flx.regularizers import Regularizer

if TYPE_CHECKING:
    from flx.context import FederationView

CHUNK = 4096  # rows a forward pass takes at most
MAX_HALVINGS = 60  # backtracking halvings of s in one iteration (2^-60: far below any useful step)
PATIENCE = 50  # iterations without a new lowest residual after which the solve stops (a kink of a ReLU net)


def default_tol(dtype: torch.dtype) -> float:
    """The relative tolerance when ``algo.personal_tol`` is null: ``1e4`` machine epsilons of ``dtype`` (float64
    2.2e-12: float64 precision in the solution; float32 1.2e-3, above float32's round-off floor of the residual)."""
    return 1e4 * torch.finfo(dtype).eps


def _dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    return torch.as_tensor(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))  # a Tensor: a is not empty


Batches = list[tuple[Tensor, Tensor]]


def batches(fed: FederationView, rows: Tensor) -> Batches:
    """``(x, y)`` of ``rows`` in chunks of at most :data:`CHUNK`, gathered once for all the iterations."""
    return [fed.batch(part) for part in rows.split(CHUNK)]


def loss_at(fed: FederationView, theta: Sequence[Tensor], data: Batches) -> Tensor:
    """:math:`f(\\theta)`, the batch-mean ``loss_fn`` over ``data`` at ``theta`` (not the net's values), float64 on
    the device; the net in its current mode, its buffers untouched (:func:`flx.autodiff.loss_at`)."""
    names = [n for n, p in fed.net.named_parameters() if p.requires_grad]
    state = (dict(zip(names, theta)), {n: b.clone() for n, b in fed.net.named_buffers()})
    with fed.step_context():
        return autodiff_loss_at(fed.net, state, data, fed.loss_fn)


def value_and_grad(fed: FederationView, theta: Sequence[Tensor], data: Batches) -> tuple[Tensor, list[Tensor]]:
    """:math:`f(\\theta)` (float64) and :math:`\\nabla f(\\theta)` over ``data``
    (:func:`flx.autodiff.value_and_grad_at`, chunk by chunk)."""
    total, rows = torch.zeros((), dtype=torch.float64, device=theta[0].device), sum(len(y) for _, y in data)
    grad = [torch.zeros_like(t) for t in theta]
    with fed.step_context():
        for x, y in data:
            value, g = value_and_grad_at(fed.net, theta, (x, y), fed.loss_fn)
            total = total + value.double() * (len(y) / rows)
            torch._foreach_add_(grad, g, alpha=len(y) / rows)
    return total, grad


def _smooth(
    fed: FederationView, theta: list[Tensor], w: Sequence[Tensor], data: Batches, lam: float
) -> tuple[Tensor, list[Tensor]]:
    r""":math:`\phi(\theta) = f(\theta) + \frac{\lambda}{2}\lVert\theta - w\rVert^2` and its gradient."""
    f, grad = value_and_grad(fed, theta, data)
    d = torch._foreach_sub(theta, list(w))
    torch._foreach_add_(grad, d, alpha=lam)
    return f + lam / 2 * sq_norm(d), grad


def _phi(fed: FederationView, theta: list[Tensor], w: Sequence[Tensor], data: Batches, lam: float) -> Tensor:
    return loss_at(fed, theta, data) + lam / 2 * sq_norm(torch._foreach_sub(theta, list(w)))


def _prox_step(
    fed: FederationView, y: list[Tensor], w: Sequence[Tensor], data: Batches, lam: float, reg: Regularizer, s: float
) -> tuple[list[Tensor], float, float]:
    """The backtracked step from ``y``: ``(theta_plus, s, ||G_s(y)||)``; ``s`` halved until the bound holds (or the
    objective is not finite: then the residual is NaN)."""
    phi_y, grad = _smooth(fed, y, w, data, lam)
    slack = 16 * torch.finfo(y[0].dtype).eps
    for _ in range(MAX_HALVINGS):
        new = reg.prox(torch._foreach_add(y, grad, alpha=-s), s)
        d = torch._foreach_sub(new, y)
        sq = sq_norm(d)
        excess = _phi(fed, new, w, data, lam) - phi_y - _dot(grad, d) - sq / (2 * s)
        ok, res = torch.stack([excess - slack * phi_y.abs(), sq.sqrt() / s]).tolist()
        if ok <= 0 or not math.isfinite(ok):
            return new, s, res if math.isfinite(ok) else math.nan
        s /= 2
    return new, s, res


def moreau_solve(
    fed: FederationView,
    w: Sequence[Tensor],
    rows: Tensor,
    lam: float,
    reg: Regularizer,
    tol: float | None = None,
    max_steps: int = 1000,
) -> tuple[list[Tensor], int, float]:
    r""":math:`\theta_i(w)` on ``rows`` (see the module docstring): ``(theta, iterations, relative residual)``; the
    residual is :math:`\lVert G \rVert / \lVert G_0 \rVert` of the last iteration (> ``tol``: ``max_steps`` reached
    or the solve stalled, NaN: the objective is not finite there). The net's parameters, buffers and mode are left
    as they were."""
    tol = default_tol(w[0].dtype) if tol is None else tol
    theta = [t.detach().clone() for t in w]
    y, t, s, first, rel, best, since = theta, 1.0, 1.0 / lam, None, math.inf, math.inf, 0
    data, was_training = batches(fed, rows), fed.net.training
    fed.net.eval()
    try:
        for k in range(max_steps):
            new, s, res = _prox_step(fed, y, w, data, lam, reg, s)
            first = res if first is None else first
            rel = res / first if first > 0 else 0.0
            best, since = (rel, 0) if rel < best else (best, since + 1)
            if not rel > tol or since >= PATIENCE:  # converged, stalled, or not finite (NaN): nothing better
                return new, k + 1, rel
            momentum = torch._foreach_sub(new, theta)
            restart = float(_dot(torch._foreach_sub(y, new), momentum)) > 0  # the step opposes the momentum
            t_next = 1.0 if restart else (1 + math.sqrt(1 + 4 * t * t)) / 2
            beta = 0.0 if restart else (t - 1) / t_next
            y = list(torch._foreach_add(new, momentum, alpha=beta)) if beta else new
            theta, t = new, t_next
    finally:
        fed.net.train(was_training)
    return theta, max_steps, rel
