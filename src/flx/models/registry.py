"""Name -> constructor registry for networks, in the style of timm's model registry.

Built-in entries are ``linear``, ``logreg``, ``mlp``, ``cnn``, ``resnet_cifar``, ``timm`` and the width-scalable
``cnn_scalable`` and ``resnet18_scalable`` (:mod:`flx.models.scalable`). Add your own with
:func:`register`::

    @register("my_net")
    def my_net(*, input_shape, num_classes, width=64) -> nn.Module: ...

and build any entry with :func:`build_net`, which checks the name and the options before calling it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch import nn

from flx.errors import bad_value
from flx.models.nets import CNN, MLP, Linear, LogisticRegression
from flx.models.resnet_cifar import ResNetCIFAR
from flx.models.scalable import ScalableCNN, ScalableResNet18
from flx.models.timm_factory import timm_net

__all__ = ["NETS", "build_net", "register"]

NetFactory = Callable[..., nn.Module]
F = TypeVar("F", bound=NetFactory)

#: Registered constructors; each takes ``input_shape=`` and ``num_classes=`` plus its own keyword options.
NETS: dict[str, NetFactory] = {}
# Filled in by build_net itself, not options of any one network.
_COMMON = ("input_shape", "num_classes")


def register(name: str) -> Callable[[F], F]:
    """Returns a decorator that adds a network constructor to :data:`NETS` under ``name``.

    Args:
        name: registry name, unique.

    Raises:
        ValueError: if ``name`` is already registered.
    """

    def decorator(factory: F) -> F:
        if name in NETS:
            raise ValueError(f"network {name!r} is already registered (by {NETS[name]!r})")
        NETS[name] = factory
        return factory

    return decorator


def build_net(name: str, /, input_shape: Sequence[int], num_classes: int, **kwargs: Any) -> nn.Module:
    """Builds the registered network ``name``.

    ``name`` is positional-only, so ``kwargs`` may hold a ``name`` of its own (the timm architecture), e.g.
    ``build_net("timm", input_shape=(3, 32, 32), num_classes=10, name="resnet18")``.

    Args:
        name: registry name (see :data:`NETS`).
        input_shape: per-sample input shape, e.g. ``(1, 28, 28)``.
        num_classes: number of output logits.
        **kwargs: the constructor's own options (e.g. ``hidden`` for ``mlp``).

    Returns:
        A module mapping ``(B, *input_shape)`` to logits ``(B, num_classes)``.

    Raises:
        ConfigError: unknown ``name``, an option the constructor does not take, or a bad option value.
    """
    if name not in NETS:
        raise bad_value("model.name", name, f"allowed: {', '.join(sorted(NETS))}")
    factory = NETS[name]
    _check_options(name, factory, kwargs)
    return factory(input_shape=input_shape, num_classes=num_classes, **kwargs)


def _check_options(name: str, factory: NetFactory, kwargs: dict[str, Any]) -> None:
    """Raises ConfigError naming the first option ``factory`` does not accept (unless it takes ``**kwargs``)."""
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    keyword_kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    allowed = [p for p, spec in params.items() if spec.kind in keyword_kinds and p not in _COMMON]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        key = unknown[0]
        raise bad_value(
            f"model.{key}",
            kwargs[key],
            f"not an option of model.name={name!r}; allowed: {', '.join(allowed) or 'none'}",
        )


register("linear")(Linear)
register("logreg")(LogisticRegression)
register("mlp")(MLP)
register("cnn")(CNN)
register("resnet_cifar")(ResNetCIFAR)
register("timm")(timm_net)
register("cnn_scalable")(ScalableCNN)
register("resnet18_scalable")(ScalableResNet18)
