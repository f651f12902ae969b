r"""Gradients and Hessian-vector products of a net's minibatch loss at any parameters, the net left untouched.

The second-order parts need derivatives at points other than the net's current weights: pFedFBE (anonymous ICLR
submission, Algorithm 1 lines 8 and 11) takes :math:`\nabla f_i(w; D)` and
:math:`\nabla^2 f_i(w; \hat D)\, u`; AugFL (Yue, Qin et al., Eq. 10) replaces the
MAML Hessian-vector product with a central difference of two support-set gradients. With
:math:`f(w) = \ell(\mathrm{net}(x; w), y)` on one batch :math:`(x, y)`:

.. math::
    \texttt{grad\_at}(w) = \nabla f(w), \qquad
    \texttt{hvp}(w, v) = \begin{cases}
        \nabla_w \langle \nabla f(w), v \rangle = \nabla^2 f(w)\, v & \texttt{exact} \\
        \dfrac{\nabla f(w + \tau v) - \nabla f(w - \tau v)}{2 \tau}, \quad
        \tau = \dfrac{\epsilon}{\max(\lVert v \rVert, \epsilon')} & \texttt{fd} \\
        0 & \texttt{none}
    \end{cases}

``fd`` is a central difference (error :math:`O(\tau^2)`), not pFedFBE's forward difference
:math:`(\nabla f(w + \tau u) - \nabla f(w)) / \tau` (error :math:`O(\tau)`): with independent batches
:math:`D \ne \hat D` (the theory's setting) both cost two gradients on :math:`\hat D`. The pFedFBE paper (Sec. 2.2) does
not give the step ``t``; ours: the perturbation :math:`\tau v` has norm :math:`\epsilon` (``eps``, default ``FD_EPS`` =
:math:`10^{-3}`) whatever the scale of :math:`v`; :math:`\epsilon'` is the dtype's smallest normal number (a zero
:math:`v` gives 0). Truncation grows as :math:`\epsilon^2` and round-off as :math:`\mathrm{eps}_{\text{mach}} /
\epsilon`, balanced near :math:`\mathrm{eps}_{\text{mach}}^{1/3}`: on a small tanh MLP the relative error at
:math:`10^{-3}` is about :math:`3 \cdot 10^{-6}` in float64 and :math:`3 \cdot 10^{-4}` in float32 (round-off
dominates there; ``eps=5e-3`` gives :math:`7 \cdot 10^{-5}`), far below minibatch noise either way. AugFL's Eq. 10
with radius :math:`\delta` and un-normalised :math:`r` is ``eps = delta * ||r||`` (then :math:`\tau = \delta`).

Guarantees of every call: the net's parameters, their ``.grad`` and its buffers are not changed (buffers enter as
clones, so BatchNorm running statistics and ``num_batches_tracked`` stay); the net's train/eval mode is kept, so in
train mode BatchNorm normalises with the batch statistics and dropout is active; the global random streams (CPU, and
CUDA for the parameters' devices) are as before the call. Dropout draws the same masks in every gradient of one call,
so the two gradients of ``fd`` differ only through :math:`w \pm \tau v`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn
from torch.func import functional_call

LossFn = Callable[[Tensor, Tensor], Tensor]
StateArg = Mapping[str, Tensor] | tuple[Mapping[str, Tensor], ...]
HVP_MODES = ("exact", "fd", "none")
FD_EPS = 1e-3  # norm of the perturbation tau * v in the ``fd`` mode


def _same_rng(params: Sequence[Tensor]) -> AbstractContextManager[None]:
    """Restores the CPU generator and the CUDA generators of ``params``' devices on exit."""
    return torch.random.fork_rng(devices=list({p.device for p in params if p.is_cuda}))


def _leaves(params: Sequence[Tensor]) -> list[Tensor]:
    """``params`` as tensors that require grad: kept as given if they already do (then differentiable through)."""
    return [p if p.requires_grad else p.detach().requires_grad_(True) for p in params]


def _value_and_grad(
    net: nn.Module, w: list[Tensor], batch: Sequence[Tensor], loss_fn: LossFn, create_graph: bool
) -> tuple[Tensor, list[Tensor]]:
    r""":math:`f(w)` (detached) and :math:`\nabla f(w)` by ``functional_call``; ``w`` requires grad; no RNG
    protection (callers fork)."""
    names = [name for name, p in net.named_parameters() if p.requires_grad]
    if len(names) != len(w):
        raise ValueError(f"got {len(w)} tensors for the net's {len(names)} trainable parameters")
    buffers = {name: b.clone() for name, b in net.named_buffers()}  # BN statistics update the clones
    x, y = batch[0], batch[1]
    loss = loss_fn(functional_call(net, (dict(zip(names, w)), buffers), (x,)), y)
    return loss.detach(), list(torch.autograd.grad(loss, w, create_graph=create_graph, materialize_grads=True))


def _grad(
    net: nn.Module, w: list[Tensor], batch: Sequence[Tensor], loss_fn: LossFn, create_graph: bool
) -> list[Tensor]:
    return _value_and_grad(net, w, batch, loss_fn, create_graph)[1]


def value_and_grad_at(
    net: nn.Module, params: Sequence[Tensor], batch: Sequence[Tensor], loss_fn: LossFn
) -> tuple[Tensor, list[Tensor]]:
    """The loss (detached scalar) and :func:`grad_at` of one forward and backward pass, with its guarantees."""
    with _same_rng(params):
        return _value_and_grad(net, _leaves(params), batch, loss_fn, False)


def grad_at(
    net: nn.Module, params: Sequence[Tensor], batch: Sequence[Tensor], loss_fn: LossFn, create_graph: bool = False
) -> list[Tensor]:
    r"""Gradient of ``loss_fn(net(x), y)`` at ``params`` instead of the net's weights.

    Args:
        net: the model; its trainable parameters (``requires_grad``, in ``parameters()`` order) are replaced.
        params: one tensor per trainable parameter, same shapes; ones that require grad stay in the graph.
        batch: ``(x, y)``.
        loss_fn: ``loss_fn(outputs, y)``, a scalar.
        create_graph: keep the graph of the gradient (for a derivative of it); otherwise the result is detached.

    Returns:
        :math:`\nabla f(w)` as a list shaped like ``params``.
    """
    with _same_rng(params):
        return _grad(net, _leaves(params), batch, loss_fn, create_graph)


RowGrads = Callable[[tuple[Tensor, ...], Tensor, Tensor], tuple[tuple[Tensor, ...], Tensor]]


def row_grads(net: nn.Module, loss_rows: LossFn) -> RowGrads:
    r"""Per-example gradients: a function ``(params, x, y) -> (grads, losses)`` giving every row's own gradient
    :math:`\nabla_w \ell(\mathrm{net}(x_j; w), y_j)`, ``(B, *p.shape)`` per trainable parameter, and its loss
    ``(B,)``, with ``params`` in place of the net's trainable parameters (``torch.func``: ``vmap`` over the rows of
    ``grad`` of one row's loss, so the result is a function of each row alone; ``torch.func.vmap`` of it over a
    leading client dimension of ``params``, ``x`` and ``y`` gives stacked clients' rows). ``loss_rows(outputs,
    target)`` is the task's per-row loss. The net's buffers enter as they are (a net that normalises over the batch,
    BatchNorm, has no per-example gradient); dropout draws a mask per row from the global generator. At least one
    row."""
    names = [name for name, p in net.named_parameters() if p.requires_grad]

    def one(params: tuple[Tensor, ...], x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        loss = loss_rows(functional_call(net, dict(zip(names, params)), (x.unsqueeze(0),)), y.unsqueeze(0)).sum()
        return loss, loss.detach()

    return torch.func.vmap(torch.func.grad(one, has_aux=True), in_dims=(None, 0, 0), randomness="different")


def sq_norm(tensors: Sequence[Tensor]) -> Tensor:
    r""":math:`\sum_k \lVert t_k \rVert^2`, summed in float64."""
    return sum(t.double().pow(2).sum() for t in tensors)


@torch.no_grad()
def loss_at(net: nn.Module, state: StateArg, batches: Sequence[Sequence[Tensor]], loss_fn: LossFn) -> Tensor:
    """The mean of ``loss_fn`` over ``batches`` (``(x, y)`` pairs, each batch mean weighted by its rows, summed in
    float64) with the net's tensors replaced by ``state``: ``{name: tensor}``, or a tuple of such dicts, as
    :func:`torch.func.functional_call` takes it. The net runs in its current mode; its tensors are not touched (a
    buffer missing from ``state`` is the net's own: pass clones where a train-mode BatchNorm would update it)."""
    total = sum(loss_fn(functional_call(net, state, (x,)), y).double() * len(y) for x, y in batches)
    return total / sum(len(y) for _, y in batches)


def hvp(
    net: nn.Module,
    params: Sequence[Tensor],
    v: Sequence[Tensor],
    batch: Sequence[Tensor],
    loss_fn: LossFn,
    mode: str = "exact",
    eps: float | None = None,
) -> list[Tensor]:
    r"""Hessian-vector product :math:`\nabla^2 f(w)\, v` of ``loss_fn(net(x), y)`` at ``params`` (module docstring).

    Args:
        net: the model, as in :func:`grad_at`.
        params: the point :math:`w`, one tensor per trainable parameter.
        v: the direction, shaped like ``params``.
        batch: ``(x, y)``.
        loss_fn: ``loss_fn(outputs, y)``, a scalar.
        mode: ``exact`` (double backward), ``fd`` (central difference of two gradients) or ``none`` (zeros: the
            first-order approximation).
        eps: ``fd`` only: the norm :math:`\epsilon` of the perturbation :math:`\tau v`; ``None`` is ``FD_EPS``.

    Returns:
        :math:`\nabla^2 f(w)\, v` (or its estimate), detached, shaped like ``params``.

    Raises:
        ValueError: ``mode`` is not one of ``HVP_MODES``.
    """
    if mode not in HVP_MODES:
        raise ValueError(f"hvp mode must be one of {HVP_MODES}, got {mode!r}")
    if mode == "none":
        return [torch.zeros_like(p) for p in params]
    v = [t.detach() for t in v]
    with _same_rng(params):
        if mode == "exact":
            w = [p.detach().requires_grad_(True) for p in params]
            g = _grad(net, w, batch, loss_fn, create_graph=True)
            return list(torch.autograd.grad(g, w, grad_outputs=v, materialize_grads=True))
        norm = torch.sqrt(sum(t.pow(2).sum() for t in v))
        radius = FD_EPS if eps is None else eps.to(norm.dtype) if isinstance(eps, Tensor) else eps
        tau = radius / norm.clamp_min(torch.finfo(norm.dtype).tiny)
        with _same_rng(params):  # the second gradient draws the same dropout masks as the first
            plus = _grad(net, _leaves([p.detach() + tau * t for p, t in zip(params, v)]), batch, loss_fn, False)
        minus = _grad(net, _leaves([p.detach() - tau * t for p, t in zip(params, v)]), batch, loss_fn, False)
    return [(a - b) / (2 * tau) for a, b in zip(plus, minus)]
