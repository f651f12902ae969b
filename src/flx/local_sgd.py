"""The local SGD step without ``torch.optim``'s per-call machinery, for plain SGD.

``torch.optim.SGD.step`` and ``zero_grad`` take ~50 us a step on the CPU whatever the model: profiler ranges, step
hooks, the grad-mode decorator, state and foreach bookkeeping. The arithmetic of a small model's step is a few
microseconds, and its forward, loss and backward ~80 us, so for logistic regression the optimizer's bookkeeping was
a third of the local training. For plain SGD (no momentum, no weight decay: FedAvg's default), :func:`sgd_step`
applies the same update with the same op, ``p += -lr * p.grad`` through ``torch._foreach_add_`` per parameter group:
bitwise equal to ``SGD.step`` (on the CPU it runs tensor by tensor, as torch's single-tensor SGD does; on CUDA it is
torch's default foreach path). Each group's ``lr`` is read at every step (parts may change it). ``torch.optim``'s
step hooks do not run for these steps.
"""

from __future__ import annotations

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
    with torch.no_grad():
        for lr, params in groups:
            if params:
                torch._foreach_add_(params, [p.grad for p in params], alpha=-lr)
