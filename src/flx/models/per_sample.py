r"""Per-sample squared gradient norms from one forward and one backward of the batch.

For a layer :math:`y = W a + b` applied at positions :math:`t = 1..T` of sample :math:`n` (one position for a dense
layer; the output pixels of a convolution, with :math:`a_{n,t}` the unfolded input patch), the per-sample gradient is
:math:`G_n = \sum_t \delta_{n,t} a_{n,t}^\top`, :math:`\delta_{n,t} = \partial \ell_n / \partial y_{n,t}`, and

.. math::
    \lVert G_n \rVert_F^2 = \sum_{t, s} (a_{n,t}^\top a_{n,s}) (\delta_{n,t}^\top \delta_{n,s})
    \qquad\text{(the Gram form, } O(T^2 (d_{in} + d_{out}))\text{)}, \qquad
    \lVert \textstyle\sum_t \delta_{n,t} \rVert^2 \text{ for } b.

The Gram form is used where it is cheaper than forming :math:`G_n` (:math:`T^2 (d_{in} + d_{out}) < d_{in} d_{out}`;
always for dense layers, :math:`T = 1`), otherwise :math:`G_n` is formed. An affine norm layer in evaluation
(:math:`y = \gamma \hat a + \beta`, :math:`\hat a` normalised with **fixed** statistics) has
:math:`\partial \ell_n / \partial \gamma = \sum_t \delta_{n,t} \odot \hat a_{n,t}` and
:math:`\partial \ell_n / \partial \beta = \sum_t \delta_{n,t}`.

The :math:`\delta_{n,t}` come from one backward of :math:`\sum_n \ell(f(x_n), y_n)` (each sample's own loss, as a
one-sample batch of ``loss_fn``) to the layers' outputs, so no weight gradient is computed. A 0/1 mask that is an outer
product of an output-channel and an input-channel selection (the width masks of :mod:`flx.models.width`) is applied
to :math:`\delta` and :math:`a` before the products, which is exact: :math:`m \odot G_n = \sum_t (r \odot
\delta_{n,t})(c \odot a_{n,t})^\top`.

Supported layers: ``nn.Linear`` (inputs ``(B, ..., d_in)``), ``nn.Conv2d`` (zero padding given as numbers, one group),
and BatchNorm layers in evaluation mode with statistics in effect (``StaticBatchNorm2d`` with rebuilt or frozen
statistics, ``nn.BatchNorm2d`` with running statistics). :func:`sq_norms` returns ``None`` for a net with any other
layer that owns trainable parameters, a layer called more than once per forward, or a mask that is not an outer
product; the caller then uses a general method (``torch.func``). The net must treat samples independently (no batch
statistics): its output for sample ``n`` is its output as a one-sample batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flx.models.scalable import StaticBatchNorm2d

__all__ = ["sq_norms"]


def sq_norms(
    net: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    masks: Sequence[Tensor] | None = None,
) -> Tensor | None:
    """``(B,)``: ``||m * grad_W loss_fn(net(x[n:n+1]), y[n:n+1])||^2`` over the net's trainable parameters ``W``,
    or None where the net is not supported (see the module docstring). ``masks`` align with the trainable parameters
    (None: all ones). Parameters and their ``.grad`` are left alone."""
    params = [p for p in net.parameters() if p.requires_grad]
    mask_of = {id(p): m for p, m in zip(params, masks)} if masks is not None else {}
    layers = []
    for mod in net.modules():
        own = [p for p in mod.parameters(recurse=False) if p.requires_grad]
        if own:
            if _kind(mod) is None:
                return None
            layers.append(mod)
    factors = {}
    for mod in layers:
        factors[mod] = _factor(mod, mask_of)
        if factors[mod] is None:
            return None
    acts: dict[nn.Module, Tensor] = {}
    outs: dict[nn.Module, Tensor] = {}
    calls = dict.fromkeys(layers, 0)

    def capture(mod: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
        calls[mod] += 1
        acts[mod], outs[mod] = args[0].detach(), out
        return out.clone()  # the next layer may act in place (ReLU(inplace=True)); ``out`` keeps the layer's value

    hooks = [m.register_forward_hook(capture) for m in layers]
    try:
        out = net(x)
    finally:
        for h in hooks:
            h.remove()
    if any(c != 1 for c in calls.values()):
        return None
    total = sum(loss_fn(out[n : n + 1], y[n : n + 1]) for n in range(len(x)))  # each sample's own loss
    used = [m for m in layers if outs[m].requires_grad]
    deltas = torch.autograd.grad(total, [outs[m] for m in used], allow_unused=True)
    result = torch.zeros(len(x), dtype=out.dtype, device=out.device)
    for mod, delta in zip(used, deltas):
        if delta is not None:
            result += _layer_sq_norms(mod, acts[mod], delta.detach(), factors[mod])
    return result


def _kind(mod: nn.Module) -> str | None:
    if isinstance(mod, nn.Linear):
        return "linear"
    if isinstance(mod, nn.Conv2d):
        ok = mod.groups == 1 and mod.padding_mode == "zeros" and not isinstance(mod.padding, str)
        return "conv" if ok else None
    if isinstance(mod, nn.BatchNorm2d) and mod.affine and _norm_stats(mod) is not None:
        return "norm"
    return None


def _norm_stats(mod: nn.BatchNorm2d) -> tuple[Tensor, Tensor] | None:
    """The fixed statistics a BatchNorm layer normalises with in its current mode, or None (batch statistics)."""
    if mod.training:
        return None
    if isinstance(mod, StaticBatchNorm2d):
        return None if mod.stat_mean is None else (mod.stat_mean, mod.stat_var)
    if mod.track_running_stats and mod.running_mean is not None:
        return mod.running_mean, mod.running_var
    return None


Factors = tuple[Tensor | None, Tensor | None, Tensor | None]  # (row mask, column mask, bias / shift mask)


def _factor(mod: nn.Module, mask_of: dict[int, Tensor]) -> Factors | None:
    """The masks of ``mod``'s tensors as (output selection, input selection, bias selection); None if a weight mask
    is not an outer product. None entries: keep everything."""
    weight, bias = getattr(mod, "weight", None), getattr(mod, "bias", None)
    wm = mask_of.get(id(weight)) if weight is not None and weight.requires_grad else None
    bm = mask_of.get(id(bias)) if bias is not None and bias.requires_grad else None
    if wm is None or wm.dim() == 1:
        return wm, None, bm
    rows = wm.flatten(1).amax(1)
    cols = wm.transpose(0, 1).flatten(1).amax(1)
    shape = [1] * (wm.dim() - 2)
    if not torch.equal(wm, (rows.view(-1, 1, *shape) * cols.view(1, -1, *shape)).expand_as(wm)):
        return None
    return rows, cols, bm


def _layer_sq_norms(mod: nn.Module, a: Tensor, delta: Tensor, factors: Factors) -> Tensor:
    rows, cols, bias_mask = factors
    kind = _kind(mod)
    if kind == "norm":
        mean, var = _norm_stats(mod)
        shape = (1, -1, 1, 1)
        a_hat = (a - mean.view(shape)) / torch.sqrt(var.view(shape) + mod.eps)
        g_w = (delta * a_hat).flatten(2).sum(2)  # (B, C)
        g_b = delta.flatten(2).sum(2)
        if rows is not None:
            g_w = g_w * rows
        if bias_mask is not None:
            g_b = g_b * bias_mask
        total = (g_w**2).sum(1) if mod.weight.requires_grad else 0.0
        return total + ((g_b**2).sum(1) if mod.bias is not None and mod.bias.requires_grad else 0.0)
    b = a.shape[0]
    if kind == "conv":
        patches = F.unfold(a, mod.kernel_size, dilation=mod.dilation, padding=mod.padding, stride=mod.stride)
        a_t = patches.transpose(1, 2)  # (B, T, C_in k_h k_w), channel-major columns
        d_t = delta.flatten(2).transpose(1, 2)  # (B, T, C_out)
        if cols is not None:
            cols = cols.repeat_interleave(mod.kernel_size[0] * mod.kernel_size[1])
    else:
        a_t, d_t = a.reshape(b, -1, a.shape[-1]), delta.reshape(b, -1, delta.shape[-1])
    total = torch.zeros(b, dtype=delta.dtype, device=delta.device)
    if mod.bias is not None and mod.bias.requires_grad:
        g_b = d_t.sum(1)
        total += ((g_b if bias_mask is None else g_b * bias_mask) ** 2).sum(1)
    if mod.weight.requires_grad:
        if rows is not None:
            d_t = d_t * rows
        if cols is not None:
            a_t = a_t * cols
        t, d_in, d_out = a_t.shape[1], a_t.shape[2], d_t.shape[2]
        if t * t * (d_in + d_out) <= d_in * d_out:  # the Gram form
            total += ((a_t @ a_t.transpose(1, 2)) * (d_t @ d_t.transpose(1, 2))).sum((1, 2))
        else:
            total += (torch.einsum("bto,bti->boi", d_t, a_t) ** 2).sum((1, 2))
    return total
