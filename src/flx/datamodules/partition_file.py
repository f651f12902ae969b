"""Client partitions as JSON files: ``partition=from_file`` reads them, every run writes one (``partition.json``).

Format: ``{"clients": [{"train": [row, ...], "test": [row, ...]}, ...]}``, one entry per client, in client-id order;
rows index the training split as the datamodule holds it (after ``data.split_file`` / the validation carve and any
imbalance subsample); ``test`` (the client's own held-out rows) is optional. Every training row must be in exactly
one client.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from flx.errors import bad_value

KEY = "partition.path"


# ------------------------------------------------------------------ JSON index files (split and partition files)
def read_json(path: str, key: str) -> Any:
    """The parsed JSON file ``path`` (the value of config key ``key``), or a one-line error."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise bad_value(key, path, f"file not found (looked at {file.resolve()})")
    try:
        return json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_value(key, path, f"not a readable JSON file ({type(e).__name__}: {e})") from None


def index_array(value: Any, key: str, path: str, what: str) -> np.ndarray:
    """A JSON list of non-negative integers as an int64 array, or a one-line error naming ``what``."""
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    if not ok:
        raise bad_value(key, path, f"{what} must be a list of non-negative integers")
    return np.asarray(value, dtype=np.int64).reshape(-1)


def check_disjoint(arrays: dict[str, np.ndarray], size: int, key: str, path: str) -> None:
    """Every index below ``size`` and in at most one of the named arrays, or a one-line error."""
    for name, a in arrays.items():
        if len(a) and a.max() >= size:
            raise bad_value(key, path, f"{name} has index {int(a.max())}, out of range (there are {size} rows)")
    flat = np.concatenate([*arrays.values(), np.empty(0, np.int64)])
    counts = np.bincount(flat, minlength=size)
    if len(flat) and counts.max() > 1:
        row = int(counts.argmax())
        where = [name for name, a in arrays.items() if row in a]
        twice = f"{where[0]} twice" if len(where) == 1 else " and ".join(where)
        raise bad_value(key, path, f"row {row} is listed in {twice}; every row may appear once")


def read_partition_file(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each client's ``(train, test)`` rows from ``path`` (structure checked here, ranges in :func:`check_covers`)."""
    obj = read_json(path, KEY)
    clients = obj.get("clients") if isinstance(obj, dict) else None
    if not isinstance(clients, list) or not clients:
        raise bad_value(KEY, path, 'must hold {"clients": [{"train": [...], "test": [...]}, ...]} with >= 1 client')
    out = []
    for c, entry in enumerate(clients):
        if not isinstance(entry, dict) or "train" not in entry or set(entry) - {"train", "test"}:
            raise bad_value(KEY, path, f"client {c} must be an object with 'train' and optional 'test' row lists")
        train = index_array(entry["train"], KEY, path, f"client {c} 'train'")
        if not len(train):
            raise bad_value(KEY, path, f"client {c} has no training rows")
        out.append((train, index_array(entry.get("test", []), KEY, path, f"client {c} 'test'")))
    return out


def check_covers(clients: list[tuple[np.ndarray, np.ndarray]], num_rows: int, path: str) -> None:
    """Every row index in range, listed once, and every training row in some client; else a one-line error."""
    named: dict[str, np.ndarray] = {}
    for c, (train, test) in enumerate(clients):
        named[f"client {c} train"], named[f"client {c} test"] = train, test
    check_disjoint(named, num_rows, KEY, path)
    missing = np.setdiff1d(np.arange(num_rows), np.concatenate(list(named.values())))
    if len(missing):
        why = f"{len(missing)} of the {num_rows} training rows (e.g. row {int(missing[0])}) are in no client"
        raise bad_value(KEY, path, f"{why}; every training row must be in exactly one client")


def save_partition(path: str | Path, split: Any) -> None:
    """Writes a :class:`~flx.datamodules.partitioners.ClientSplit` in the format of :func:`read_partition_file`."""
    clients = [
        {"train": np.asarray(tr).tolist(), "test": np.asarray(te).tolist()} for tr, te in zip(split.train, split.test)
    ]
    Path(path).write_text(json.dumps({"clients": clients}))
