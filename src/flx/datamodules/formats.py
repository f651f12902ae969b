"""On-disk format readers and shared helpers for :mod:`flx.datamodules.datasets`.

File lookup with a ``.gz`` fallback, IDX parsing, a numpy-only unpickler for the CIFAR pickles, ``.npz``
reading, image standardisation, and the one-line :class:`~flx.errors.ConfigError` builders and option checks.
"""

from __future__ import annotations

import gzip
import pickle
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flx.datamodules.files import MEDMNIST_KEYS as _MEDMNIST_KEYS
from flx.datamodules.store import TensorData
from flx.errors import ConfigError, bad_value

_IDX_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
_IDX_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension

_PICKLE_ALLOWED = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("_codecs", "encode"),
}

Split = tuple[np.ndarray, np.ndarray]  # (images, labels)


# ---------------------------------------------------------------------------------------------------------------------
# errors and option checks
# ---------------------------------------------------------------------------------------------------------------------


def _corrupt(data: str, path: Path, problem: str) -> ConfigError:
    """Builds the one-line "file is corrupt" error.

    Args:
        data: the ``data=`` config value.
        path: the offending file.
        problem: what is wrong with it.

    Returns:
        The error to raise.
    """
    problem = " ".join(problem.split())
    return ConfigError(f"data={data}: corrupt or unreadable file {path}: {problem} (replace it with a fresh copy)")


def _check_labels(labels: np.ndarray, count: int, num_classes: int, path: Path, data: str, first: int = 0) -> None:
    """Checks a label array against its image count and the class range.

    Args:
        labels: the labels, shape ``(N,)``.
        count: the number of images they belong to.
        num_classes: labels must lie in ``[first, first + num_classes)``.
        path: the labels' file, for error messages.
        data: the ``data=`` config value.
        first: the smallest valid label.

    Raises:
        ConfigError: on a count mismatch or an out-of-range label.
    """
    if labels.ndim != 1 or len(labels) != count:
        raise _corrupt(data, path, f"labels of shape {labels.shape} do not match {count} images")
    if count and (labels.min() < first or labels.max() >= first + num_classes):
        expected = f"expected {first}..{first + num_classes - 1}"
        raise _corrupt(data, path, f"labels span {labels.min()}..{labels.max()}, {expected}")


def _check_fraction(key: str, value: float) -> None:
    """Checks that a split fraction lies strictly between 0 and 1.

    Raises:
        ConfigError: otherwise.
    """
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value < 1.0:
        raise bad_value(key, value, "must be a fraction strictly between 0 and 1")


# ---------------------------------------------------------------------------------------------------------------------
# files and IDX
# ---------------------------------------------------------------------------------------------------------------------


def _read_bytes(path: Path, data: str) -> bytes:
    """Reads a whole file, transparently decompressing ``.gz``.

    Args:
        path: the file.
        data: the ``data=`` config value, for error messages.

    Returns:
        The (decompressed) content.

    Raises:
        ConfigError: if the file cannot be read or decompressed.
    """
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise _corrupt(data, path, str(err)) from err


def _read_idx(path: Path, magic: int, data: str) -> np.ndarray:
    """Parses an IDX file of unsigned bytes (the MNIST format).

    The layout is a big-endian int32 magic number (``0x0000 08 ndim``), ``ndim`` big-endian int32
    dimensions, then the uint8 payload in C order.

    Args:
        path: the file (plain or ``.gz``).
        magic: the expected magic number (:data:`_IDX_IMAGES_MAGIC` or :data:`_IDX_LABELS_MAGIC`).
        data: the ``data=`` config value, for error messages.

    Returns:
        A read-only uint8 array shaped by the header.

    Raises:
        ConfigError: if the magic number or the payload size is wrong.
    """
    raw = _read_bytes(path, data)
    ndim = magic & 0xFF
    header = 4 * (1 + ndim)
    if len(raw) < header:
        raise _corrupt(data, path, f"{len(raw)} bytes is shorter than the IDX header")
    found = int.from_bytes(raw[:4], "big")
    if found != magic:
        raise _corrupt(data, path, f"IDX magic number 0x{found:08x}, expected 0x{magic:08x}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    if len(raw) - header != int(np.prod(dims)):
        raise _corrupt(data, path, f"header says {dims} but the payload has {len(raw) - header} bytes")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _idx_dataset(
    data: str, found: dict[str, Path], names: Sequence[str], num_classes: int, first: int = 0
) -> tuple[Split, Split]:
    """Reads the four IDX files of an MNIST-style dataset.

    Args:
        data: the ``data=`` config value.
        found: the files by plain name (:mod:`flx.datamodules.files`).
        names: train images, train labels, test images, test labels (plain names).
        num_classes: number of classes.
        first: the smallest label in the files; labels are shifted so that it becomes 0.

    Returns:
        ``(train images (N, 1, H, W) uint8, train labels int64), (test images, test labels)``.

    Raises:
        ConfigError: if a file is corrupt.
    """
    splits = []
    for images_name, labels_name in ((names[0], names[1]), (names[2], names[3])):
        images = _read_idx(found[images_name], _IDX_IMAGES_MAGIC, data)[:, None]
        labels = _read_idx(found[labels_name], _IDX_LABELS_MAGIC, data)
        _check_labels(labels, len(images), num_classes, found[labels_name], data, first)
        splits.append((images, labels.astype(np.int64) - first))
    return splits[0], splits[1]


# ---------------------------------------------------------------------------------------------------------------------
# CIFAR pickles
# ---------------------------------------------------------------------------------------------------------------------


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that only rebuilds numpy arrays (plus builtin containers), never arbitrary objects."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name} (only numpy arrays are allowed)")
        return super().find_class(module, name)


def _unpickle(path: Path, data: str, keys: Sequence[bytes]) -> dict[bytes, Any]:
    """Loads one CIFAR batch pickle (with ``encoding="bytes"``) and checks its keys.

    Args:
        path: the pickle file.
        data: the ``data=`` config value.
        keys: byte-string keys that must be present.

    Returns:
        The batch dict.

    Raises:
        ConfigError: if the file does not unpickle to a dict with these keys.
    """
    try:
        with path.open("rb") as f:
            batch = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except Exception as err:  # unpickling a bad file can fail with almost any exception type
        raise _corrupt(data, path, f"{type(err).__name__}: {err}") from err
    if not isinstance(batch, dict) or any(k not in batch for k in keys):
        raise _corrupt(data, path, f"expected a pickled dict with keys {[k.decode() for k in keys]}")
    return batch


# ---------------------------------------------------------------------------------------------------------------------
# MedMNIST .npz
# ---------------------------------------------------------------------------------------------------------------------


def _medmnist_arrays(path: Path) -> dict[str, np.ndarray]:
    """Reads all six arrays of a MedMNIST ``.npz``.

    Args:
        path: the file.

    Returns:
        The arrays keyed by name.

    Raises:
        ConfigError: if the file is unreadable or lacks a key.
    """
    try:
        with np.load(path) as npz:
            arrays = {k: npz[k] for k in _MEDMNIST_KEYS if k in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise _corrupt("medmnist", path, f"{type(err).__name__}: {err}") from err
    missing = [k for k in _MEDMNIST_KEYS if k not in arrays]
    if missing:
        raise _corrupt("medmnist", path, f"missing keys {', '.join(missing)}")
    return arrays


# ---------------------------------------------------------------------------------------------------------------------
# image standardisation
# ---------------------------------------------------------------------------------------------------------------------


def _channel_stats(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-channel mean and std of uint8 images scaled to ``[0, 1]``, via byte histograms.

    Args:
        images: uint8 array ``(N, C, H, W)`` (any strides).

    Returns:
        Two float64 arrays of shape ``(C,)``; a zero std is replaced by 1.
    """
    values = np.arange(256, dtype=np.float64) / 255.0
    means, stds = [], []
    for c in range(images.shape[1]):
        counts = np.bincount(images[:, c].ravel(), minlength=256).astype(np.float64)
        mean = counts @ values / counts.sum()
        var = counts @ (values - mean) ** 2 / counts.sum()
        means.append(mean)
        stds.append(np.sqrt(var) if var > 0 else 1.0)
    return np.asarray(means), np.asarray(stds)


def _to_standardised(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> Tensor:
    """Converts uint8 images to float32 and standardises them in place.

    Args:
        images: uint8 array ``(N, C, H, W)`` (any strides; copied once, into the float32 result).
        mean: per-channel mean of the ``[0, 1]``-scaled train images.
        std: per-channel std of the ``[0, 1]``-scaled train images.

    Returns:
        ``(images / 255 - mean) / std`` as a contiguous float32 tensor.
    """
    out = torch.empty(images.shape, dtype=torch.float32)
    out.numpy()[...] = images
    shape = (1, -1, 1, 1)
    out.sub_(torch.as_tensor(mean * 255.0, dtype=torch.float32).view(shape))
    out.div_(torch.as_tensor(std * 255.0, dtype=torch.float32).view(shape))
    return out


def _image_data(train: Split, test: Split, num_classes: int, name: str, standardize: bool = True) -> TensorData:
    """Builds a :class:`TensorData` from uint8 images, standardised with the train split's statistics.

    Args:
        train: ``(images (N, C, H, W) uint8, labels (N,) int)``.
        test: same for the test split.
        num_classes: number of classes.
        name: dataset name for logs.
        standardize: ``False`` keeps the raw scaling ``images / 255``.

    Returns:
        The dataset.
    """
    channels = train[0].shape[1]
    mean, std = _channel_stats(train[0]) if standardize else (np.zeros(channels), np.ones(channels))
    return TensorData(
        x_train=_to_standardised(train[0], mean, std),
        y_train=torch.from_numpy(np.array(train[1], dtype=np.int64)),
        x_test=_to_standardised(test[0], mean, std),
        y_test=torch.from_numpy(np.array(test[1], dtype=np.int64)),
        num_classes=num_classes,
        name=name,
    )
