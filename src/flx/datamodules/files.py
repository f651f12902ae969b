"""Where each on-disk dataset's files must be, checked without torch or numpy; and the one registry of datasets.

The loaders (:mod:`flx.datamodules.datasets`, :mod:`~flx.datamodules.adult`, :mod:`~flx.datamodules.shakespeare`,
:mod:`~flx.datamodules.wikitext`) find their files through the functions here, and the pre-run check
(:func:`flx.config.precheck`) calls the same functions through :func:`locate` before anything heavy is imported: a
missing dataset, or a bad option that decides which files are read, is one line within a second instead of after the
imports and the loading.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flx.errors import ConfigError, bad_value

NO_DOWNLOAD = "downloads are disabled, place the files there or set paths.data_dir"
IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}
MEDMNIST_KEYS = ("train_images", "train_labels", "val_images", "val_labels", "test_images", "test_labels")
# name -> (number of classes, multi-label)
MEDMNIST_2D = {
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
MEDMNIST_SIZES = (28, 64, 128, 224)
ADULT_FILES = ("adult.data", "adult.test")
CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))


def data_dir(root: str | Path | None) -> Path:
    """The absolute data directory.

    Raises:
        ConfigError: if ``root`` is empty.
    """
    if root is None or str(root).strip() == "":
        raise bad_value("paths.data_dir", root, "must be the directory that holds the datasets")
    return Path(root).expanduser().resolve()


def not_found(data: str, what: str, where: Path, expected: str) -> ConfigError:
    """The one-line "dataset not found" error (``data``: the ``data=`` value; ``what``: the dataset's name)."""
    return ConfigError(f"data={data}: {what} not found at {where} (expected {expected}; {NO_DOWNLOAD})")


def choice(key: str, value: Any, allowed: Sequence[Any]) -> None:
    """Raises a one-line :class:`ConfigError` listing ``allowed`` unless ``value`` is one of them."""
    if value not in allowed:
        raise bad_value(key, value, "must be one of " + ", ".join(str(a) for a in allowed))


def find_files(
    data: str, what: str, directory: Path, names: Sequence[str], expected: str, gz: bool = True
) -> dict[str, Path]:
    """Looks up files by name in ``directory`` (``<name>.gz`` may stand in for ``<name>`` when ``gz``).

    Returns:
        The found paths keyed by plain name.

    Raises:
        ConfigError: naming the missing files, if any name is found in no accepted form.
    """
    found: dict[str, Path] = {}
    missing: list[str] = []
    for name in names:
        candidates = (directory / name, directory / f"{name}.gz") if gz else (directory / name,)
        for candidate in candidates:
            if candidate.is_file():
                found[name] = candidate
                break
        else:
            missing.append(name)
    if missing:
        raise not_found(data, what, directory, f"{expected}; missing {', '.join(missing)}")
    return found


# ------------------------------------------------------------------------------------------------ per dataset
def _idx(data: str, what: str, directory: Path, names: Sequence[str]) -> dict[str, Path]:
    return find_files(data, what, directory, names, f"the IDX files {', '.join(names)} (plain or .gz)")


def mnist(root: str) -> dict[str, Path]:
    return _idx("mnist", "MNIST", data_dir(root) / "MNIST" / "raw", IDX_NAMES)


def fashion_mnist(root: str) -> dict[str, Path]:
    return _idx("fashion_mnist", "FashionMNIST", data_dir(root) / "FashionMNIST" / "raw", IDX_NAMES)


def emnist_names(split: str) -> list[str]:
    """The four IDX names of an EMNIST split (train images, train labels, test images, test labels)."""
    choice("data.loader.split", split, list(EMNIST_CLASSES))
    return [f"emnist-{split}-{name.replace('t10k', 'test')}" for name in IDX_NAMES]


def emnist(root: str, split: str = "balanced") -> dict[str, Path]:
    return _idx("emnist", f"EMNIST '{split}'", data_dir(root) / "EMNIST" / "raw", emnist_names(split))


def _cifar(data: str, directory: Path, names: Sequence[str]) -> dict[str, Path]:
    what = "CIFAR-10" if data == "cifar10" else "CIFAR-100"
    return find_files(data, what, directory, names, f"the python-pickle version: {', '.join(names)}", gz=False)


def cifar10(root: str) -> dict[str, Path]:
    return _cifar("cifar10", data_dir(root) / "cifar-10-batches-py", (*CIFAR10_TRAIN, "test_batch"))


def cifar100(root: str, label: str = "fine") -> dict[str, Path]:
    choice("data.loader.label", label, ["fine", "coarse"])
    return _cifar("cifar100", data_dir(root) / "cifar-100-python", ("train", "test"))


def check_medmnist_options(name: str, size: int, label_index: int | None, use_val: str) -> None:
    """Raises a one-line :class:`ConfigError` on an invalid :func:`flx.datamodules.datasets.medmnist` option."""
    choice("data.loader.name", name, list(MEDMNIST_2D))
    choice("data.loader.size", size, MEDMNIST_SIZES)
    choice("data.loader.use_val", use_val, ["drop", "train"])
    classes, multi_label = MEDMNIST_2D[name]
    if not multi_label:
        if label_index is not None:
            raise bad_value("data.loader.label_index", label_index, f"{name} is single-label: leave it null")
        return
    valid = isinstance(label_index, int) and not isinstance(label_index, bool) and 0 <= label_index < classes
    if not valid:
        reason = f"{name} is multi-label: pick a column in 0..{classes - 1}"
        raise bad_value("data.loader.label_index", label_index, reason)


def medmnist(
    root: str, name: str = "pathmnist", size: int = 28, label_index: int | None = None, use_val: str = "drop"
) -> Path:
    check_medmnist_options(name, size, label_index, use_val)
    path = data_dir(root) / (f"{name}.npz" if size == 28 else f"{name}_{size}.npz")
    if not path.is_file():
        expected = "the medmnist package's .npz with keys " + ", ".join(MEDMNIST_KEYS)
        raise not_found("medmnist", f"MedMNIST '{name}' (size {size})", path, expected)
    return path


def adult(root: str) -> dict[str, Path]:
    expected = "the UCI files adult.data and adult.test (plain or .gz)"
    return find_files("adult", "Adult", data_dir(root) / "adult", ADULT_FILES, expected)


LEAF_FEMNIST_HOW = (
    "LEAF's FEMNIST: in leaf/data/femnist run ./preprocess.sh -s niid --sf 0.05 -k 0 -t sample (--sf 1.0: every "
    "writer) and copy its data/train and data/test folders to <paths.data_dir>/femnist/"
)
"""How to get the FEMNIST files (LEAF, Caldas et al., arXiv:1812.01097)."""


def leaf_json(directory: Path, data: str = "shakespeare", what: str = "LEAF Shakespeare", how: str = "") -> list[Path]:
    """The ``*.json`` files of a LEAF split folder, sorted by name (``how``: how to get them, for the error)."""
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    if not files:
        expected = "LEAF JSON files *.json with keys users, num_samples, user_data" + (f"; {how}" if how else "")
        raise not_found(data, what, directory, expected)
    return files


def shakespeare(root: str) -> tuple[list[Path], list[Path]]:
    directory = data_dir(root) / "shakespeare"
    return leaf_json(directory / "train"), leaf_json(directory / "test")


def femnist_dir(root: str) -> Path:
    """``<root>/femnist``, or ``<root>/femnist/data`` when that holds LEAF's ``train`` folder (LEAF's own layout)."""
    base = data_dir(root) / "femnist"
    return base / "data" if not (base / "train").is_dir() and (base / "data" / "train").is_dir() else base


def femnist(root: str) -> tuple[list[Path], list[Path]]:
    directory = femnist_dir(root)
    find = [leaf_json(directory / s, "femnist", "LEAF FEMNIST", LEAF_FEMNIST_HOW) for s in ("train", "test")]
    return find[0], find[1]


WIKITEXT2_FILES = ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens")


def wikitext2(root: str, use_valid: bool = True) -> dict[str, Path]:
    names = WIKITEXT2_FILES if use_valid else (WIKITEXT2_FILES[0], WIKITEXT2_FILES[2])
    expected = "the word-level WikiText-2 release (wikitext-2-v1.zip, unzipped): " + ", ".join(names)
    return find_files("wikitext2", "WikiText-2", data_dir(root) / "wikitext-2", names, expected, gz=False)


@dataclass(frozen=True)
class Dataset:
    """One dataset flx reads: the record that ties its loader to the function that finds its files.

    Attributes:
        name: the loader's name in :mod:`flx.datamodules.datasets` (its ``_target_`` is :attr:`target`).
        locate: finds and checks its files (this module's function of the same name); None for data inside
            scikit-learn, which has no files to find.
    """

    name: str
    locate: Callable[..., Any] | None = None

    @property
    def target(self) -> str:
        return f"flx.datamodules.datasets.{self.name}"


DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in (
        Dataset("digits"),
        Dataset("breast_cancer"),
        Dataset("diabetes"),
        Dataset("mnist", mnist),
        Dataset("fashion_mnist", fashion_mnist),
        Dataset("emnist", emnist),
        Dataset("cifar10", cifar10),
        Dataset("cifar100", cifar100),
        Dataset("medmnist", medmnist),
        Dataset("adult", adult),
        Dataset("shakespeare", shakespeare),
        Dataset("femnist", femnist),
        Dataset("wikitext2", wikitext2),
    )
}
"""The datasets' one registry (loader name -> record), kept here, without torch, so the pre-run check can read it."""


def locate(loader: Mapping[str, Any]) -> None:
    """Checks the files of a ``data.loader`` config (unwrapping ``binarize``'s ``source``); raises one line if absent.

    Loaders without a locator in :data:`DATASETS` (bundled or generated data) need no files.
    """
    target = str(loader.get("_target_", ""))
    if target.endswith(".binarize") and isinstance(loader.get("source"), Mapping):
        return locate(loader["source"])
    dataset = DATASETS.get(target.rpartition(".")[2])
    if dataset is None or dataset.locate is None or target != dataset.target:
        return None
    find = dataset.locate
    accepted = inspect.signature(find).parameters
    find(**{k: v for k, v in loader.items() if k in accepted})
    return None
