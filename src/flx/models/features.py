"""Penultimate (pre-logit) features of a net: the representation its last linear layer maps to logits.

AugFL's regulariser (Yue, Qin et al., Section V) compares the penultimate features
``s = g^theta(x)`` of the meta-model with ``c = g^theta_p(x)`` of the pretrained model; :func:`penultimate` gives them
for any net flx builds. A net qualifies, in this order, by

- a ``features(x) -> (B, D)`` method (:class:`~flx.models.resnet_cifar.ResNetCIFAR`, :class:`~flx.models.nets.MLP`);
- a ``pre_logits(x) -> (B, D)`` method (:class:`~flx.models.nets.CNN`, whose ``features`` is its convolution stack:
  a submodule, as in torchvision's VGG, never taken for this method);
- timm's ``forward_head(forward_features(x), pre_logits=True)`` (any ``model=timm`` net).

Each native net also has ``head``, its final ``nn.Linear``, with ``forward(x) == head(penultimate(net, x))``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from flx.errors import ConfigError, bad_value
from flx.models.nets import as_shape

__all__ = ["feature_dim", "penultimate"]

_METHODS = ("features", "pre_logits")


def penultimate(net: nn.Module, x: Tensor) -> Tensor:
    """The penultimate features of ``net`` on the batch ``x``: ``(B, *input_shape) -> (B, D)``.

    Gradients flow as through ``net(x)``; the net's mode (train / eval) is the caller's.

    Raises:
        ConfigError: (one line) the net has none of the methods above.
    """
    return _extractor(net)(x)


def feature_dim(net: nn.Module, input_shape: Sequence[int]) -> int:
    """``D`` of :func:`penultimate`: the net's ``feat_dim`` where it has one, else measured on one zero input.

    The measurement runs in eval mode without gradients, so it changes no BatchNorm statistic, and leaves every
    submodule in the mode it was in.

    Raises:
        ConfigError: (one line) the net has no penultimate features, or a bad ``input_shape``.
    """
    extract = _extractor(net)  # first: a net without features fails here, not in the probe
    dim = getattr(net, "feat_dim", None)
    if isinstance(dim, int) and not isinstance(dim, bool):
        return dim
    probe = torch.zeros(1, *as_shape(input_shape))
    param = next(net.parameters(), None)
    probe = probe if param is None else probe.to(param)  # the net's dtype and device
    modes = [(m, m.training) for m in net.modules()]
    try:
        net.eval()
        with torch.no_grad():
            return int(extract(probe).shape[1])
    finally:
        for m, training in modes:
            m.training = training


def _extractor(net: nn.Module) -> Callable[[Tensor], Tensor]:
    """The function ``x -> (B, D)`` of the first way ``net`` qualifies (module docstring)."""
    for name in _METHODS:
        method = getattr(net, name, None)
        if callable(method) and not isinstance(method, nn.Module):
            return method
    if _is_timm(net):
        # (B, D); timm nets built with global_pool='' give (B, C, H, W): flattened to one vector per sample
        return lambda x: net.forward_head(net.forward_features(x), pre_logits=True).flatten(1)
    raise _no_features(net)


def _is_timm(net: nn.Module) -> bool:
    head, body = getattr(net, "forward_head", None), getattr(net, "forward_features", None)
    return callable(head) and callable(body) and "pre_logits" in inspect.signature(head).parameters


def _no_features(net: nn.Module) -> ConfigError:
    cls = type(net)
    why = (
        "has no penultimate features: it needs a features(x) or pre_logits(x) method returning (B, D) "
        "(flx's resnet_cifar, mlp, cnn) or timm's forward_features/forward_head"
    )
    return bad_value("model", f"{cls.__module__}.{cls.__qualname__}", why)
