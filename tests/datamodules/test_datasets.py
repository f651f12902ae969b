"""Tests for the dataset loaders: tiny files in the real on-disk formats, loaded through the real loaders."""

from __future__ import annotations

import gzip
import os
import pickle
import re
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from flx.datamodules import datasets, formats
from flx.datamodules.datasets import (
    breast_cancer,
    cifar10,
    cifar100,
    diabetes,
    digits,
    emnist,
    fashion_mnist,
    medmnist,
    mnist,
)
from flx.datamodules.files import DATASETS
from flx.datamodules.store import TensorData
from flx.errors import ConfigError

RNG = np.random.default_rng(1234)
MNIST_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


# ---------------------------------------------------------------------------------------------------------------------
# writers for the real formats
# ---------------------------------------------------------------------------------------------------------------------


def idx_bytes(array: np.ndarray) -> bytes:
    """Encodes a uint8 array as an IDX file (big-endian magic 0x0000 08 ndim, dims, payload)."""
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_file(path: Path, content: bytes, gz: bool = False) -> Path:
    """Writes bytes to ``path`` (or ``path.gz``, gzipped), creating the parent folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(content)
    else:
        path.write_bytes(content)
    return path


def write_idx_set(directory: Path, names: tuple[str, ...], splits: dict, gz: bool = False) -> None:
    """Writes train/test images and labels as four IDX files named ``names``."""
    arrays = (splits["train"][0], splits["train"][1], splits["test"][0], splits["test"][1])
    for name, array in zip(names, arrays, strict=True):
        write_file(directory / name, idx_bytes(array), gz)


def make_images(n: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random uint8 images."""
    return RNG.integers(0, 256, size=(n, *shape), dtype=np.uint8)


def make_split(n: int, shape: tuple[int, ...], num_classes: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Random uint8 images with labels cycling through ``offset..offset+num_classes-1``."""
    return make_images(n, shape), (np.arange(n) % num_classes + offset).astype(np.uint8)


def write_pickle(path: Path, obj: object, protocol: int = 2) -> None:
    """Pickles ``obj`` to ``path`` (protocol 2, as the CIFAR python files)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(obj, protocol=protocol))


def cifar_batch(n: int, labels: dict[bytes, list[int]]) -> dict[bytes, object]:
    """A CIFAR batch dict with the real keys."""
    batch: dict[bytes, object] = {
        b"batch_label": b"testing batch",
        b"data": make_images(n, (3072,)),
        b"filenames": [f"img_{i}.png".encode() for i in range(n)],
    }
    batch.update(labels)
    return batch


def write_cifar10(root: Path, protocol: int = 2) -> tuple[list[dict], dict]:
    """Writes five train batches of 2 images and a test batch of 3 images."""
    directory = root / "cifar-10-batches-py"
    train = [cifar_batch(2, {b"labels": [2 * i, 2 * i + 1]}) for i in range(5)]
    for i, batch in enumerate(train, start=1):
        write_pickle(directory / f"data_batch_{i}", batch, protocol)
    test = cifar_batch(3, {b"labels": [9, 0, 4]})
    write_pickle(directory / "test_batch", test, protocol)
    return train, test


def write_cifar100(root: Path) -> tuple[dict, dict]:
    """Writes a CIFAR-100 train (4 images) and test (2 images) file."""
    directory = root / "cifar-100-python"
    train = cifar_batch(4, {b"fine_labels": [99, 0, 57, 12], b"coarse_labels": [19, 0, 3, 7]})
    test = cifar_batch(2, {b"fine_labels": [1, 98], b"coarse_labels": [2, 18]})
    write_pickle(directory / "train", train)
    write_pickle(directory / "test", test)
    return train, test


def medmnist_arrays(shape: tuple[int, ...], labels: tuple[np.ndarray, ...]) -> dict[str, np.ndarray]:
    """MedMNIST arrays with the real keys; ``labels`` gives the train, val, test label arrays."""
    arrays = {}
    for split, y in zip(("train", "val", "test"), labels, strict=True):
        arrays[f"{split}_images"] = make_images(len(y), shape)
        arrays[f"{split}_labels"] = y
    return arrays


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Writes an ``.npz`` as the medmnist package does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)


# ---------------------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------------------


def channel_stats(train_images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reference per-channel mean/std of ``(N, C, H, W)`` uint8 images scaled to [0, 1]."""
    scaled = train_images.astype(np.float64) / 255.0
    return scaled.mean(axis=(0, 2, 3)), scaled.std(axis=(0, 2, 3))


def assert_images(x: torch.Tensor, expected: np.ndarray, stats: tuple[np.ndarray, np.ndarray]) -> None:
    """Asserts that un-standardising ``x`` gives back ``expected / 255`` exactly (up to float32)."""
    assert x.dtype == torch.float32 and tuple(x.shape) == expected.shape
    mean, std = (s[None, :, None, None] for s in stats)
    np.testing.assert_allclose(x.numpy() * std + mean, expected / 255.0, atol=1e-5)


def assert_standardised(x: torch.Tensor) -> None:
    """Asserts per-channel mean ~0 and std ~1."""
    dims = (0, *range(2, x.ndim))
    x64 = x.double()
    torch.testing.assert_close(x64.mean(dim=dims), torch.zeros(x.shape[1], dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(
        x64.std(dim=dims, correction=0), torch.ones(x.shape[1], dtype=torch.float64), atol=1e-4, rtol=0
    )


def assert_labels(y: torch.Tensor, expected: np.ndarray | list[int]) -> None:
    """Asserts int64 labels equal to ``expected``."""
    assert y.dtype == torch.int64
    assert y.tolist() == [int(v) for v in expected]


def raises_one_line(func: Callable[..., object], *args: object, match: str, **kwargs: object) -> str:
    """Calls ``func`` and asserts a one-line :class:`ConfigError` whose message contains ``match``."""
    with pytest.raises(ConfigError) as info:
        func(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert match in message, message
    return message


# ---------------------------------------------------------------------------------------------------------------------
# bundled datasets
# ---------------------------------------------------------------------------------------------------------------------


def test_digits_shapes_classes_stratified() -> None:
    data = digits()
    assert isinstance(data, TensorData) and data.name == "digits"
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert len(data.x_train) + len(data.x_test) == 1797
    assert len(data.x_test) == pytest.approx(0.2 * 1797, abs=1)
    assert set(data.y_test.tolist()) == set(range(10))
    assert_standardised(data.x_train)
    # stratified: each class's share of the test split matches its share of train
    train_share = torch.bincount(data.y_train, minlength=10) / len(data.y_train)
    test_share = torch.bincount(data.y_test, minlength=10) / len(data.y_test)
    assert torch.allclose(train_share, test_share, atol=0.01)


def test_digits_deterministic_under_seed() -> None:
    a, b, c = digits(seed=3), digits(seed=3), digits(seed=4)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)


def test_breast_cancer_per_feature_standardised() -> None:
    data = breast_cancer(test_size=0.25, seed=1)
    assert data.input_shape == (30,) and data.num_classes == 2 and data.name == "breast_cancer"
    assert len(data.x_train) + len(data.x_test) == 569
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    x = data.x_train.double()
    assert torch.allclose(x.mean(0), torch.zeros(30, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(x.std(0, correction=0), torch.ones(30, dtype=torch.float64), atol=1e-4)
    assert abs(data.y_train.double().mean() - data.y_test.double().mean()) < 0.02


@pytest.mark.parametrize("test_size", [0.0, 1.0, -0.1, 1.5, True])
def test_bundled_bad_test_size(test_size: float) -> None:
    raises_one_line(digits, test_size=test_size, match="data.loader.test_size=")
    raises_one_line(breast_cancer, test_size=test_size, match="data.loader.test_size=")


def test_diabetes_is_a_regression_table() -> None:
    """442 rows, 10 features, float32 targets as given (25..346), a random 20% test split: no classes."""
    data = diabetes()
    assert data.name == "diabetes" and data.input_shape == (10,) and data.num_classes == 0 and data.real_targets
    assert (len(data.x_train), len(data.x_test)) == (353, 89)
    assert data.y_train.dtype == data.y_test.dtype == torch.float32
    y = torch.cat([data.y_train, data.y_test])
    assert (float(y.min()), float(y.max())) == (25.0, 346.0)
    assert_standardised(data.x_train)
    assert torch.equal(diabetes(seed=3).y_test, diabetes(seed=3).y_test)
    raises_one_line(diabetes, test_size=1.5, match="data.loader.test_size=")


# ---------------------------------------------------------------------------------------------------------------------
# MNIST family (IDX)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("loader", "folder", "gz"),
    [(mnist, "MNIST", False), (mnist, "MNIST", True), (fashion_mnist, "FashionMNIST", False)],
)
def test_mnist_like_roundtrip(tmp_path: Path, loader: Callable[..., TensorData], folder: str, gz: bool) -> None:
    splits = {"train": make_split(12, (28, 28), 10), "test": make_split(5, (28, 28), 10)}
    write_idx_set(tmp_path / folder / "raw", MNIST_NAMES, splits, gz)
    data = loader(root=str(tmp_path))
    assert data.num_classes == 10 and data.input_shape == (1, 28, 28)
    stats = channel_stats(splits["train"][0][:, None])
    assert_images(data.x_train, splits["train"][0][:, None], stats)
    assert_images(data.x_test, splits["test"][0][:, None], stats)
    assert_labels(data.y_train, splits["train"][1])
    assert_labels(data.y_test, splits["test"][1])
    assert_standardised(data.x_train)


def test_mnist_mixed_plain_and_gz(tmp_path: Path) -> None:
    splits = {"train": make_split(3, (28, 28), 10), "test": make_split(2, (28, 28), 10)}
    raw = tmp_path / "MNIST" / "raw"
    arrays = (*splits["train"], *splits["test"])
    for i, (name, array) in enumerate(zip(MNIST_NAMES, arrays, strict=True)):
        write_file(raw / name, idx_bytes(array), gz=bool(i % 2))
    data = mnist(root=str(tmp_path))
    assert_labels(data.y_test, splits["test"][1])


def test_mnist_missing_files_message(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    message = raises_one_line(mnist, root=str(tmp_path), match=f"data=mnist: MNIST not found at {raw.resolve()} ")
    assert "t10k-labels-idx1-ubyte" in message and "downloads are disabled" in message
    splits = {"train": make_split(3, (28, 28), 10), "test": make_split(2, (28, 28), 10)}
    write_idx_set(raw, MNIST_NAMES, splits)
    (raw / "t10k-images-idx3-ubyte").unlink()
    message = raises_one_line(mnist, root=str(tmp_path), match="missing t10k-images-idx3-ubyte")
    assert "missing t10k-images-idx3-ubyte (" not in message and "t10k-labels" in message


def test_relative_root_reported_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    raises_one_line(fashion_mnist, root="data", match=str(tmp_path.resolve() / "data" / "FashionMNIST" / "raw"))
    raises_one_line(mnist, root="", match="paths.data_dir=")


def corrupt_variants(images: np.ndarray, labels: np.ndarray) -> dict[str, tuple[str, bytes, str]]:
    """Names of corruptions -> (file to overwrite, bad content, expected message fragment)."""
    good_labels = idx_bytes(labels)
    return {
        "magic": ("train-labels-idx1-ubyte", idx_bytes(images[:, 0, :]), "magic number 0x00000802"),
        "truncated": ("train-images-idx3-ubyte", idx_bytes(images)[:-1], "payload"),
        "trailing": ("train-labels-idx1-ubyte", good_labels + b"\x00", "payload"),
        "short": ("t10k-images-idx3-ubyte", b"\x00\x00", "header"),
        "count": ("train-labels-idx1-ubyte", idx_bytes(labels[:-1]), "do not match"),
        "range": ("train-labels-idx1-ubyte", idx_bytes(np.full_like(labels, 10)), "labels span 10..10"),
    }


@pytest.mark.parametrize("kind", ["magic", "truncated", "trailing", "short", "count", "range"])
def test_mnist_corrupt_file_named(tmp_path: Path, kind: str) -> None:
    splits = {"train": make_split(4, (28, 28), 10), "test": make_split(2, (28, 28), 10)}
    raw = tmp_path / "MNIST" / "raw"
    write_idx_set(raw, MNIST_NAMES, splits)
    name, content, fragment = corrupt_variants(*splits["train"])[kind]
    write_file(raw / name, content)
    message = raises_one_line(mnist, root=str(tmp_path), match=f"corrupt or unreadable file {(raw / name).resolve()}")
    assert fragment in message


def test_mnist_bad_gzip_named(tmp_path: Path) -> None:
    splits = {"train": make_split(4, (28, 28), 10), "test": make_split(2, (28, 28), 10)}
    raw = tmp_path / "MNIST" / "raw"
    write_idx_set(raw, MNIST_NAMES, splits)
    (raw / "t10k-labels-idx1-ubyte").unlink()
    bad = write_file(raw / "t10k-labels-idx1-ubyte.gz", b"not gzip at all")
    raises_one_line(mnist, root=str(tmp_path), match=str(bad.resolve()))
    with gzip.open(bad, "wb") as f:
        f.write(idx_bytes(splits["test"][1]))
    bad.write_bytes(bad.read_bytes()[:-6])  # truncated gzip stream
    raises_one_line(mnist, root=str(tmp_path), match=str(bad.resolve()))


def emnist_names(split: str) -> tuple[str, ...]:
    """The four torchvision EMNIST raw file names of ``split``."""
    parts = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "test-images-idx3-ubyte", "test-labels-idx1-ubyte")
    return tuple(f"emnist-{split}-{p}" for p in parts)


def test_emnist_transposed_back(tmp_path: Path) -> None:
    splits = {"train": make_split(8, (28, 28), 47), "test": make_split(3, (28, 28), 47)}
    splits["train"][1][-1] = 46
    write_idx_set(tmp_path / "EMNIST" / "raw", emnist_names("balanced"), splits, gz=True)
    data = emnist(root=str(tmp_path))
    assert data.num_classes == 47 and data.name == "emnist-balanced"
    upright = splits["train"][0].transpose(0, 2, 1)[:, None]
    stats = channel_stats(upright)
    assert_images(data.x_train, upright, stats)
    assert_images(data.x_test, splits["test"][0].transpose(0, 2, 1)[:, None], stats)
    assert data.x_train.is_contiguous()
    assert_labels(data.y_train, splits["train"][1])
    # a single bright pixel at stored (row 2, col 5) shows up at (row 5, col 2)
    image = np.zeros((1, 28, 28), np.uint8)
    image[0, 2, 5] = 255
    one = {"train": (np.concatenate([image, image * 0]), np.array([0, 1], np.uint8)), "test": (image, np.array([0]))}
    write_idx_set(tmp_path / "EMNIST" / "raw", emnist_names("digits"), one)
    x = emnist(root=str(tmp_path), split="digits").x_test[0, 0]
    assert (x == x.max()).nonzero().tolist() == [[5, 2]]


def test_emnist_letters_shifted(tmp_path: Path) -> None:
    splits = {"train": make_split(30, (28, 28), 26, offset=1), "test": make_split(4, (28, 28), 26, offset=1)}
    write_idx_set(tmp_path / "EMNIST" / "raw", emnist_names("letters"), splits)
    data = emnist(root=str(tmp_path), split="letters")
    assert data.num_classes == 26
    assert_labels(data.y_train, splits["train"][1].astype(int) - 1)
    assert data.y_train.min() == 0 and data.y_train.max() == 25
    assert_labels(data.y_test, [0, 1, 2, 3])
    splits["test"][1][0] = 0  # letters never use label 0
    write_idx_set(tmp_path / "EMNIST" / "raw", emnist_names("letters"), splits)
    raises_one_line(
        emnist,
        root=str(tmp_path),
        split="letters",
        match="emnist-letters-test-labels-idx1-ubyte: labels span 0..4, expected 1..26",
    )


def test_emnist_bad_split_and_missing(tmp_path: Path) -> None:
    message = raises_one_line(emnist, root=str(tmp_path), split="lowercase", match="data.loader.split='lowercase'")
    assert "byclass, bymerge, balanced, letters, digits, mnist" in message
    raw = (tmp_path / "EMNIST" / "raw").resolve()
    raises_one_line(emnist, root=str(tmp_path), split="byclass", match=f"EMNIST 'byclass' not found at {raw}")
    raises_one_line(emnist, root=str(tmp_path), split="byclass", match="emnist-byclass-train-images-idx3-ubyte")


# ---------------------------------------------------------------------------------------------------------------------
# CIFAR
# ---------------------------------------------------------------------------------------------------------------------


def cifar_images(batches: list[dict]) -> np.ndarray:
    """The batches' images as ``(N, 3, 32, 32)``."""
    return np.concatenate([b[b"data"] for b in batches]).reshape(-1, 3, 32, 32)


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar10_roundtrip(tmp_path: Path, protocol: int) -> None:
    train, test = write_cifar10(tmp_path, protocol)
    data = cifar10(root=str(tmp_path))
    assert data.num_classes == 10 and data.input_shape == (3, 32, 32) and data.name == "cifar10"
    stats = channel_stats(cifar_images(train))
    assert_images(data.x_train, cifar_images(train), stats)
    assert_images(data.x_test, cifar_images([test]), stats)
    assert_labels(data.y_train, list(range(10)))  # batches concatenated in order 1..5
    assert_labels(data.y_test, [9, 0, 4])
    assert_standardised(data.x_train)
    # row-major channel planes: byte 1024 + 32 * 3 + 7 of a row is green, row 3, column 7
    pixel = train[0][b"data"][1, 1024 + 32 * 3 + 7]
    mean, std = stats[0][1], stats[1][1]
    assert data.x_train[1, 1, 3, 7].item() == pytest.approx((pixel / 255 - mean) / std, abs=1e-5)


def test_cifar100_fine_and_coarse(tmp_path: Path) -> None:
    train, test = write_cifar100(tmp_path)
    fine = cifar100(root=str(tmp_path))
    coarse = cifar100(root=str(tmp_path), label="coarse")
    assert (fine.num_classes, coarse.num_classes) == (100, 20)
    assert (fine.name, coarse.name) == ("cifar100-fine", "cifar100-coarse")
    assert_labels(fine.y_train, [99, 0, 57, 12])
    assert_labels(coarse.y_train, [19, 0, 3, 7])
    assert_labels(fine.y_test, [1, 98])
    assert_labels(coarse.y_test, [2, 18])
    assert torch.equal(fine.x_train, coarse.x_train)
    assert_images(fine.x_test, cifar_images([test]), channel_stats(cifar_images([train])))
    raises_one_line(
        cifar100,
        root=str(tmp_path),
        label="superclass",
        match="data.loader.label='superclass': must be one of fine, coarse",
    )


def test_cifar_missing_messages(tmp_path: Path) -> None:
    directory = (tmp_path / "cifar-10-batches-py").resolve()
    message = raises_one_line(cifar10, root=str(tmp_path), match=f"data=cifar10: CIFAR-10 not found at {directory} (")
    assert "python-pickle version: data_batch_1, data_batch_2" in message and "test_batch" in message
    write_cifar10(tmp_path)
    (directory / "data_batch_3").unlink()
    raises_one_line(cifar10, root=str(tmp_path), match="missing data_batch_3;")
    directory = (tmp_path / "cifar-100-python").resolve()
    raises_one_line(cifar100, root=str(tmp_path), match=f"data=cifar100: CIFAR-100 not found at {directory} (")


def test_cifar_corrupt_files(tmp_path: Path) -> None:
    train, _ = write_cifar10(tmp_path)
    directory = (tmp_path / "cifar-10-batches-py").resolve()
    (directory / "data_batch_2").write_bytes(b"\x80\x02garbage")
    raises_one_line(cifar10, root=str(tmp_path), match=f"corrupt or unreadable file {directory / 'data_batch_2'}")
    write_pickle(directory / "data_batch_2", {b"data": train[1][b"data"]})
    raises_one_line(cifar10, root=str(tmp_path), match="keys ['data', 'labels']")
    write_pickle(directory / "data_batch_2", {b"data": train[1][b"data"][:, :100], b"labels": [0, 1]})
    raises_one_line(cifar10, root=str(tmp_path), match="expected uint8 (N, 3072)")
    write_pickle(directory / "data_batch_2", {b"data": train[1][b"data"], b"labels": [0, 10]})
    raises_one_line(cifar10, root=str(tmp_path), match="labels span 0..10")


class _Exploit:
    def __reduce__(self) -> tuple[Callable[[str], int], tuple[str]]:
        return (os.system, ("touch pwned",))


def test_cifar_pickle_cannot_run_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_cifar10(tmp_path)
    write_pickle(tmp_path / "cifar-10-batches-py" / "test_batch", {b"data": _Exploit(), b"labels": []})
    raises_one_line(cifar10, root=str(tmp_path), match="refusing to load global")
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------------------------------------------------------------
# MedMNIST
# ---------------------------------------------------------------------------------------------------------------------


def single_labels(*counts: int, num_classes: int) -> tuple[np.ndarray, ...]:
    """``(n, 1)`` uint8 label arrays cycling through the classes, one per count."""
    return tuple((np.arange(n) % num_classes).reshape(-1, 1).astype(np.uint8) for n in counts)


def test_medmnist_grey_28(tmp_path: Path) -> None:
    arrays = medmnist_arrays((28, 28), single_labels(9, 3, 4, num_classes=2))
    write_npz(tmp_path / "pneumoniamnist.npz", arrays)
    data = medmnist(root=str(tmp_path), name="pneumoniamnist")
    assert data.num_classes == 2 and data.input_shape == (1, 28, 28) and data.name == "pneumoniamnist"
    train = arrays["train_images"][:, None]
    assert_images(data.x_train, train, channel_stats(train))
    assert_images(data.x_test, arrays["test_images"][:, None], channel_stats(train))
    assert_labels(data.y_train, arrays["train_labels"][:, 0])
    assert_labels(data.y_test, arrays["test_labels"][:, 0])
    assert len(data.x_train) == 9  # val dropped by default


def test_medmnist_rgb_64_use_val(tmp_path: Path) -> None:
    arrays = medmnist_arrays((64, 64, 3), single_labels(6, 4, 2, num_classes=9))
    write_npz(tmp_path / "pathmnist_64.npz", arrays)
    data = medmnist(root=str(tmp_path), name="pathmnist", size=64, use_val="train")
    assert data.num_classes == 9 and data.input_shape == (3, 64, 64) and data.name == "pathmnist_64"
    train = np.concatenate([arrays["train_images"], arrays["val_images"]]).transpose(0, 3, 1, 2)
    assert_images(data.x_train, train, channel_stats(train))
    assert_images(data.x_test, arrays["test_images"].transpose(0, 3, 1, 2), channel_stats(train))
    assert_labels(data.y_train, np.concatenate([arrays["train_labels"], arrays["val_labels"]])[:, 0])
    assert_standardised(data.x_train)
    # a known pixel: image 1, row 10, column 20, blue channel
    expected = (arrays["train_images"][1, 10, 20, 2] / 255 - channel_stats(train)[0][2]) / channel_stats(train)[1][2]
    assert data.x_train[1, 2, 10, 20].item() == pytest.approx(expected, abs=1e-5)


def test_medmnist_multilabel_label_index(tmp_path: Path) -> None:
    labels = tuple(RNG.integers(0, 2, size=(n, 14), dtype=np.uint8) for n in (10, 2, 5))
    arrays = medmnist_arrays((28, 28), labels)
    write_npz(tmp_path / "chestmnist.npz", arrays)
    data = medmnist(root=str(tmp_path), name="chestmnist", label_index=13)
    assert data.num_classes == 2
    assert_labels(data.y_train, arrays["train_labels"][:, 13])
    assert_labels(data.y_test, arrays["test_labels"][:, 13])
    message = raises_one_line(medmnist, root=str(tmp_path), name="chestmnist", match="data.loader.label_index=None")
    assert "multi-label" in message and "0..13" in message
    raises_one_line(medmnist, root=str(tmp_path), name="chestmnist", label_index=14, match="data.loader.label_index=14")
    raises_one_line(
        medmnist, root=str(tmp_path), name="chestmnist", label_index=1.0, match="data.loader.label_index=1.0"
    )


def test_medmnist_bad_options(tmp_path: Path) -> None:
    message = raises_one_line(
        medmnist, root=str(tmp_path), name="organmnist3d", match="data.loader.name='organmnist3d'"
    )
    assert all(name in message for name in ("pathmnist", "chestmnist", "retinamnist", "organsmnist"))
    raises_one_line(medmnist, root=str(tmp_path), size=32, match="data.loader.size=32: must be one of 28, 64, 128, 224")
    raises_one_line(medmnist, root=str(tmp_path), use_val="test", match="data.loader.use_val='test'")
    raises_one_line(medmnist, root=str(tmp_path), label_index=0, match="single-label")


def test_medmnist_missing_and_corrupt(tmp_path: Path) -> None:
    path = (tmp_path / "dermamnist_128.npz").resolve()
    message = raises_one_line(medmnist, root=str(tmp_path), name="dermamnist", size=128, match=str(path))
    assert "train_images" in message and "downloads are disabled" in message
    path.write_bytes(b"PK\x03\x04 broken zip")
    raises_one_line(
        medmnist, root=str(tmp_path), name="dermamnist", size=128, match=f"corrupt or unreadable file {path}"
    )
    arrays = medmnist_arrays((28, 28), single_labels(4, 2, 2, num_classes=7))
    write_npz(path, {k: v for k, v in arrays.items() if k != "val_labels"})
    raises_one_line(medmnist, root=str(tmp_path), name="dermamnist", size=128, match="missing keys val_labels")
    write_npz(path, arrays)  # 28x28 images in the 128 file
    raises_one_line(medmnist, root=str(tmp_path), name="dermamnist", size=128, match="expected uint8 (N, 128, 128)")
    write_npz(tmp_path / "dermamnist.npz", {**arrays, "test_labels": np.array([[0], [7]], np.uint8)})
    raises_one_line(medmnist, root=str(tmp_path), name="dermamnist", match="labels span 0..7")


# ---------------------------------------------------------------------------------------------------------------------
# registry / helpers
# ---------------------------------------------------------------------------------------------------------------------


def test_every_loader_is_reachable_from_a_data_config() -> None:
    """Each registered loader is the target of some configs/data/*.yaml (directly or as a binarized source)."""
    configs = (Path(__file__).resolve().parents[2] / "configs" / "data").glob("*.yaml")
    text = "\n".join(c.read_text() for c in configs)
    assert set(DATASETS) == set(datasets.__all__)  # the registry holds every loader, and only loaders
    for name in DATASETS:
        loader = getattr(datasets, name)
        assert loader.__name__ == name
        assert f"_target_: flx.datamodules.datasets.{name}\n" in text, name


def test_constant_channel_does_not_divide_by_zero(tmp_path: Path) -> None:
    images = np.full((3, 28, 28), 7, np.uint8)
    splits = {"train": (images, np.array([0, 1, 2], np.uint8)), "test": (images[:1], np.array([0], np.uint8))}
    write_idx_set(tmp_path / "MNIST" / "raw", MNIST_NAMES, splits)
    data = mnist(root=str(tmp_path))
    assert torch.isfinite(data.x_train).all() and torch.all(data.x_test == 0)


def test_idx_reader_exact_header(tmp_path: Path) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = write_file(tmp_path / "x-idx3-ubyte", idx_bytes(array))
    assert path.read_bytes()[:4] == b"\x00\x00\x08\x03"
    np.testing.assert_array_equal(formats._read_idx(path, 0x803, "mnist"), array)
    with pytest.raises(ConfigError, match=re.escape(str(path))):
        formats._read_idx(path, 0x801, "mnist")
