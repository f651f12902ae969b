"""LEAF's JSON format (Caldas et al., "LEAF: A Benchmark for Federated Settings", arXiv:1812.01097), shared by the
LEAF readers (:mod:`flx.datamodules.shakespeare`, :mod:`flx.datamodules.femnist`).

A LEAF split folder (``data/<dataset>/data/{train,test}/`` after LEAF's ``preprocess.sh``) holds ``*.json`` files,
each ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}``. Users are read in
file order (files sorted by name, each file's ``users`` list in order); a user in two files of a split is an error.
What ``x`` and ``y`` hold is the dataset's: each reader passes a ``check`` of one user's record.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from flx.datamodules.formats import _corrupt
from flx.errors import bad_value

T = TypeVar("T")
Check = Callable[[Path, str, Any, Any], T]
"""``check(path, user, record, num_samples)``: the user's validated samples, or a :func:`_corrupt` error."""


def read_json(path: Path, data: str, check: Check[T]) -> dict[str, T]:
    """The users of one LEAF JSON file, in its ``users`` order (``data``: the ``data=`` value, for errors)."""
    try:
        blob = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _corrupt(data, path, f"{type(err).__name__}: {err}") from err
    keys = ("users", "num_samples", "user_data")
    if not isinstance(blob, dict) or any(k not in blob for k in keys):
        raise _corrupt(data, path, "expected a LEAF JSON object with keys users, num_samples, user_data")
    users, counts, records = blob["users"], blob["num_samples"], blob["user_data"]
    if not isinstance(users, list) or not isinstance(counts, list) or len(users) != len(counts):
        raise _corrupt(data, path, "users and num_samples must be lists of the same length")
    if not isinstance(records, dict) or any(u not in records for u in users):
        raise _corrupt(data, path, "user_data must have an entry for every user")
    return {str(u): check(path, str(u), records[u], n) for u, n in zip(users, counts)}


def read_split(paths: list[Path], data: str, check: Check[T]) -> dict[str, T]:
    """All users of a LEAF split's JSON files (``paths``, sorted: :func:`flx.datamodules.files.leaf_json`).

    Raises:
        ConfigError: a file is malformed, or a user appears in two files.
    """
    users: dict[str, T] = {}
    for path in paths:
        for user, samples in read_json(path, data, check).items():
            if user in users:
                raise _corrupt(data, path, f"user {user!r} also appears in an earlier file")
            users[user] = samples
    return users


def kept_users(users: list[str], num_users: int | None) -> list[str]:
    """The first ``num_users`` of ``users`` (all of them for ``None``), checked as ``data.loader.num_users``."""
    if num_users is None:
        return users
    if isinstance(num_users, bool) or not isinstance(num_users, int) or num_users < 1:
        raise bad_value("data.loader.num_users", num_users, "must be an integer >= 1, or null for every user")
    if num_users > len(users):
        why = f"the train files hold only {len(users)} users; use at most {len(users)}, or null"
        raise bad_value("data.loader.num_users", num_users, why)
    return users[:num_users]
