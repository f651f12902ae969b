"""Dataset loaders: each reads one dataset from disk (or from scikit-learn) into a :class:`TensorData`.

Every loader is a plain function with keyword arguments, usable as a Hydra ``_target_``, with its record in the one
registry of datasets, :data:`flx.datamodules.files.DATASETS`. The on-disk loaders take ``root`` (the data directory)
first and read the files themselves: nothing is ever downloaded, and a missing, corrupt or misconfigured dataset
raises :class:`~flx.errors.ConfigError` with a one-line message saying where the files must go and in what format.

Formats read here:

* MNIST / FashionMNIST / EMNIST: torchvision's ``raw/`` IDX files, plain or ``.gz``.
* CIFAR-10 / CIFAR-100: the "python version" pickles (unpickled with a numpy-only allowlist).
* MedMNIST: the ``medmnist`` package's ``.npz`` files.
* Adult: UCI's ``adult.data`` / ``adult.test`` (read in :mod:`flx.datamodules.adult`).
* FEMNIST: LEAF JSON (read in :mod:`flx.datamodules.femnist`); 28 x 28 images of 62 classes, one group per writer.
* Shakespeare: LEAF JSON (read in :mod:`flx.datamodules.shakespeare`); inputs are int64 character ids.
* WikiText-2: the word-level ``.tokens`` files (read in :mod:`flx.datamodules.wikitext`); int64 word ids in and out
  (a masked language model).

The format readers and shared helpers live in :mod:`flx.datamodules.formats`.

Images become float32 ``(N, C, H, W)`` tensors, scaled to ``[0, 1]`` and standardised per channel with
the mean and standard deviation of the train split; labels become int64 ``(N,)`` tensors (real-valued
targets, ``diabetes``: float32). Every loader takes
``standardize`` (default true); ``False`` keeps the raw scaling (pixels / 255, digits / 16, tables as they are),
which is how :class:`~flx.datamodules.datamodule.FederatedDataModule` calls them: it standardises itself, after
carving the validation split (:mod:`flx.datamodules.protocol`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits
from sklearn.model_selection import train_test_split

from flx.datamodules import files
from flx.datamodules.adult import adult
from flx.datamodules.femnist import femnist
from flx.datamodules.files import EMNIST_CLASSES, IDX_NAMES, MEDMNIST_2D
from flx.datamodules.formats import (
    Split,
    _check_fraction,
    _check_labels,
    _corrupt,
    _idx_dataset,
    _image_data,
    _medmnist_arrays,
    _unpickle,
)
from flx.datamodules.shakespeare import shakespeare
from flx.datamodules.store import TensorData
from flx.datamodules.wikitext import wikitext2

__all__ = [
    "adult",
    "breast_cancer",
    "cifar10",
    "cifar100",
    "diabetes",
    "digits",
    "emnist",
    "fashion_mnist",
    "femnist",
    "medmnist",
    "mnist",
    "shakespeare",
    "wikitext2",
]


# ---------------------------------------------------------------------------------------------------------------------
# scikit-learn bundled datasets
# ---------------------------------------------------------------------------------------------------------------------


def _tabular_data(
    x: np.ndarray,
    y: np.ndarray,
    axis: tuple[int, ...],
    test_size: float | None,
    seed: int,
    name: str,
    scale: float,
    standardize: bool = True,
) -> TensorData:
    """Splits a bundled dataset (stratified by class; at random for real-valued targets) and scales it.

    Args:
        x: inputs.
        y: labels ``0..K-1`` (integers), or real-valued targets (floats: regression, ``num_classes`` 0).
        axis: axes reduced for the standardisation statistics.
        test_size: fraction of samples in the test split; ``None`` keeps every sample, in the dataset's order, in the
            training split and leaves the test split empty (for ``data.split_file``, which then lists the test rows).
        seed: random state of the split.
        name: dataset name.
        scale: the raw scaling ``x / scale`` (digits: 16, the largest pixel value).
        standardize: z-score with the train split's mean/std (zero std -> 1); ``False`` keeps ``x / scale``.

    Returns:
        The dataset, inputs as float32 and labels as int64 tensors (real-valued targets as float32).

    Raises:
        ConfigError: if ``test_size`` is not a fraction strictly between 0 and 1 (or ``None``).
    """
    x, real = x / scale, np.issubdtype(y.dtype, np.floating)
    if test_size is None:
        x_train, x_test, y_train, y_test = x, x[:0], y, y[:0]
    else:
        _check_fraction("data.loader.test_size", test_size)
        strata = None if real else y
        x_train, x_test, y_train, y_test = train_test_split(
            x, y, test_size=test_size, stratify=strata, random_state=seed
        )
    mean = x_train.mean(axis=axis, keepdims=True, dtype=np.float64) if standardize else 0.0
    std = x_train.std(axis=axis, keepdims=True, dtype=np.float64) if standardize else np.ones(1)
    std[std == 0] = 1.0
    return TensorData(
        x_train=torch.from_numpy(((x_train - mean) / std).astype(np.float32)),
        y_train=torch.as_tensor(y_train, dtype=torch.float32 if real else torch.int64),
        x_test=torch.from_numpy(((x_test - mean) / std).astype(np.float32)),
        y_test=torch.as_tensor(y_test, dtype=torch.float32 if real else torch.int64),
        num_classes=0 if real else int(y.max()) + 1,
        name=name,
    )


def digits(test_size: float | None = 0.2, seed: int = 0, standardize: bool = True) -> TensorData:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).

    Args:
        test_size: fraction of samples in the (stratified) test split (``None``: no split, see :func:`_tabular_data`).
        seed: random state of the split.
        standardize: z-score with the train split's mean/std; ``False`` gives pixels / 16 in ``[0, 1]``.

    Returns:
        Inputs ``(N, 1, 8, 8)``.
    """
    bunch = load_digits()
    return _tabular_data(bunch.images[:, None], bunch.target, (0, 2, 3), test_size, seed, "digits", 16.0, standardize)


def breast_cancer(test_size: float | None = 0.2, seed: int = 0, standardize: bool = True) -> TensorData:
    """scikit-learn's bundled Wisconsin breast-cancer table (569 samples, 30 features, 2 classes).

    Args:
        test_size: fraction of samples in the (stratified) test split (``None``: no split, see :func:`_tabular_data`).
        seed: random state of the split.
        standardize: z-score per feature with the train split's mean/std; ``False`` keeps the raw measurements.

    Returns:
        Inputs ``(N, 30)``.
    """
    bunch = load_breast_cancer()
    return _tabular_data(bunch.data, bunch.target, (0,), test_size, seed, "breast_cancer", 1.0, standardize)


def diabetes(test_size: float | None = 0.2, seed: int = 0, standardize: bool = True) -> TensorData:
    """scikit-learn's bundled diabetes table (442 patients, 10 features): a regression task.

    The target is a measure of disease progression one year after baseline, a real number in ``[25, 346]`` (mean 152,
    std 77), returned as given; ``data.standardize_target`` z-scores it with the training rows' statistics
    (:mod:`flx.datamodules.protocol`). The inputs are scikit-learn's raw measurements (``scaled=False``: age, sex,
    BMI, blood pressure and six blood serum values), not its own pre-scaled copy.

    Args:
        test_size: fraction of samples in the (random) test split (``None``: no split, see :func:`_tabular_data`).
        seed: random state of the split.
        standardize: z-score per feature with the train split's mean/std; ``False`` keeps the raw measurements.

    Returns:
        Inputs ``(N, 10)``, float32 targets ``(N,)``, ``num_classes`` 0.
    """
    bunch = load_diabetes(scaled=False)
    return _tabular_data(bunch.data, bunch.target, (0,), test_size, seed, "diabetes", 1.0, standardize)


# ---------------------------------------------------------------------------------------------------------------------
# IDX datasets (MNIST family)
# ---------------------------------------------------------------------------------------------------------------------


def mnist(root: str, standardize: bool = True) -> TensorData:
    """MNIST from torchvision's raw IDX files in ``<root>/MNIST/raw`` (60000 train, 10000 test).

    Args:
        root: the data directory.

    Returns:
        Inputs ``(N, 1, 28, 28)``, 10 classes.

    Raises:
        ConfigError: if the files are missing or corrupt.
    """
    return _image_data(*_idx_dataset("mnist", files.mnist(root), IDX_NAMES, 10), 10, "mnist", standardize)


def fashion_mnist(root: str, standardize: bool = True) -> TensorData:
    """FashionMNIST from torchvision's raw IDX files in ``<root>/FashionMNIST/raw``.

    Args:
        root: the data directory.

    Returns:
        Inputs ``(N, 1, 28, 28)``, 10 classes.

    Raises:
        ConfigError: if the files are missing or corrupt.
    """
    splits = _idx_dataset("fashion_mnist", files.fashion_mnist(root), IDX_NAMES, 10)
    return _image_data(*splits, 10, "fashion_mnist", standardize)


def emnist(root: str, split: str = "balanced", standardize: bool = True) -> TensorData:
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
    found = files.emnist(root, split)
    num_classes, first = EMNIST_CLASSES[split], 1 if split == "letters" else 0
    splits = _idx_dataset("emnist", found, files.emnist_names(split), num_classes, first)
    train, test = ((x.transpose(0, 1, 3, 2), y) for x, y in splits)  # stored transposed: turn them upright
    return _image_data(train, test, num_classes, f"emnist-{split}", standardize)


# ---------------------------------------------------------------------------------------------------------------------
# CIFAR (python pickles)
# ---------------------------------------------------------------------------------------------------------------------


def _cifar(
    found: dict[str, Path], train_names: Sequence[str], test_name: str, label_key: bytes, num_classes: int, data: str
) -> tuple[Split, Split]:
    """Reads the train and test batch pickles of a CIFAR folder.

    Args:
        found: the pickle files by name (:mod:`flx.datamodules.files`).
        train_names: train batch file names.
        test_name: test batch file name.
        label_key: the labels' key (``b"labels"``, ``b"fine_labels"`` or ``b"coarse_labels"``).
        num_classes: labels must lie in ``[0, num_classes)``.
        data: the ``data=`` config value.

    Returns:
        ``(train images, train labels), (test images, test labels)``, as uint8 ``(N, 3, 32, 32)`` and int64 ``(N,)``.

    Raises:
        ConfigError: if a file is corrupt.
    """
    splits = []
    for split_names in (train_names, [test_name]):
        images, labels = [], []
        for path in (found[n] for n in split_names):
            batch = _unpickle(path, data, (b"data", label_key))
            x = np.asarray(batch[b"data"])
            if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
                raise _corrupt(data, path, f"b'data' is {x.dtype} {x.shape}, expected uint8 (N, 3072)")
            y = np.asarray(batch[label_key], dtype=np.int64)
            _check_labels(y, len(x), num_classes, path, data)
            images.append(x.reshape(-1, 3, 32, 32))
            labels.append(y)
        splits.append((np.concatenate(images), np.concatenate(labels)))
    return splits[0], splits[1]


def cifar10(root: str, standardize: bool = True) -> TensorData:
    """CIFAR-10 from the python-pickle folder ``<root>/cifar-10-batches-py``.

    Args:
        root: the data directory.

    Returns:
        Inputs ``(N, 3, 32, 32)``, 10 classes.

    Raises:
        ConfigError: if the files are missing or corrupt.
    """
    train, test = _cifar(files.cifar10(root), files.CIFAR10_TRAIN, "test_batch", b"labels", 10, "cifar10")
    return _image_data(train, test, 10, "cifar10", standardize)


def cifar100(root: str, label: str = "fine", standardize: bool = True) -> TensorData:
    """CIFAR-100 from the python-pickle folder ``<root>/cifar-100-python``.

    Args:
        root: the data directory.
        label: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).

    Returns:
        Inputs ``(N, 3, 32, 32)``.

    Raises:
        ConfigError: on an unknown ``label`` or missing / corrupt files.
    """
    found = files.cifar100(root, label)
    num_classes = 100 if label == "fine" else 20
    train, test = _cifar(found, ["train"], "test", f"{label}_labels".encode(), num_classes, "cifar100")
    return _image_data(train, test, num_classes, f"cifar100-{label}", standardize)


# ---------------------------------------------------------------------------------------------------------------------
# MedMNIST (.npz)
# ---------------------------------------------------------------------------------------------------------------------


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
    width = 1 if label_index is None else num_classes
    if labels.ndim != 2 or labels.shape[1] != width:
        raise _corrupt("medmnist", path, f"labels are {labels.shape}, expected (N, {width})")
    return labels[:, 0 if label_index is None else label_index]


def medmnist(
    root: str,
    name: str = "pathmnist",
    size: int = 28,
    label_index: int | None = None,
    use_val: str = "drop",
    standardize: bool = True,
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
    path = files.medmnist(root, name, size, label_index, use_val)  # checks the options first
    classes, multi_label = MEDMNIST_2D[name]
    num_classes = 2 if multi_label else classes
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
    return _image_data(splits[0], splits[1], num_classes, f"{name}{suffix}", standardize)
