r"""Per-example clipping: the sum over a batch's rows of each row's gradient clipped to an L2 norm, what DP-SGD
releases (Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep Learning with Differential Privacy", CCS
2016, arXiv:1607.00133, Algorithm 1).

Two ways to the same numbers: :func:`clipped_sum` clips per-row gradients that are already formed
(:func:`flx.autodiff.row_grads`, any net); :class:`LinearRows` never forms them, for a net of row-wise linear layers
(each row's gradient norm and the clipped sum from the layers' inputs and output gradients). Either clips a row's
gradient as one vector (``flat``) or each of its tensors on its own (``per_layer``, :func:`tensor_factors`). Used by
local DP (:mod:`flx.parts.privacy.local_dp`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

CLIP_MODES = ("flat", "per_layer")  # privacy.clip_mode


def clip_factors(norms: Tensor, clip: float) -> Tensor:
    """:math:`\\min(1, C / \\lVert g_j \\rVert)` per row (a zero gradient: :math:`C / 0 = \\infty`, so 1)."""
    return (clip / norms).clamp(max=1.0)


def tensor_factors(squares: list[Tensor], clip: float, per_layer: bool) -> list[Tensor]:
    """Each tensor's clip factors from each tensor's squared norms (per row): ``flat``, one factor for all
    :math:`L` tensors, :math:`\\min(1, C / \\lVert g \\rVert)`; ``per_layer``, each tensor to :math:`C / \\sqrt L`
    on its own, :math:`\\min(1, C / (\\sqrt L \\lVert g^{(l)} \\rVert))`, so the whole stays within :math:`C` (the
    sensitivity the noise is calibrated to either way)."""
    if not per_layer:
        return [clip_factors(sum(squares).sqrt(), clip)] * len(squares)
    return [clip_factors(sq.sqrt(), clip / math.sqrt(len(squares))) for sq in squares]


def clipped_sum(
    grads: list[Tensor], clip: float, dims: int, mask: Tensor | None = None, per_layer: bool = False
) -> list[Tensor]:
    """:math:`\\sum_j g_j \\min(1, C / \\lVert g_j \\rVert)` over the rows, the norm over all tensors of a row (or
    each tensor clipped on its own, ``per_layer``: :func:`tensor_factors`); the rows are the first ``dims``
    dimensions (rows; or clients then rows, summed over the rows only). ``mask`` (the first ``dims`` dimensions)
    leaves rows out. Each tensor's row norms come from ``vector_norm`` in its own dtype and the weighted sum is one
    matrix product per tensor: no copy of the per-row gradients (a stack of clients' rows is tens of megabytes)."""
    rows = [g.reshape(*g.shape[:dims], -1) for g in grads]  # views: (..., entries)
    squares = [torch.linalg.vector_norm(r, dim=-1).double().square() for r in rows]
    factors = tensor_factors(squares, clip, per_layer)
    out = []
    for g, r, f in zip(grads, rows, factors):
        f = (f if mask is None else f * mask).to(g.dtype)
        summed = f @ r if dims == 1 else torch.bmm(f.unsqueeze(1), r).squeeze(1)  # (entries,) or (m, entries)
        out.append(summed.reshape(*g.shape[: dims - 1], *g.shape[dims:]))
    return out


class LinearRows:
    r"""Per-row clipping of a net of row-wise linear layers without per-row gradients (Goodfellow, "Efficient
    Per-Example Gradient Computations", 2015, arXiv:1510.01799). For a layer :math:`z = a W^\top + b` on rows, row
    :math:`j`'s gradient is :math:`\delta_j a_j^\top` (weight) and :math:`\delta_j` (bias), with
    :math:`\delta_j = \partial \ell_j / \partial z_j` the gradient of the summed per-row losses at the layer's output,
    so :math:`\lVert g_j \rVert^2 = \sum_l \lVert \delta_{lj} \rVert^2 (\lVert a_{lj} \rVert^2 + [\text{bias}])` and
    :math:`\sum_j f_j g_j = (f \odot \delta)^\top a` per layer: one backward pass and one matrix product per layer,
    the same numbers as clipping the per-row gradients (``tests/parts/test_local_dp.py``).

    For nets that :func:`flx.vectorized.foldable` accepts (their parameters in ``nn.Linear`` layers, every module
    row-wise) and tasks with a per-row loss (``loss_rows``); a layer that sees more than one vector per row (a
    sequence) gets its gradients from :func:`flx.autodiff.row_grads` instead (``clipped_sum`` raises, the caller falls
    back once)."""

    def __init__(self, net: nn.Module, loss_rows: Any) -> None:
        self.net, self.loss_rows = net, loss_rows
        self.names = [name for name, p in net.named_parameters() if p.requires_grad]
        index = {name: i for i, name in enumerate(self.names)}
        self.layers = []  # (module, the weight's index in params or None, the bias's or None)
        for prefix, mod in net.named_modules():
            if isinstance(mod, nn.Linear):
                w, b = (index.get(f"{prefix}.{k}" if prefix else k) for k in ("weight", "bias"))
                if w is not None or b is not None:
                    self.layers.append((mod, w, b))

    def clipped_sum(
        self, params: tuple[Tensor, ...], x: Tensor, y: Tensor, clip: float, per_layer: bool = False
    ) -> tuple[list[Tensor], Tensor]:
        """:math:`\\sum_j \\mathrm{clip}_C(g_j)` shaped like ``params`` (flat, or ``per_layer``:
        :func:`tensor_factors`), and the rows' losses ``(B,)``."""
        inputs: dict[nn.Module, Tensor] = {}
        outputs: dict[nn.Module, Tensor] = {}

        def keep(mod: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            inputs[mod], outputs[mod] = args[0].detach(), out

        handles = [mod.register_forward_hook(keep) for mod, _, _ in self.layers]
        try:
            with torch.enable_grad():
                leaves = {n: p.detach().requires_grad_() for n, p in zip(self.names, params)}
                losses = self.loss_rows(torch.func.functional_call(self.net, leaves, (x,)), y)
                deltas = torch.autograd.grad(losses.sum(), [outputs[mod] for mod, _, _ in self.layers])
        finally:
            for h in handles:
                h.remove()
        if any(inputs[mod].dim() != 2 for mod, _, _ in self.layers):
            raise NotRowwise
        order: list[int] = []  # each trainable tensor's index in params and squared row norms, layer by layer
        squares: list[Tensor] = []
        for (mod, w, b), d in zip(self.layers, deltas):
            dd = d.double().square().sum(1)
            if w is not None:
                order.append(w)
                squares.append(dd * inputs[mod].double().square().sum(1))
            if b is not None:
                order.append(b)
                squares.append(dd)
        factors = dict(zip(order, tensor_factors(squares, clip, per_layer)))
        summed: list[Tensor] = [torch.zeros_like(p) for p in params]
        for (mod, w, b), d in zip(self.layers, deltas):
            if w is not None:
                summed[w] = (d * factors[w].to(d.dtype)[:, None]).T @ inputs[mod]
            if b is not None:
                summed[b] = (d * factors[b].to(d.dtype)[:, None]).sum(0)
        return summed, losses.detach()


class NotRowwise(Exception):
    """A linear layer saw more than one vector per row: :class:`LinearRows` does not apply."""
