"""The data protocol: which rows are train, validation and test, and how inputs are scaled.

Order of operations (``FederatedDataModule.setup``):

1. the loader reads the dataset, raw-scaled (pixels / 255, digits / 16, tables as they are);
2. :func:`carve` picks the rows: ``data.split_file`` (exact indices), or else a stratified
   ``data.val_fraction`` of the TRAINING rows moved to the validation split, then a stratified
   ``data.server_fraction`` of the remaining training rows moved to the server split, both drawn with
   ``data.split_seed`` (real-valued or token targets: plain random shares, there are no classes to stratify by);
3. loaders that change training rows (:func:`flx.datamodules.binary.binarize`: the imbalance subsample and the
   label flips) do so only now, on the client-side training rows, so the validation and server rows are never
   subsampled or flipped;
4. :func:`standardized` z-scores every split with the mean/std of the final client-side training rows
   (``data.standardize``), and real-valued targets likewise with the training targets' (``data.standardize_target``);
5. the partitioner splits the client-side training rows over the clients (``partition.seed``).

Row ids ("pool" ids) number the loader's training rows ``0..N-1`` and then its test rows ``N..N+M-1``.
The server split (the data only the server holds, e.g. AugFL's D_s) lives in the training tensors,
after the client-side rows: the last ``TensorData.num_server`` rows of ``x_train`` / ``y_train``, so the server indexes
the same store as the clients, with no copy, and no partitioner ever sees those rows.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flx.datamodules.partition_file import check_disjoint, index_array, read_json
from flx.datamodules.store import TensorData
from flx.errors import bad_value

SPLITS = ("train", "val", "test", "server")


@dataclass(frozen=True)
class DataProtocol:
    """The ``data.*`` protocol keys.

    Attributes:
        val_fraction: fraction of each class of the training rows held out for validation, in ``[0, 1)``;
            ``0`` = no validation split (the validation loop is skipped).
        split_seed: seed of the validation carve (and, through the configs, of the bundled train/test split, the
            imbalance subsample and the label flips): fixed, so the data do not change with the run's ``seed``.
        split_file: a JSON file with exact ``train`` / ``val`` / ``test`` (/ ``server``) pool ids; overrides
            ``val_fraction`` and ``server_fraction``.
        standardize: z-score inputs with the client-side training rows' statistics (``False``: the raw scaling).
        server_fraction: fraction of each class of the training rows left after the validation carve that goes to
            the server split (no client sees it), in ``[0, 1)``; ``0`` = no server split.
        standardize_target: z-score real-valued targets (regression) with the training targets' mean and std, so
            that an MSE of 1 is that of predicting the training mean; ignored for class labels.
    """

    val_fraction: float = 0.0
    split_seed: int = 0
    split_file: str | None = None
    standardize: bool = True
    server_fraction: float = 0.0
    standardize_target: bool = False

    def __post_init__(self) -> None:
        for key, f, what in (("val", self.val_fraction, "validation"), ("server", self.server_fraction, "server")):
            if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 <= f < 1:
                raise bad_value(f"data.{key}_fraction", f, f"must be a number in [0, 1) (0: no {what} split)")
        s = self.split_seed
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise bad_value("data.split_seed", s, "must be an integer >= 0")
        for key in ("standardize", "standardize_target"):
            if not isinstance(getattr(self, key), bool):
                raise bad_value(f"data.{key}", getattr(self, key), "must be true or false")
        if self.split_file is not None and not isinstance(self.split_file, str):
            raise bad_value("data.split_file", self.split_file, "must be a path or null")


def stratified_holdout(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions of ``floor(fraction * n_c + 1/2)`` random samples of every class ``c``."""
    out = [rng.permutation(np.flatnonzero(labels == c))[: math.floor(fraction * n + 0.5)] for c, n in _counts(labels)]
    return np.sort(np.concatenate(out or [np.empty(0, np.int64)])).astype(np.int64)


def random_holdout(n: int, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted positions of ``floor(fraction * n + 1/2)`` random rows of ``n`` (real-valued targets: no classes)."""
    return np.sort(rng.permutation(n)[: math.floor(fraction * n + 0.5)]).astype(np.int64)


def _counts(labels: np.ndarray) -> list[tuple[int, int]]:
    values, counts = np.unique(labels, return_counts=True)
    return list(zip(values.tolist(), counts.tolist()))


def carve(data: TensorData, protocol: DataProtocol) -> TensorData:
    """Picks the train / val / test / server rows (``protocol.split_file``, else the carves: stratified by class,
    plain random for real-valued targets)."""
    n, m = len(data.y_train), len(data.y_test)
    if protocol.split_file is not None:
        rows = read_split_file(protocol.split_file, n, m)
    else:
        rows = carved_rows(data.y_train.numpy(), m, protocol, real=not data.class_labels)
    if not len(rows["test"]) and protocol.split_file is None:  # data.test_fraction=null and no file
        raise bad_value(
            "data.test_fraction", None, "no test split: set a fraction, or list the test rows in data.split_file"
        )
    if not len(rows["test"]):
        raise bad_value("data.split_file", protocol.split_file, "no test rows: list them under 'test'")
    return select(data, rows)


def carved_rows(y: np.ndarray, num_test: int, protocol: DataProtocol, real: bool = False) -> dict[str, np.ndarray]:
    """Pool ids of the carves: ``val_fraction`` of the training rows ``y``, then ``server_fraction`` of the rest,
    drawn in that order from one generator seeded with ``split_seed`` (so the server carve never changes the
    validation rows); stratified by class, or plain random shares for real-valued targets (``real``). The test split
    is the loader's test rows."""
    n = len(y)
    rng = np.random.default_rng(protocol.split_seed)

    def holdout(labels: np.ndarray, fraction: float) -> np.ndarray:
        return random_holdout(len(labels), fraction, rng) if real else stratified_holdout(labels, fraction, rng)

    val = holdout(y, protocol.val_fraction)
    rest = np.setdiff1d(np.arange(n), val)
    server = rest[holdout(y[rest], protocol.server_fraction)]
    train = np.setdiff1d(rest, server)
    if protocol.server_fraction and not len(train):
        why = f"leaves no client-side training rows (of the {len(rest)} left after the validation split); lower it"
        raise bad_value("data.server_fraction", protocol.server_fraction, why)
    return {"train": train, "val": val, "test": np.arange(n, n + num_test), "server": server}


def select(data: TensorData, rows: dict[str, np.ndarray]) -> TensorData:
    """The data with splits made of the given pool ids (``TensorData.rows`` records them); the server rows are stored
    after the client-side training rows, in the training tensors (``TensorData.num_server``)."""
    n = len(data.y_train)
    ids = {k: torch.as_tensor(rows.get(k, np.empty(0, np.int64)), dtype=torch.long) for k in SPLITS}
    stored = {"train": torch.cat([ids["train"], ids["server"]]), "val": ids["val"], "test": ids["test"]}

    def take(train: Tensor | None, test: Tensor | None, i: Tensor) -> Tensor | None:
        if train is None or test is None:
            return None
        if not len(i) or i.max() < n:  # one source split: no pooled copy (CIFAR-size inputs)
            return train[i]
        return test[i - n] if i.min() >= n else torch.cat([train, test])[i]

    split = {
        k: [
            take(a, b, i)
            for a, b in (
                (data.x_train, data.x_test),
                (data.y_train, data.y_test),
                (data.groups_train, data.groups_test),
            )
        ]
        for k, i in stored.items()
    }
    return replace(
        data,
        x_train=split["train"][0],
        y_train=split["train"][1],
        groups_train=split["train"][2],
        x_val=split["val"][0],
        y_val=split["val"][1],
        groups_val=split["val"][2],
        x_test=split["test"][0],
        y_test=split["test"][1],
        groups_test=split["test"][2],
        rows={k: i.numpy() for k, i in ids.items()},
        num_server=len(ids["server"]),
    )


def channel_stats(x: Tensor, chunk: int = 4096) -> tuple[Tensor, Tensor]:
    """Mean and population std of ``x`` per channel (dim 1; per feature for ``(N, D)``), float64, shaped to broadcast
    against ``x``; accumulated in float64 over row chunks, so no float64 copy of the whole split. Zero std -> 1."""
    dims = (0, *range(2, x.ndim))
    total = sum((c.double().sum(dim=dims, keepdim=True) for c in x.split(chunk)), torch.zeros(()))
    count = x.numel() / x.shape[1]
    mean = total / count
    sq = sum((((c.double() - mean) ** 2).sum(dim=dims, keepdim=True) for c in x.split(chunk)), torch.zeros(()))
    std = (sq / count).sqrt()
    std[std == 0] = 1.0
    return mean, std


def standardized(data: TensorData) -> TensorData:
    """Every split z-scored with the client-side training rows' mean and (population) std: per channel for
    ``(N, C, ...)`` inputs, per feature for ``(N, D)``; a zero std counts as 1. The server rows are scaled like the
    validation rows, with the clients' statistics. Integer inputs (token ids) are left as they are."""
    if not data.x_train.is_floating_point():
        return data
    mean, std = (s.to(data.x_train.dtype) for s in channel_stats(data.x_train[: data.num_client_rows]))

    def z(x: Tensor | None) -> Tensor | None:
        return None if x is None else (x - mean).div_(std)

    return replace(data, x_train=z(data.x_train), x_val=z(data.x_val), x_test=z(data.x_test))


def standardized_target(data: TensorData) -> TensorData:
    """Real-valued targets of every split z-scored with the training targets' mean and (population) std, per target
    column (a zero std counts as 1); class labels are left as they are."""
    if not data.real_targets:
        return data
    y = data.y_train.double()
    mean, std = y.mean(0), y.std(0, unbiased=False)
    std = torch.where(std == 0, torch.ones_like(std), std)

    def z(t: Tensor | None) -> Tensor | None:
        return None if t is None else ((t.double() - mean) / std).to(t.dtype)  # float32 stays float32

    return replace(data, y_train=z(data.y_train), y_val=z(data.y_val), y_test=z(data.y_test))


def load(dataset: Callable[..., TensorData] | TensorData, protocol: DataProtocol) -> TensorData:
    """Runs the protocol: load raw, carve, (the loader's own training-row changes), standardise.

    A :class:`TensorData` given directly is carved only, never rescaled. A loader that changes training rows
    takes a ``protocol`` argument and carves itself first (:func:`flx.datamodules.binary.binarize`); a loader
    without a ``standardize`` argument is called plainly.
    """
    if isinstance(dataset, TensorData):
        return carve(dataset, protocol)
    params = inspect.signature(dataset).parameters
    if "protocol" in params:
        data = dataset(protocol=protocol)
    else:
        data = carve(dataset(standardize=False) if "standardize" in params else dataset(), protocol)
    data = standardized_target(data) if protocol.standardize_target else data
    return standardized(data) if protocol.standardize else data


# ------------------------------------------------------------------------------------------------ JSON files
def read_split_file(path: str, num_train: int, num_test: int) -> dict[str, np.ndarray]:
    """Reads ``{"train": [...], "val": [...], "test": [...], "server": [...]}`` (pool ids; all but ``train`` optional).

    Without ``test`` the loader's test rows (``N..N+M-1``) are the test split, and may not be listed elsewhere.
    """
    key, size = "data.split_file", num_train + num_test
    obj = read_json(path, key)
    if not isinstance(obj, dict) or "train" not in obj or set(obj) - set(SPLITS):
        why = "must hold a JSON object with 'train' and optional 'val', 'test', 'server' lists of row ids"
        raise bad_value(key, path, why)
    rows = {k: index_array(obj.get(k, []), key, path, f"'{k}'") for k in SPLITS}
    if "test" not in obj:
        rows["test"] = np.arange(num_train, size)
    if not len(rows["train"]):
        raise bad_value(key, path, "'train' is empty")
    check_disjoint(rows, size, key, path)
    return {k: np.sort(v) for k, v in rows.items()}


def save_split(path: str | Path, rows: dict[str, np.ndarray]) -> None:
    """Writes the pool ids of each split in the format of :func:`read_split_file` (``server`` only when it has rows)."""
    kept = [k for k in SPLITS if k in rows and (k != "server" or len(rows[k]))]
    Path(path).write_text(json.dumps({k: np.asarray(rows[k]).tolist() for k in kept}))


def data_protocol(cfg: Any) -> DataProtocol:
    """The :class:`DataProtocol` of a run config's ``data.*`` (defaults where a data config lacks a key)."""
    d = cfg.data
    defaults = {"val_fraction": 0.0, "split_seed": 0, "split_file": None, "standardize": True, "server_fraction": 0.0}
    defaults["standardize_target"] = False
    return DataProtocol(**{k: d.get(k, v) for k, v in defaults.items()})
