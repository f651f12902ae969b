"""Binary, imbalanced versions of any multi-class dataset (LibAUC-style), with optional label noise.

Guo, Jin, Luo, Yang, "FeDXL", ICML 2023 (Sec. 4, Appendix C.1): CIFAR-10/100 made binary and imbalanced
(``imratio`` = positives / all training samples), and 20% label flips for the noisy-label table (Table 3).

* ``positive`` classes become label 1, all others label 0 (default: the first half of the classes, as LibAUC).
* the training split keeps a random subset of its positives so that positives make ``imratio`` of it
  (``null`` keeps every sample); the test split is left as it is, so test metrics see the natural ratio.
* ``flip_rate`` flips that fraction of each training class (chosen once, before partitioning); the test
  split stays clean.
* with a ``protocol`` (as :class:`~flx.datamodules.datamodule.FederatedDataModule` calls it), the validation split is
  carved from the source's training rows FIRST (:func:`flx.datamodules.protocol.carve`): the validation rows keep
  the natural ratio and clean labels, like the test split; only the remaining training rows are subsampled and flipped.
  So are the server rows (``data.server_fraction``, the tail of the training split): never subsampled or flipped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import Tensor

from flx.datamodules.protocol import DataProtocol, carve
from flx.datamodules.store import TensorData
from flx.errors import bad_value


def binarize(
    source: Callable[[], TensorData],
    positive: Sequence[int] | None = None,
    imratio: float | None = None,
    flip_rate: float = 0.0,
    seed: int = 0,
    protocol: DataProtocol | None = None,
) -> TensorData:
    """Loads ``source()`` and turns it into a binary task.

    Args:
        source: a loader (e.g. a Hydra partial of :func:`flx.datamodules.datasets.cifar10`).
        positive: the classes that become label 1 (default: ``range(num_classes // 2)``).
        imratio: fraction of positives kept in the training split, in ``(0, 1)``; ``None`` keeps all samples.
        flip_rate: fraction of each training class whose label is flipped, in ``[0, 0.5)``.
        seed: seed of the subsampling and of the flips.
        protocol: if given, ``source(standardize=False)`` is carved by it first and the result is left unscaled
            (the datamodule standardises); if ``None`` the source's own output is used as it is.

    Returns:
        The binary data (``num_classes == 2``, name ``<source>-binary``).
    """
    data = source() if protocol is None else carve(source(standardize=False), protocol)
    pos = list(range(data.num_classes // 2)) if positive is None else [int(c) for c in positive]
    if not pos or any(not 0 <= c < data.num_classes for c in pos) or len(set(pos)) == data.num_classes:
        raise bad_value("data.loader.positive", list(pos), f"some, not all, of the classes 0..{data.num_classes - 1}")
    if imratio is not None and not 0 < imratio < 1:
        raise bad_value("data.loader.imratio", imratio, "must be in (0, 1), or null to keep every sample")
    if not 0 <= flip_rate < 0.5:
        raise bad_value("data.loader.flip_rate", flip_rate, "must be in [0, 0.5)")
    rng = np.random.default_rng(seed)
    y_train, y_test = _is_positive(data.y_train, pos), _is_positive(data.y_test, pos)
    n = data.num_client_rows  # the server rows after them are kept whole, with clean labels
    keep = _keep_for_ratio(y_train[:n].numpy(), imratio, rng)
    y_train = torch.cat([_flip(y_train[keep], flip_rate, rng), y_train[n:]])
    keep = torch.cat([keep, torch.arange(n, len(data.y_train))])
    y_val = None if data.y_val is None else _is_positive(data.y_val, pos)
    return replace(
        data,
        x_train=data.x_train[keep],
        y_train=y_train,
        y_val=y_val,
        y_test=y_test,
        num_classes=2,
        name=f"{data.name}-binary",
        groups_train=None if data.groups_train is None else data.groups_train[keep],
    )


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
