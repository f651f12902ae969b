"""LEAF Shakespeare (Caldas et al., 2018): next-character prediction, one group per speaking role (the LEAF user).

Files: the JSON files that LEAF's ``preprocess.sh`` writes to ``data/shakespeare/data/{train,test}/``, copied to
``<root>/shakespeare/train/*.json`` and ``<root>/shakespeare/test/*.json``. Each holds
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [80-char strings], "y": [next chars]}}}``.

Characters map to their position in LEAF's fixed 80-character vocabulary :data:`LEAF_CHARS` (as LEAF's
``letter_to_vec``); any other character gets the extra id :data:`UNKNOWN_ID` = 80, so there are 81 classes. ``x``
becomes an int64 ``(N, 80)`` tensor of ids, ``y`` the id of the next character.

Users are taken in file order (files sorted by name, each file's ``users`` list in order); ``num_users`` keeps the
first ones. The test split holds the test samples of the kept users only (LEAF's default sample split gives every
user train and test samples). A user's group id is its position among the kept users, so
``partition=by_group partition.num_clients=<number of users>`` gives one client per user.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flx.datamodules import files, leaf
from flx.datamodules.formats import _corrupt
from flx.datamodules.store import TensorData
from flx.errors import ConfigError

LEAF_CHARS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
"""LEAF's Shakespeare vocabulary (``ALL_LETTERS`` in its ``language_utils.py``): the id of a character is its index."""
UNKNOWN_ID = len(LEAF_CHARS)
"""The id of every character outside :data:`LEAF_CHARS` (80)."""
NUM_CHARS = len(LEAF_CHARS) + 1
"""Number of character ids, and of classes: 81."""
SEQ_LEN = 80
"""Characters per input sequence in LEAF Shakespeare."""
UNKNOWN_CHAR = "\ufffd"
"""What :func:`ids_to_text` writes for :data:`UNKNOWN_ID`."""

_LOOKUP = np.full(128, UNKNOWN_ID, dtype=np.int64)
_LOOKUP[[ord(c) for c in LEAF_CHARS]] = np.arange(len(LEAF_CHARS))  # the vocabulary is ASCII

UserData = dict[str, tuple[list[str], list[str]]]  # user -> (x strings, y characters), in file order


def text_to_ids(text: str) -> np.ndarray:
    """Maps each character of ``text`` to its LEAF id (:data:`UNKNOWN_ID` outside the vocabulary).

    >>> text_to_ids("Hi!\\t").tolist()
    [32, 61, 2, 80]
    """
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
    return np.where(codes < 128, _LOOKUP[np.minimum(codes, 127)], UNKNOWN_ID)


def ids_to_text(ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
    """The inverse of :func:`text_to_ids` (:data:`UNKNOWN_ID` becomes :data:`UNKNOWN_CHAR`)."""
    return "".join(LEAF_CHARS[i] if i < UNKNOWN_ID else UNKNOWN_CHAR for i in np.asarray(ids).tolist())


def _check_user(path: Path, user: str, record: Any, count: Any) -> tuple[list[str], list[str]]:
    """Checks one ``user_data`` record: ``x`` strings of :data:`SEQ_LEN` chars, one-char ``y``, ``num_samples``."""
    if not isinstance(record, dict) or not isinstance(record.get("x"), list) or not isinstance(record.get("y"), list):
        raise _corrupt("shakespeare", path, f"user_data[{user!r}] must be a dict with lists 'x' and 'y'")
    x, y = record["x"], record["y"]
    if len(x) != len(y) or count != len(y):
        raise _corrupt("shakespeare", path, f"user {user!r}: {len(x)} x, {len(y)} y, num_samples {count}")
    if not all(isinstance(s, str) and len(s) == SEQ_LEN for s in x):
        raise _corrupt("shakespeare", path, f"user {user!r}: every x must be a string of {SEQ_LEN} characters")
    if not all(isinstance(c, str) and len(c) == 1 for c in y):
        raise _corrupt("shakespeare", path, f"user {user!r}: every y must be a single character")
    return x, y


def read_leaf(directory: Path) -> UserData:
    """All users of the ``*.json`` files of a LEAF split folder (files sorted by name).

    Raises:
        ConfigError: if there is no JSON file, a file is malformed, or a user appears in two files.
    """
    return leaf.read_split(files.leaf_json(directory), "shakespeare", _check_user)


def _encode(users: list[str], data: UserData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``x`` ids ``(N, SEQ_LEN)``, ``y`` ids ``(N,)`` and group ids ``(N,)`` of ``users`` (group = position)."""
    xs = [text_to_ids("".join(data[u][0])).reshape(-1, SEQ_LEN) for u in users]
    ys = [text_to_ids("".join(data[u][1])) for u in users]
    groups = [np.full(len(y), g, dtype=np.int64) for g, y in enumerate(ys)]
    empty = (np.empty((0, SEQ_LEN), np.int64), np.empty(0, np.int64), np.empty(0, np.int64))
    return tuple(np.concatenate(parts) if parts else e for parts, e in zip((xs, ys, groups), empty))


def shakespeare(root: str, num_users: int | None = None, standardize: bool = True) -> TensorData:
    """LEAF Shakespeare from ``<root>/shakespeare/{train,test}/*.json`` (see the module docstring).

    Args:
        root: the data directory.
        num_users: keep the first this many train users (file order); ``None`` keeps every user.
        standardize: unused: the inputs are token ids (accepted like every loader's).

    Returns:
        int64 inputs ``(N, 80)`` of character ids, 81 classes, ``groups_*`` = user position, ``group_names`` = users.

    Raises:
        ConfigError: on a bad ``num_users``, missing or malformed files, or no test sample of a kept user.
    """
    directory = files.data_dir(root) / "shakespeare"
    train = read_leaf(directory / "train")
    test = read_leaf(directory / "test")
    users = leaf.kept_users(list(train), num_users)
    x_train, y_train, g_train = _encode(users, train)
    x_test, y_test, g_test = _encode(users, {u: test.get(u, ([], [])) for u in users})
    if len(y_test) == 0:
        where = directory / "test"
        raise ConfigError(
            f"data=shakespeare: no test sample of the {len(users)} kept users in {where} (expected LEAF's "
            "sample split, preprocess.sh -t sample, which gives every user train and test samples)"
        )
    return TensorData(
        x_train=torch.from_numpy(x_train),
        y_train=torch.from_numpy(y_train),
        x_test=torch.from_numpy(x_test),
        y_test=torch.from_numpy(y_test),
        num_classes=NUM_CHARS,
        name="shakespeare",
        groups_train=torch.from_numpy(g_train),
        groups_test=torch.from_numpy(g_test),
        group_names=tuple(users),
    )
