"""Binary, imbalanced versions of any multi-class dataset (LibAUC-style), with optional label noise.

Guo, Jin, Luo, Yang, "FeDXL", ICML 2023 (§3 of the digest): CIFAR-10/100 made binary and imbalanced
(``imratio`` = positives / all training samples), and 20% label flips for the noisy-label table (Table 3).

* ``positive`` classes become label 1, all others label 0 (default: the first half of the classes, as LibAUC).
* the training split keeps a random subset of its positives so that positives make ``imratio`` of it
  (``null`` keeps every sample); the test split is left as it is, so test metrics see the natural ratio.
* ``flip_rate`` flips that fraction of each training class (chosen once, before partitioning); the test
  split stays clean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from flx.datamodules.store import TensorData
from flx.errors import bad_value


def binarize(
    source: Callable[[], TensorData],
    positive: Sequence[int] | None = None,
    imratio: float | None = None,
    flip_rate: float = 0.0,
    seed: int = 0,
) -> TensorData:
    """Loads ``source()`` and turns it into a binary task.

    Args:
        source: a loader (e.g. a Hydra partial of :func:`flx.datamodules.datasets.cifar10`).
        positive: the classes that become label 1 (default: ``range(num_classes // 2)``).
        imratio: fraction of positives kept in the training split, in ``(0, 1)``; ``None`` keeps all samples.
        flip_rate: fraction of each training class whose label is flipped, in ``[0, 0.5)``.
        seed: seed of the subsampling and of the flips.

    Returns:
        The binary data (``num_classes == 2``, name ``<source>-binary``).
    """
    data = source()
    pos = list(range(data.num_classes // 2)) if positive is None else [int(c) for c in positive]
    if not pos or any(not 0 <= c < data.num_classes for c in pos) or len(set(pos)) == data.num_classes:
        raise bad_value("data.loader.positive", list(pos), f"some, not all, of the classes 0..{data.num_classes - 1}")
    if imratio is not None and not 0 < imratio < 1:
        raise bad_value("data.loader.imratio", imratio, "must be in (0, 1), or null to keep every sample")
    if not 0 <= flip_rate < 0.5:
        raise bad_value("data.loader.flip_rate", flip_rate, "must be in [0, 0.5)")
    rng = np.random.default_rng(seed)
    y_train, y_test = _is_positive(data.y_train, pos), _is_positive(data.y_test, pos)
    keep = _keep_for_ratio(y_train.numpy(), imratio, rng)
    y_train = _flip(y_train[keep], flip_rate, rng)
    return TensorData(data.x_train[keep], y_train, data.x_test, y_test, 2, f"{data.name}-binary")


def _is_positive(y: Tensor, positive: list[int]) -> Tensor:
    return torch.isin(y, torch.tensor(positive)).long()


def _keep_for_ratio(y: np.ndarray, imratio: float | None, rng: np.random.Generator) -> Tensor:
    """Indices keeping every negative and ``round(imratio / (1 - imratio) * #neg)`` positives (sorted)."""
    if imratio is None:
        return torch.arange(len(y))
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    n_pos = int(round(imratio / (1 - imratio) * len(neg)))
    if n_pos > len(pos) or n_pos < 1:
        raise bad_value("data.loader.imratio", imratio, f"needs {n_pos} positives; the training split has {len(pos)}")
    return torch.from_numpy(np.sort(np.concatenate([rng.choice(pos, n_pos, replace=False), neg])))


def _flip(y: Tensor, rate: float, rng: np.random.Generator) -> Tensor:
    """Flips ``round(rate * n_c)`` labels of each class ``c``."""
    if rate == 0:
        return y
    y, out = y.numpy(), y.clone()
    for c in (0, 1):
        members = np.flatnonzero(y == c)
        chosen = rng.choice(members, int(round(rate * len(members))), replace=False)
        out[torch.from_numpy(chosen)] = 1 - c
    return out
