"""Synthetic classification data: Gaussian inputs labelled by a fixed random linear teacher.

.. math::
    x \\sim \\mathcal N(0, I_D),\\qquad W \\sim \\mathcal N(0, I_{D \\times K}),\\qquad
    y = \\arg\\max_k \\,(x^\\top W)_k / \\sqrt D

The classes are linearly separable (a linear model can reach 100 % accuracy), so the data is learnable,
costs no download and has any size and input shape, which makes it the data of the benchmarks
(``make bench``) and of scale tests. Everything is drawn from one ``torch.Generator`` seeded with ``seed``:
the same arguments give the same tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from flx.datamodules.store import TensorData
from flx.errors import bad_value

__all__ = ["synthetic", "teacher_labels"]

_CHUNK = 8192  # rows labelled per matmul (bounds the temporary memory of the teacher's logits)


def _positive(key: str, value: int, low: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or value < low:
        raise bad_value(f"data.loader.{key}", value, f"must be an integer >= {low}")
    return int(value)


def teacher_labels(x: Tensor, weight: Tensor) -> Tensor:
    """``argmax`` of the teacher's logits ``x_flat @ weight``, computed in row chunks; int64 labels ``(N,)``."""
    flat = x.reshape(len(x), -1)
    if not len(flat):
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([(chunk @ weight).argmax(dim=1) for chunk in flat.split(_CHUNK)])


def synthetic(
    num_samples: int = 50000,
    input_shape: Sequence[int] = (3, 32, 32),
    num_classes: int = 10,
    test_samples: int = 1000,
    seed: int = 0,
    standardize: bool = True,
) -> TensorData:
    """Gaussian inputs with labels from a fixed random linear teacher.

    Args:
        num_samples: training samples ``N``.
        input_shape: per-sample shape, e.g. ``(3, 32, 32)`` (images) or ``(20,)`` (tabular).
        num_classes: number of classes ``K >= 2``.
        test_samples: samples of the global test split (same distribution, same teacher).
        seed: seed of the inputs and of the teacher.
        standardize: unused: the inputs are drawn standard normal (accepted like every loader's).

    Returns:
        float32 inputs ``(N, *input_shape)`` (already standard normal), int64 labels in ``0..K-1``.

    Raises:
        ConfigError: a size is not a positive integer.
    """
    n, m = _positive("num_samples", num_samples), _positive("test_samples", test_samples)
    k = _positive("num_classes", num_classes, low=2)
    shape = tuple(_positive("input_shape", int(s)) for s in input_shape)
    if not shape:
        raise bad_value("data.loader.input_shape", list(input_shape), "must be a non-empty list of positive integers")
    dim = math.prod(shape)
    gen = torch.Generator().manual_seed(int(seed))
    weight = torch.randn(dim, k, generator=gen) / math.sqrt(dim)
    x = torch.randn(n + m, *shape, generator=gen)
    y = teacher_labels(x, weight)
    return TensorData(x[:n], y[:n], x[n:], y[n:], num_classes=k, name="synthetic")
