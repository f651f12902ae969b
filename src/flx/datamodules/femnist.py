"""LEAF FEMNIST (Caldas et al., "LEAF: A Benchmark for Federated Settings", arXiv:1812.01097): handwritten digits and
letters, 62 classes, one sample group per writer (the LEAF user).

Files: the JSON files that LEAF's ``data/femnist/preprocess.sh`` writes to ``data/femnist/data/{train,test}/``, copied
to ``<root>/femnist/{train,test}/*.json`` (LEAF's own layout ``<root>/femnist/data/{train,test}`` is read too). Each
holds ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats]], "y": [ints]}}}``: ``x`` a
28 x 28 image flattened row-major, as LEAF stores it, ``y`` its class ``0..61`` (10 digits, 26 upper-case, 26
lower-case letters). Nothing is downloaded: a missing folder stops with one line saying how to make the files.

Users are taken in file order (files sorted by name, each file's ``users`` list in order); ``num_users`` keeps the
first ones, and the test split holds the test samples of the kept users (LEAF's sample split, ``-t sample``, gives
every user train and test samples). A user's group id is its position among the kept users, so
``partition=by_group`` with ``partition.num_clients`` = the number of users (``data=femnist`` picks it) gives one
client per writer, LEAF's natural partition. Inputs become float32 ``(N, 1, 28, 28)`` as stored (standardised by
``data.standardize`` like every image set), labels int64.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from flx.datamodules import files, leaf
from flx.datamodules.formats import _corrupt
from flx.datamodules.store import TensorData
from flx.errors import ConfigError

NUM_CLASSES = 62
"""FEMNIST's classes: 10 digits, 26 upper-case and 26 lower-case letters."""
SIDE = 28
"""Images are ``SIDE x SIDE``, stored flattened (784 values)."""

Samples = tuple[np.ndarray, np.ndarray]  # one user's x (n, 784) float32 and y (n,) int64


def _check_user(path: Path, user: str, record: Any, count: Any) -> Samples:
    """One ``user_data`` record: ``x`` rows of 784 finite numbers, ``y`` integers in ``0..61``, ``num_samples``."""
    if not isinstance(record, dict) or not isinstance(record.get("x"), list) or not isinstance(record.get("y"), list):
        raise _corrupt("femnist", path, f"user_data[{user!r}] must be a dict with lists 'x' and 'y'")
    if len(record["x"]) != len(record["y"]) or count != len(record["y"]):
        problem = f"user {user!r}: {len(record['x'])} x, {len(record['y'])} y, num_samples {count}"
        raise _corrupt("femnist", path, problem)
    bad_x = f"user {user!r}: every x must be a list of {SIDE * SIDE} finite numbers"
    try:
        x = np.asarray(record["x"] or np.empty((0, SIDE * SIDE)), dtype=np.float32)
        y = np.asarray(record["y"])
    except (TypeError, ValueError) as err:
        raise _corrupt("femnist", path, bad_x) from err
    if x.ndim != 2 or x.shape[1] != SIDE * SIDE or not np.isfinite(x).all():
        raise _corrupt("femnist", path, bad_x)
    whole = y.dtype.kind in "iu" or (y.dtype.kind == "f" and bool((y == np.round(y)).all()))
    if len(y) and (y.ndim != 1 or not whole or y.min() < 0 or y.max() >= NUM_CLASSES):
        raise _corrupt("femnist", path, f"user {user!r}: every y must be an integer in 0..{NUM_CLASSES - 1}")
    return x, y.astype(np.int64).reshape(-1)


def _stack(users: list[str], data: dict[str, Samples]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images ``(N, 1, 28, 28)``, labels ``(N,)`` and group ids (user position) of ``users``, in their order."""
    xs = [data[u][0] for u in users] or [np.empty((0, SIDE * SIDE), np.float32)]
    ys = [data[u][1] for u in users] or [np.empty(0, np.int64)]
    groups = np.repeat(np.arange(len(users), dtype=np.int64), [len(data[u][1]) for u in users])
    x = torch.from_numpy(np.concatenate(xs)).reshape(-1, 1, SIDE, SIDE)
    return x, torch.from_numpy(np.concatenate(ys)), torch.from_numpy(groups)


def femnist(root: str, num_users: int | None = None, standardize: bool = True) -> TensorData:
    """LEAF FEMNIST from ``<root>/femnist/{train,test}/*.json`` (see the module docstring).

    Args:
        root: the data directory.
        num_users: keep the first this many train users (file order); ``None`` keeps every user.
        standardize: unused: the datamodule standardises (accepted like every loader's).

    Returns:
        float32 images ``(N, 1, 28, 28)``, 62 classes, ``groups_*`` = user position, ``group_names`` = users.

    Raises:
        ConfigError: on a bad ``num_users``, missing or malformed files, or no test sample of a kept user.
    """
    train_files, test_files = files.femnist(root)
    train = leaf.read_split(train_files, "femnist", _check_user)
    test = leaf.read_split(test_files, "femnist", _check_user)
    users = leaf.kept_users(list(train), num_users)
    x_train, y_train, g_train = _stack(users, train)
    empty = (np.empty((0, SIDE * SIDE), np.float32), np.empty(0, np.int64))
    x_test, y_test, g_test = _stack(users, {u: test.get(u, empty) for u in users})
    if len(y_test) == 0:
        where = test_files[0].parent
        raise ConfigError(
            f"data=femnist: no test sample of the {len(users)} kept users in {where} (expected LEAF's sample split, "
            "preprocess.sh -t sample, which gives every user train and test samples)"
        )
    return TensorData(
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=NUM_CLASSES,
        name="femnist",
        groups_train=g_train,
        groups_test=g_test,
        group_names=tuple(users),
    )
