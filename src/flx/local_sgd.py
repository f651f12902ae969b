"""The default local steps' fast path: the SGD step without ``torch.optim``'s per-call machinery, and the
minibatches' labels gathered once per client.

``torch.optim.SGD.step`` and ``zero_grad`` cost the same fixed bookkeeping a step whatever the model (profiler ranges,
step hooks, the grad-mode decorator, state and foreach bookkeeping); for a small model such as logistic regression that
was a third of the local training (docs/performance.md#costs-behind-the-codes-choices). For plain SGD (no momentum, no
weight decay: FedAvg's default), :func:`sgd_step` applies the same update with the same op, ``p += -lr * p.grad``
through ``torch._foreach_add_`` per parameter group: bitwise equal to ``SGD.step`` (on the CPU it runs tensor by tensor,
as torch's single-tensor SGD does; on CUDA it is torch's default foreach path). Each group's ``lr`` is read at every
step (parts may change it). ``torch.optim``'s step hooks do not run for these steps.

:func:`minibatches` gathers a client's integer labels for all its steps in one index operation (the inputs stay one
gather per step: see there).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor


def is_plain_sgd(opt: torch.optim.Optimizer) -> bool:
    """Whether :func:`sgd_step` computes ``opt.step()`` exactly: a ``torch.optim.SGD`` whose groups have no momentum,
    weight decay, ``maximize`` or ``differentiable``, a float learning rate, and real parameters."""
    return type(opt) is torch.optim.SGD and all(
        g["momentum"] == 0
        and g["weight_decay"] == 0
        and not g["maximize"]
        and not g["differentiable"]
        and not isinstance(g["lr"], Tensor)
        and not any(p.is_complex() for p in g["params"])
        for g in opt.param_groups
    )


def grads_of(params: Sequence[Tensor]) -> list[Tensor]:
    """The ``.grad`` of each of ``params`` after the step's backward, for the ``torch._foreach_*`` gradient transforms;
    a parameter without one (the loss does not reach it) raises, as those transforms would."""
    grads = []
    for i, p in enumerate(params):
        if p.grad is None:
            raise RuntimeError(f"parameter {i} has no gradient: the step's loss does not reach it")
        grads.append(p.grad)
    return grads


def clear_grads(opt: torch.optim.Optimizer) -> None:
    """``opt.zero_grad(set_to_none=True)``: every parameter's ``.grad`` set to None."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None


def sgd_step(opt: torch.optim.SGD) -> None:
    """``opt.step()`` of a plain SGD (:func:`is_plain_sgd`): ``p -= lr * p.grad`` for every parameter with a gradient.

    Sparse gradients (which ``_foreach_add_`` does not take) go through ``opt.step()``.
    """
    groups = [(g["lr"], [p for p in g["params"] if p.grad is not None]) for g in opt.param_groups]
    if any(p.grad.is_sparse for _, params in groups for p in params):
        opt.step()
        return
    for lr, params in groups:
        if params:
            sgd_update(params, [p.grad for p in params], None, lr)


@torch.no_grad()
def sgd_update(
    params: list[Tensor], grads: list[Tensor], buf: list[Tensor] | None, lr: float, beta: float = 0.0, wd: float = 0.0
) -> list[Tensor] | None:
    """The local steps' one update rule, ``torch.optim.SGD``'s (dampening 0, no Nesterov), on any list of tensors:
    the net's parameters (:func:`sgd_step`) or the stacked clients' ``(m, ...)`` (:class:`flx.vectorized.Stacked`).
    ``g += wd p``; ``buf = beta buf + g`` (``g`` itself at the first step: ``buf`` None); ``p -= lr buf``. Returns
    the momentum buffers (None without momentum)."""
    if wd:
        grads = torch._foreach_add(grads, params, alpha=wd)
    if beta:
        if buf is None:
            buf = [g.clone() for g in grads]
        else:
            torch._foreach_mul_(buf, beta)
            torch._foreach_add_(buf, grads)
        grads = buf
    torch._foreach_add_(params, grads, alpha=-lr)
    return buf


LABEL_ROWS = 1 << 16
"""The most rows of labels :func:`minibatches` gathers at once (512 KiB of int64 class ids)."""


def minibatches(x: Tensor, y: Tensor, batches: Iterator[Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
    """``(x[rows], y[rows])`` for each ``rows`` of ``batches`` (a client's minibatch stream), the same values as one
    gather each.

    Integer labels (class ids) are gathered for consecutive steps at once (up to :data:`LABEL_ROWS` rows) and split into
    views: one index operation for a small client's steps instead of one a step. Only there: a float tensor in a view at
    another memory offset can round differently (a 30-feature input gathered this way changed a model by 7e-8 after 10
    rounds, as the same kernels took another path), while integer labels are only looked up and compared. So inputs, and
    float targets, stay one gather a step, and the model is bitwise what it was. The stream is drawn ahead of the steps
    (the client's generator draws nothing else meanwhile).
    """
    if y.dtype.is_floating_point or y.dtype.is_complex:  # y: a tensor, or a store kept on the host (HostRows)
        for rows in batches:
            yield x[rows], y[rows]
        return
    group: list[Tensor] = []
    size = 0
    for rows in batches:
        group.append(rows)
        size += len(rows)
        if size >= LABEL_ROWS:
            yield from _with_labels(x, y, group)
            group, size = [], 0
    yield from _with_labels(x, y, group)


def _with_labels(x: Tensor, y: Tensor, steps: list[Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
    """The steps' ``(x[rows], y[rows])``, the labels from one gather."""
    labels = y[torch.cat(steps)].split([len(rows) for rows in steps]) if len(steps) > 1 else [y[r] for r in steps]
    for rows, labels_of_step in zip(steps, labels):
        yield x[rows], labels_of_step
