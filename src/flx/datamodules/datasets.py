"""Dataset loaders: each reads one dataset from disk (or from scikit-learn) into a :class:`TensorData`.

Every loader is a plain function with keyword arguments, usable as a Hydra ``_target_``. The on-disk
loaders take ``root`` (the data directory) first and read the files themselves: nothing is ever
downloaded, and a missing, corrupt or misconfigured dataset raises :class:`~flx.errors.ConfigError`
with a one-line message saying where the files must go and in what format.

Formats read here:

* MNIST / FashionMNIST / EMNIST: torchvision's ``raw/`` IDX files, plain or ``.gz``.
* CIFAR-10 / CIFAR-100: the "python version" pickles (unpickled with a numpy-only allowlist).
* MedMNIST: the ``medmnist`` package's ``.npz`` files.

Images become float32 ``(N, C, H, W)`` tensors, scaled to ``[0, 1]`` and standardised per channel with
the mean and standard deviation of the train split; labels become int64 ``(N,)`` tensors.
"""

from __future__ import annotations

import gzip
import pickle
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits
from sklearn.model_selection import train_test_split
from torch import Tensor

from flx.datamodules.store import TensorData
from flx.errors import ConfigError, bad_value

__all__ = [
    "LOADERS",
    "breast_cancer",
    "cifar10",
    "cifar100",
    "digits",
    "emnist",
    "fashion_mnist",
    "medmnist",
    "mnist",
]

_NO_DOWNLOAD = "downloads are disabled, place the files there or set paths.data_dir"

_IDX_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
_IDX_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension
_IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

_EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}

# name -> (number of classes, multi-label)
_MEDMNIST_2D = {
    "pathmnist": (9, False),
    "chestmnist": (14, True),
    "dermamnist": (7, False),
    "octmnist": (4, False),
    "pneumoniamnist": (2, False),
    "retinamnist": (5, False),  # ordinal regression in the paper; treated as 5 classes
    "breastmnist": (2, False),
    "bloodmnist": (8, False),
    "tissuemnist": (8, False),
    "organamnist": (11, False),
    "organcmnist": (11, False),
    "organsmnist": (11, False),
}
_MEDMNIST_SIZES = (28, 64, 128, 224)
_MEDMNIST_KEYS = ("train_images", "train_labels", "val_images", "val_labels", "test_images", "test_labels")

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


# ---------------------------------------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------------------------------------


def _data_dir(root: str | Path | None) -> Path:
    """Resolves the data directory to an absolute path.

    Args:
        root: the configured data directory.

    Returns:
        The absolute path.

    Raises:
        ConfigError: if ``root`` is empty.
    """
    if root is None or str(root).strip() == "":
        raise bad_value("paths.data_dir", root, "must be the directory that holds the datasets")
    return Path(root).expanduser().resolve()


def _not_found(data: str, what: str, where: Path, expected: str) -> ConfigError:
    """Builds the one-line "dataset not found" error.

    Args:
        data: the ``data=`` config value (e.g. ``"cifar10"``).
        what: human name of the dataset.
        where: absolute path where the files must be.
        expected: what files, in what format, are expected there.

    Returns:
        The error to raise.
    """
    return ConfigError(f"data={data}: {what} not found at {where} (expected {expected}; {_NO_DOWNLOAD})")


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


def _find_files(directory: Path, names: Sequence[str]) -> tuple[dict[str, Path], list[str]]:
    """Looks up files by name in a directory, accepting a ``.gz`` variant of each.

    Args:
        directory: where to look.
        names: the plain file names.

    Returns:
        The found paths keyed by plain name, and the list of names found in neither form.
    """
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name in names:
        for candidate in (directory / name, directory / f"{name}.gz"):
            if candidate.is_file():
                found[name] = candidate
                break
        else:
            missing.append(name)
    return found, missing


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


def _image_data(
    train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray], num_classes: int, name: str
) -> TensorData:
    """Builds a :class:`TensorData` from uint8 images, standardised with the train split's statistics.

    Args:
        train: ``(images (N, C, H, W) uint8, labels (N,) int)``.
        test: same for the test split.
        num_classes: number of classes.
        name: dataset name for logs.

    Returns:
        The dataset.
    """
    mean, std = _channel_stats(train[0])
    return TensorData(
        x_train=_to_standardised(train[0], mean, std),
        y_train=torch.from_numpy(np.array(train[1], dtype=np.int64)),
        x_test=_to_standardised(test[0], mean, std),
        y_test=torch.from_numpy(np.array(test[1], dtype=np.int64)),
        num_classes=num_classes,
        name=name,
    )


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


def _choice(key: str, value: Any, allowed: Sequence[Any]) -> None:
    """Checks that an option is one of the allowed values.

    Raises:
        ConfigError: listing the allowed values.
    """
    if value not in allowed:
        raise bad_value(key, value, "must be one of " + ", ".join(str(a) for a in allowed))


# ---------------------------------------------------------------------------------------------------------------------
# scikit-learn bundled datasets
# ---------------------------------------------------------------------------------------------------------------------


def _bundled_split(
    x: np.ndarray, y: np.ndarray, test_size: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Stratified train/test split of a small in-memory dataset.

    Args:
        x: inputs.
        y: labels.
        test_size: fraction of samples in the test split.
        seed: random state of the split.

    Returns:
        ``x_train, x_test, y_train, y_test``.
    """
    _check_fraction("data.loader.test_size", test_size)
    return train_test_split(x, y, test_size=test_size, stratify=y, random_state=seed)


def _standardise_float(x_train: np.ndarray, x_test: np.ndarray, axis: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Standardises float inputs with the train split's mean/std over ``axis`` (zero std -> 1).

    Args:
        x_train: train inputs.
        x_test: test inputs.
        axis: axes reduced to compute the statistics.

    Returns:
        Both splits as float32 tensors.
    """
    mean = x_train.mean(axis=axis, keepdims=True, dtype=np.float64)
    std = x_train.std(axis=axis, keepdims=True, dtype=np.float64)
    std[std == 0] = 1.0
    return (
        torch.from_numpy(((x_train - mean) / std).astype(np.float32)),
        torch.from_numpy(((x_test - mean) / std).astype(np.float32)),
    )


def _tabular_data(
    x: np.ndarray, y: np.ndarray, axis: tuple[int, ...], test_size: float, seed: int, name: str
) -> TensorData:
    """Splits and standardises a bundled dataset.

    Args:
        x: inputs.
        y: labels ``0..K-1``.
        axis: axes reduced for the standardisation statistics.
        test_size: fraction of samples in the test split.
        seed: random state of the split.
        name: dataset name.

    Returns:
        The dataset.
    """
    x_train, x_test, y_train, y_test = _bundled_split(x, y, test_size, seed)
    xt_train, xt_test = _standardise_float(x_train, x_test, axis)
    return TensorData(
        x_train=xt_train,
        y_train=torch.as_tensor(y_train, dtype=torch.int64),
        x_test=xt_test,
        y_test=torch.as_tensor(y_test, dtype=torch.int64),
        num_classes=int(y.max()) + 1,
        name=name,
    )


def digits(test_size: float = 0.2, seed: int = 0) -> TensorData:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).

    Args:
        test_size: fraction of samples in the (stratified) test split.
        seed: random state of the split.

    Returns:
        Inputs ``(N, 1, 8, 8)`` standardised with the train split's mean/std.
    """
    bunch = load_digits()
    return _tabular_data(bunch.images[:, None], bunch.target, (0, 2, 3), test_size, seed, "digits")


def breast_cancer(test_size: float = 0.2, seed: int = 0) -> TensorData:
    """scikit-learn's bundled Wisconsin breast-cancer table (569 samples, 30 features, 2 classes).

    Args:
        test_size: fraction of samples in the (stratified) test split.
        seed: random state of the split.

    Returns:
        Inputs ``(N, 30)`` standardised per feature with the train split's mean/std.
    """
    bunch = load_breast_cancer()
    return _tabular_data(bunch.data, bunch.target, (0,), test_size, seed, "breast_cancer")


# ---------------------------------------------------------------------------------------------------------------------
# IDX datasets (MNIST family)
# ---------------------------------------------------------------------------------------------------------------------


def _idx_dataset(
    data: str, what: str, directory: Path, names: Sequence[str], num_classes: int, first: int = 0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Reads the four IDX files of an MNIST-style dataset.

    Args:
        data: the ``data=`` config value.
        what: human name of the dataset.
        directory: the ``raw`` directory.
        names: train images, train labels, test images, test labels (plain names).
        num_classes: number of classes.
        first: the smallest label in the files; labels are shifted so that it becomes 0.

    Returns:
        ``(train images (N, H, W) uint8, train labels int64), (test images, test labels)``.

    Raises:
        ConfigError: if a file is missing or corrupt.
    """
    found, missing = _find_files(directory, names)
    if missing:
        expected = f"the IDX files {', '.join(names)} (plain or .gz); missing {', '.join(missing)}"
        raise _not_found(data, what, directory, expected)
    splits = []
    for images_name, labels_name in ((names[0], names[1]), (names[2], names[3])):
        images = _read_idx(found[images_name], _IDX_IMAGES_MAGIC, data)
        labels = _read_idx(found[labels_name], _IDX_LABELS_MAGIC, data)
        _check_labels(labels, len(images), num_classes, found[labels_name], data, first)
        splits.append((images, labels.astype(np.int64) - first))
    return splits[0], splits[1]


def _mnist_like(root: str, folder: str, data: str, what: str) -> TensorData:
    """Loads MNIST or FashionMNIST from ``<root>/<folder>/raw``.

    Args:
        root: the data directory.
        folder: torchvision's folder name.
        data: the ``data=`` config value.
        what: human name of the dataset.

    Returns:
        Inputs ``(N, 1, 28, 28)``, 10 classes.
    """
    directory = _data_dir(root) / folder / "raw"
    train, test = _idx_dataset(data, what, directory, _IDX_NAMES, 10)
    return _image_data((train[0][:, None], train[1]), (test[0][:, None], test[1]), 10, data)


def mnist(root: str) -> TensorData:
    """MNIST from torchvision's raw IDX files in ``<root>/MNIST/raw`` (60000 train, 10000 test).

    Args:
        root: the data directory.

    Returns:
        Inputs ``(N, 1, 28, 28)``, 10 classes.

    Raises:
        ConfigError: if the files are missing or corrupt.
    """
    return _mnist_like(root, "MNIST", "mnist", "MNIST")


def fashion_mnist(root: str) -> TensorData:
    """FashionMNIST from torchvision's raw IDX files in ``<root>/FashionMNIST/raw``.

    Args:
        root: the data directory.

    Returns:
        Inputs ``(N, 1, 28, 28)``, 10 classes.

    Raises:
        ConfigError: if the files are missing or corrupt.
    """
    return _mnist_like(root, "FashionMNIST", "fashion_mnist", "FashionMNIST")


def emnist(root: str, split: str = "balanced") -> TensorData:
    """EMNIST from torchvision's raw IDX files in ``<root>/EMNIST/raw/emnist-<split>-*``.

    EMNIST images are stored transposed; they are transposed back so they look like MNIST. The
    ``letters`` split's labels ``1..26`` are shifted to ``0..25``.

    Args:
        root: the data directory.
        split: one of ``byclass`` (62 classes), ``bymerge`` (47), ``balanced`` (47), ``letters`` (26),
            ``digits`` (10), ``mnist`` (10).

    Returns:
        Inputs ``(N, 1, 28, 28)``.

    Raises:
        ConfigError: on an unknown split or missing / corrupt files.
    """
    _choice("data.loader.split", split, list(_EMNIST_CLASSES))
    num_classes = _EMNIST_CLASSES[split]
    first = 1 if split == "letters" else 0
    directory = _data_dir(root) / "EMNIST" / "raw"
    names = [f"emnist-{split}-{name.replace('t10k', 'test')}" for name in _IDX_NAMES]
    train, test = _idx_dataset("emnist", f"EMNIST '{split}'", directory, names, num_classes, first)
    upright = (0, 1, 3, 2)
    return _image_data(
        (train[0][:, None].transpose(upright), train[1]),
        (test[0][:, None].transpose(upright), test[1]),
        num_classes,
        f"emnist-{split}",
    )


# ---------------------------------------------------------------------------------------------------------------------
# CIFAR (python pickles)
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


def _cifar_split(paths: Sequence[Path], label_key: bytes, num_classes: int, data: str) -> tuple[np.ndarray, np.ndarray]:
    """Reads and concatenates CIFAR batch pickles.

    Args:
        paths: the batch files.
        label_key: the labels' key (``b"labels"``, ``b"fine_labels"`` or ``b"coarse_labels"``).
        num_classes: labels must lie in ``[0, num_classes)``.
        data: the ``data=`` config value.

    Returns:
        uint8 images ``(N, 3, 32, 32)`` and int64 labels ``(N,)``.
    """
    images, labels = [], []
    for path in paths:
        batch = _unpickle(path, data, (b"data", label_key))
        x = np.asarray(batch[b"data"])
        if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
            raise _corrupt(data, path, f"b'data' is {x.dtype} {x.shape}, expected uint8 (N, 3072)")
        y = np.asarray(batch[label_key], dtype=np.int64)
        _check_labels(y, len(x), num_classes, path, data)
        images.append(x.reshape(-1, 3, 32, 32))
        labels.append(y)
    return np.concatenate(images), np.concatenate(labels)


def _cifar(
    directory: Path, train_names: Sequence[str], test_name: str, label_key: bytes, num_classes: int, data: str
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Locates and reads the train and test pickles of a CIFAR folder.

    Args:
        directory: the pickle folder.
        train_names: train batch file names.
        test_name: test batch file name.
        label_key: the labels' key.
        num_classes: number of classes.
        data: the ``data=`` config value.

    Returns:
        ``(train images, train labels), (test images, test labels)``.

    Raises:
        ConfigError: if a file is missing or corrupt.
    """
    missing = [n for n in (*train_names, test_name) if not (directory / n).is_file()]
    if missing:
        what = "CIFAR-10" if data == "cifar10" else "CIFAR-100"
        names = ", ".join((*train_names, test_name))
        expected = f"the python-pickle version: {names}; missing {', '.join(missing)}"
        raise _not_found(data, what, directory, expected)
    train = _cifar_split([directory / n for n in train_names], label_key, num_classes, data)
    test = _cifar_split([directory / test_name], label_key, num_classes, data)
    return train, test


def cifar10(root: str) -> TensorData:
    """CIFAR-10 from the python-pickle folder ``<root>/cifar-10-batches-py``.

    Args:
        root: the data directory.

    Returns:
        Inputs ``(N, 3, 32, 32)``, 10 classes.

    Raises:
        ConfigError: if the files are missing or corrupt.
    """
    directory = _data_dir(root) / "cifar-10-batches-py"
    train_names = [f"data_batch_{i}" for i in range(1, 6)]
    train, test = _cifar(directory, train_names, "test_batch", b"labels", 10, "cifar10")
    return _image_data(train, test, 10, "cifar10")


def cifar100(root: str, label: str = "fine") -> TensorData:
    """CIFAR-100 from the python-pickle folder ``<root>/cifar-100-python``.

    Args:
        root: the data directory.
        label: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).

    Returns:
        Inputs ``(N, 3, 32, 32)``.

    Raises:
        ConfigError: on an unknown ``label`` or missing / corrupt files.
    """
    _choice("data.loader.label", label, ["fine", "coarse"])
    num_classes = 100 if label == "fine" else 20
    directory = _data_dir(root) / "cifar-100-python"
    train, test = _cifar(directory, ["train"], "test", f"{label}_labels".encode(), num_classes, "cifar100")
    return _image_data(train, test, num_classes, f"cifar100-{label}")


# ---------------------------------------------------------------------------------------------------------------------
# MedMNIST (.npz)
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


def _medmnist_images(images: np.ndarray, size: int, path: Path) -> np.ndarray:
    """Checks MedMNIST images and returns a channel-first view.

    Args:
        images: uint8 ``(N, H, W)`` or ``(N, H, W, 3)``.
        size: the expected ``H`` and ``W``.
        path: the file, for error messages.

    Returns:
        A uint8 ``(N, C, H, W)`` view.
    """
    grey = images.ndim == 3
    rgb = images.ndim == 4 and images.shape[3] == 3
    if images.dtype != np.uint8 or not (grey or rgb) or images.shape[1:3] != (size, size):
        expected = f"expected uint8 (N, {size}, {size}) or (N, {size}, {size}, 3)"
        raise _corrupt("medmnist", path, f"images are {images.dtype} {images.shape}, {expected}")
    return images[:, None] if grey else images.transpose(0, 3, 1, 2)


def _medmnist_labels(labels: np.ndarray, num_classes: int, label_index: int | None, path: Path) -> np.ndarray:
    """Turns MedMNIST labels into a class vector.

    Args:
        labels: ``(N, 1)`` class labels or ``(N, K)`` multi-label 0/1 matrix.
        num_classes: the table's class count (``K`` for multi-label sets).
        label_index: for multi-label sets, the column to use as a binary label.
        path: the file, for error messages.

    Returns:
        int64 ``(N,)`` labels.
    """
    labels = np.asarray(labels).astype(np.int64, copy=False)
    if label_index is None:
        if labels.ndim != 2 or labels.shape[1] != 1:
            raise _corrupt("medmnist", path, f"labels are {labels.shape}, expected (N, 1)")
        return labels[:, 0]
    if labels.ndim != 2 or labels.shape[1] != num_classes:
        raise _corrupt("medmnist", path, f"labels are {labels.shape}, expected (N, {num_classes})")
    return labels[:, label_index]


def _medmnist_path(directory: Path, name: str, size: int) -> Path:
    """Returns the path of a MedMNIST file, raising the "not found" error if it is absent."""
    path = directory / (f"{name}.npz" if size == 28 else f"{name}_{size}.npz")
    if not path.is_file():
        expected = "the medmnist package's .npz with keys " + ", ".join(_MEDMNIST_KEYS)
        raise _not_found("medmnist", f"MedMNIST '{name}' (size {size})", path, expected)
    return path


def _check_medmnist_options(name: str, size: int, label_index: int | None, use_val: str) -> None:
    """Validates the :func:`medmnist` options.

    Raises:
        ConfigError: on any invalid option.
    """
    _choice("data.loader.name", name, list(_MEDMNIST_2D))
    _choice("data.loader.size", size, _MEDMNIST_SIZES)
    _choice("data.loader.use_val", use_val, ["drop", "train"])
    classes, multi_label = _MEDMNIST_2D[name]
    if not multi_label:
        if label_index is not None:
            raise bad_value("data.loader.label_index", label_index, f"{name} is single-label: leave it null")
        return
    valid = isinstance(label_index, int) and not isinstance(label_index, bool) and 0 <= label_index < classes
    if not valid:
        raise bad_value("data.loader.label_index", label_index, f"{name} is multi-label: pick a column in 0..{classes - 1}")


def medmnist(
    root: str, name: str = "pathmnist", size: int = 28, label_index: int | None = None, use_val: str = "drop"
) -> TensorData:
    """A 2D MedMNIST dataset from the ``medmnist`` package's ``.npz`` files.

    The file is ``<root>/<name>.npz`` for size 28 and ``<root>/<name>_<size>.npz`` otherwise.

    Args:
        root: the data directory.
        name: one of the 2D sets (pathmnist, chestmnist, dermamnist, octmnist, pneumoniamnist,
            retinamnist, breastmnist, bloodmnist, tissuemnist, organamnist, organcmnist, organsmnist).
        size: image side, 28, 64, 128 or 224.
        label_index: for the multi-label chestmnist, the column used as a binary label (required there,
            not allowed elsewhere).
        use_val: ``"drop"`` to leave the validation split out, ``"train"`` to merge it into train.

    Returns:
        Inputs ``(N, C, size, size)`` with ``C`` 1 or 3.

    Raises:
        ConfigError: on an invalid option or a missing / corrupt file.
    """
    _check_medmnist_options(name, size, label_index, use_val)
    classes, multi_label = _MEDMNIST_2D[name]
    num_classes = 2 if multi_label else classes
    path = _medmnist_path(_data_dir(root), name, size)
    arrays = _medmnist_arrays(path)
    parts = {"train": ["train", "val"] if use_val == "train" else ["train"], "test": ["test"]}
    splits = []
    for split_parts in parts.values():
        images = [_medmnist_images(arrays[f"{p}_images"], size, path) for p in split_parts]
        labels = [_medmnist_labels(arrays[f"{p}_labels"], classes, label_index, path) for p in split_parts]
        x = images[0] if len(images) == 1 else np.concatenate(images)
        y = np.concatenate(labels)
        _check_labels(y, len(x), num_classes, path, "medmnist")
        splits.append((x, y))
    suffix = "" if size == 28 else f"_{size}"
    return _image_data(splits[0], splits[1], num_classes, f"{name}{suffix}")


LOADERS: dict[str, Callable[..., TensorData]] = {
    "digits": digits,
    "breast_cancer": breast_cancer,
    "mnist": mnist,
    "fashion_mnist": fashion_mnist,
    "emnist": emnist,
    "cifar10": cifar10,
    "cifar100": cifar100,
    "medmnist": medmnist,
}
