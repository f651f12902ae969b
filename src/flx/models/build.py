"""The net of a ``model=`` config: the global model of a run (:func:`flx.run.build`) and the server's frozen models
(:mod:`flx.models.frozen`) are built by the same function, so a model config means the same net everywhere."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from flx.errors import instantiate
from flx.models import heads
from flx.models.init import init_weights

FLX_KEYS = ("binary_head", "init")
"""Keys of a model config that flx reads itself; every other key is the net constructor's."""


def net_from_config(
    model: Mapping[str, Any], input_shape: Sequence[int], num_classes: int, outputs: int | None = None
) -> nn.Module:
    """Instantiates the net of a model config (``_target_`` plus the constructor's options).

    ``model.binary_head`` and ``model.init`` are flx's keys, not arguments of the net's constructor: one_logit builds
    the net with one output column (:mod:`flx.models.heads`); init sets the starting weights (:mod:`flx.models.init`).

    Args:
        model: the ``model=`` config (a DictConfig or a plain dict).
        input_shape: per-sample input shape, e.g. ``(1, 8, 8)``.
        num_classes: classes of the task (the net gets ``heads.num_outputs`` output columns).
        outputs: the net's output columns when the task says (:meth:`flx.tasks.Task.num_outputs`; regression:
            one per target column); default: from ``num_classes`` and ``binary_head``.

    Raises:
        ConfigError: a bad ``binary_head`` / ``init``, or an option the net rejects (one line).
    """
    net_cfg = {k: v for k, v in model.items() if k not in FLX_KEYS}
    if outputs is None:
        outputs = heads.num_outputs(model.get("binary_head", "two_logits"), num_classes)
    net = instantiate(net_cfg, input_shape=list(input_shape), num_classes=outputs)
    return init_weights(net, model.get("init", "default"))
