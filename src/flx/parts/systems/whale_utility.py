r"""WHALE-FL's scheduling maths as pure functions: the per-batch Fisher information, the training efficiency, the
utility and its quantisation into a sub-network level.

H. Su, J. Geng, L. Li, X. Qin, Y. Hou, H. Wang, X. Fu, M. Pan, "WHALE-FL: Wireless and Heterogeneity Aware Latency
Efficient Federated Learning over Mobile Devices via Adaptive Subnetwork Scheduling", 2024 (Eq. 3 in "Fisher
Information", Eqs. 4-9 in "WHALE-FL Design"). Symbols: ``FI`` the scalar Fisher information of a batch, ``B`` the
client's batches, ``D`` the window of past rounds, ``T`` the preferred round time, ``beta`` the exponent of SE, ``U_th``
the threshold, ``P`` the levels:

.. math::
    TE = |\mathbf B| \sqrt{\tfrac{1}{|\mathbf B| |\mathbf D|} \textstyle\sum_{k, d} FI_{r-d}(k)^2}    \quad(5)
    \qquad SE = \frac{T}{T^{co} + T^{tr}}                                                               \quad(4)

    Util = TE \cdot SE^{\beta}  \quad(6) \qquad U_n = \min(Util / U_{th}, 1)  \quad(7) \qquad
    \hat p = \min\{p : U_n \ge (P - p) / P\}  \quad(9) \qquad p = \max(\hat p, p^{max})  \quad(8)

Level ``p`` trains width ``s^(p-1)`` (``s = 1/2``). ``T^co, T^tr`` are the smallest level's times this round.

**FI per batch** (Eq. 3 is a matrix; the paper does not say how it becomes a scalar), :func:`batch_fisher_tensor`:

- ``trace_empirical`` (default): ``tr F_emp = (1/|b|) sum_{n in b} ||grad_W l(x_n, y_n)||^2`` over the sub-model's
  entries. The squared norm of the batch gradient is *not* this (it is ``||mean_n g_n||^2``); the per-sample
  norms come from one forward and backward of the batch (:mod:`flx.models.per_sample`: the Gram form per layer,
  about 3 training steps' cost), or from ``torch.func`` (``vmap`` of ``grad``, in chunks; tens of training steps on a
  CPU) for nets with other layers (LayerNorm, embeddings). Static BatchNorm layers
  normalise each sample with the **batch's** statistics, held constant (captured by a no-grad forward of the batch),
  so each sample's output is exactly its output in the batch and its gradient is that of its own loss with the
  statistics fixed. ``samples`` (the part's ``fisher_samples``, default all) limits it to the batch's first
  ``samples`` rows: the minibatch is a uniform draw without replacement, so its first rows are too, and their mean is
  an unbiased estimate of the batch's trace. A sample is a row: for a masked LM (``task=masked_lm``) ``l(x_n, y_n)``
  is the row's mean loss over its scored tokens (0 for a row with none). Dropout in training mode draws its own mask
  for each sample (``vmap(randomness="different")`` in the ``torch.func`` path; one batch forward in the other), as
  in the training step, from the client's seeded stream;
- ``trace_sampled``: the same with labels drawn from the model's predictive distribution ``softmax(f(x))`` (the
  "true" Fisher of Eq. 3, as FedFIM), from a generator the caller seeds; for token targets one word per scored
  position;
- ``max_tensor_mean``: the authors' code: ``max`` over the parameter tensors of ``mean(g^2) / |b|`` of the training
  gradient ``g`` (the mean over the sub-model's entries of each tensor).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from flx.models.per_sample import sq_norms
from flx.models.scalable import StaticBatchNorm2d

FISHER = ("trace_empirical", "trace_sampled", "max_tensor_mean")
SCHEDULERS = ("whale", "te_only", "se_only", "fixed", "full")


def quantise(u_n: float, levels: int) -> int:
    """Eq. 9: level ``1`` if ``U_n >= (P-1)/P``, ..., ``P`` if ``U_n < 1/P``; compared with each threshold, so
    ``0.8 -> 1`` and ``0.6 -> 2`` exactly for ``P = 5``.

    >>> [quantise(u, 5) for u in (1.0, 0.8, 0.79, 0.6, 0.4, 0.2, 0.19, 0.0)]
    [1, 1, 2, 2, 3, 4, 5, 5]
    """
    for p in range(1, levels):
        if u_n >= (levels - p) / levels:
            return p
    return levels


def utility(te: float, t_co: float, t_tr: float, *, T: float, beta: float, mode: str = "whale") -> float:
    """Eq. 6 ``Util = TE * SE^beta`` with ``SE = T / (T^co + T^tr)`` (Eq. 4); ``te_only``: ``TE``; ``se_only``:
    ``SE^beta`` (the paper's ablations, Fig. 3).

    >>> utility(2.0, 1.5, 0.5, T=4.0, beta=2.0)
    8.0
    """
    se = T / (t_co + t_tr)
    if mode == "te_only":
        return te
    if mode == "se_only":
        return se**beta
    return te * se**beta


def level(util: float, *, u_th: float, levels: int, p_max: int) -> int:
    """Eqs. 7-9: ``U_n = min(Util / U_th, 1)``, quantised, then capped by the device: ``max(p_hat, p_max)``.

    >>> level(45.0, u_th=50.0, levels=5, p_max=1), level(45.0, u_th=50.0, levels=5, p_max=3)
    (1, 3)
    """
    return max(quantise(min(util / u_th, 1.0), levels), p_max)


def width(p: int, s: float = 0.5) -> float:
    """Level ``p``'s width ratio ``s^(p-1)``."""
    return float(s ** (p - 1))


def training_efficiency(window: Sequence[float], batches: int) -> float:
    """Eq. 5 from the window's per-round means of ``FI^2`` over the batches (equal batch counts per round make the
    mean of the round means the mean over all rounds and batches): ``|B| sqrt(mean(window))``.

    >>> training_efficiency([4.0, 16.0], 3)
    9.486832980505138
    """
    return batches * math.sqrt(sum(window) / len(window))


def batch_fisher_tensor(
    net: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    masks: Sequence[Tensor] | None,
    kind: str = "trace_empirical",
    generator: torch.Generator | None = None,
    samples: int | None = None,
    chunk_size: int = 16,
) -> Tensor:
    """The scalar ``FI`` of the batch ``(x, y)`` for the net's trainable parameters (see the module docstring).

    ``masks``: 0/1 tensors aligned with the trainable parameters (longer lists are cut), the sub-model's entries
    (None: all); ``samples``: the traces use the batch's first ``samples`` rows (None: all). ``max_tensor_mean``
    reads the gradients already in ``p.grad``; the traces leave ``p.grad`` alone.
    """
    params = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    ms = [torch.ones_like(p) for _, p in params] if masks is None else list(masks)[: len(params)]
    if kind == "max_tensor_mean":
        means = [
            ((p.grad * m) ** 2).sum() / m.sum().clamp_min(1) for (_, p), m in zip(params, ms) if p.grad is not None
        ]
        return torch.stack(means).max().double() / len(x)
    x, y = (x, y) if samples is None else (x[:samples], y[:samples])
    if kind == "trace_sampled":  # token targets (B, L): a word per scored position, -100 stays
        with torch.no_grad():
            probs = torch.softmax(net(x).detach().double(), dim=-1)
        drawn = torch.multinomial(probs.flatten(0, -2), 1, generator=generator).view(probs.shape[:-1])
        y = torch.where(y < 0, y, drawn)
    return per_sample_sq_norms(net, loss_fn, x, y, ms, chunk_size).mean().double()


def per_sample_sq_norms(
    net: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    masks: Sequence[Tensor],
    chunk_size: int = 16,
) -> Tensor:
    """``(|b|,)``: ``||m * grad_W l(x_n, y_n)||^2`` per sample, static BN with the batch's statistics held fixed."""
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    values = {n: p.detach() for n, p in net.named_parameters() if p.requires_grad}
    layers = [m for m in net.modules() if isinstance(m, StaticBatchNorm2d)]
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m not in layers for m in net.modules()):
        raise ValueError("per-sample Fisher: only static BatchNorm (flx.models.scalable) is supported")
    frozen = _batch_stats(net, layers, x) if net.training else {}

    def sq_norm(xn: Tensor, yn: Tensor) -> Tensor:
        def loss(v: dict[str, Tensor]) -> Tensor:
            return loss_fn(torch.func.functional_call(net, v, (xn[None],)), yn[None])

        grads = torch.func.grad(loss)(values)
        return sum(((grads[n] * m) ** 2).sum() for n, m in zip(names, masks))

    saved = [(m, m.training, m.stat_mean, m.stat_var) for m in layers]
    try:
        for m in layers:  # sBN in eval with the batch's statistics: the Scalers stay in training mode
            m.training, (m.stat_mean, m.stat_var) = False, frozen.get(m, (m.stat_mean, m.stat_var))
        fast = sq_norms(net, loss_fn, x, y, masks)  # one forward and backward; None: a layer it cannot handle
        if fast is not None:
            return fast.detach()
        # dropout (the LM's) draws a mask per sample, as a training step does; nets without dropout draw nothing
        return torch.func.vmap(sq_norm, chunk_size=chunk_size, randomness="different")(x, y).detach()
    finally:
        for m, training, mean, var in saved:
            m.training, m.stat_mean, m.stat_var = training, mean, var


@torch.no_grad()
def _batch_stats(net: nn.Module, layers: list[StaticBatchNorm2d], x: Tensor) -> dict[nn.Module, tuple[Tensor, Tensor]]:
    """Each sBN layer's input mean and biased variance over the batch and positions (what training mode uses)."""
    stats: dict[nn.Module, tuple[Tensor, Tensor]] = {}

    def capture(m: nn.Module, args: tuple[Tensor, ...]) -> None:
        a = args[0].transpose(0, 1).flatten(1)  # (B, C, H, W) -> (C, B H W)
        stats[m] = (a.mean(dim=1), a.var(dim=1, unbiased=False))

    hooks = [m.register_forward_pre_hook(capture) for m in layers]
    try:
        if layers:
            net(x)
    finally:
        for h in hooks:
            h.remove()
    return stats
