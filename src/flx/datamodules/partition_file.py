"""Client partitions as JSON files: ``partition=from_file`` reads them, every run writes one (``partition.json``).

Format: ``{"clients": [{"train": [row, ...], "test": [row, ...]}, ...]}``, one entry per client, in client-id order;
rows index the training split as the datamodule holds it (after ``data.split_file`` / the validation carve and any
imbalance subsample); ``test`` (the client's own held-out rows) is optional. Every training row must be in exactly
one client. A run's file also lists the clients kept out of training, ``"unseen": [id, ...]``
(``partition.unseen_clients``; optional, read by ``partition=from_file``).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np

from flx.datamodules.ragged import Ragged, as_ragged
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


def _well_formed(clients: list[Any]) -> tuple[Ragged[np.ndarray], Ragged[np.ndarray]] | None:
    """Every client's rows at once when the file is well formed (each entry an object with a non-empty ``train`` list
    and an optional ``test`` list, of non-negative integers), else None: the per-client reading then names what is
    wrong. A few passes over the file's lists in C instead of one Python check per row (a million clients: ~1 s
    instead of ~8)."""
    allowed = {"train", "test"}
    if set(map(type, clients)) != {dict} or not all(map(allowed.issuperset, clients)):
        return None
    if not all(map(dict.__contains__, clients, itertools.repeat("train"))):
        return None
    empty: list[int] = []
    lists = [[c["train"] for c in clients], [c.get("test", empty) for c in clients]]
    out = []
    for arrays in lists:
        if not set(map(type, arrays)) <= {list}:
            return None
        flat = list(itertools.chain.from_iterable(arrays))
        if flat and set(map(type, flat)) != {int}:  # bools and floats are not row indices
            return None
        try:
            values = np.asarray(flat, dtype=np.int64) if flat else np.empty(0, np.int64)
        except OverflowError:
            return None
        if len(values) and values.min() < 0:
            return None
        out.append(Ragged.from_sizes(values, np.fromiter(map(len, arrays), np.int64, len(arrays))))
    train, test = out
    return None if (train.sizes() == 0).any() else (train, test)


def read_partition_file(path: str) -> tuple[Ragged[np.ndarray], Ragged[np.ndarray]]:
    """Each client's ``train`` and ``test`` rows from ``path`` (structure checked here, ranges in
    :func:`check_covers`)."""
    return read_partition(path)[:2]


def read_partition(path: str) -> tuple[Ragged[np.ndarray], Ragged[np.ndarray], np.ndarray | None]:
    """:func:`read_partition_file`, and the file's ``unseen`` client ids (distinct, in range, not every client;
    None: the file names none)."""
    obj = read_json(path, KEY)
    clients = obj.get("clients") if isinstance(obj, dict) else None
    if not isinstance(clients, list) or not clients:
        raise bad_value(KEY, path, 'must hold {"clients": [{"train": [...], "test": [...]}, ...]} with >= 1 client')
    if "unseen" not in obj:
        return (*_client_rows(clients, path), None)
    unseen = index_array(obj["unseen"], KEY, path, "'unseen'")
    if len(np.unique(unseen)) != len(unseen) or (len(unseen) and unseen.max() >= len(clients)):
        raise bad_value(KEY, path, f"'unseen' must list distinct client ids below {len(clients)}")
    if len(unseen) == len(clients):
        raise bad_value(KEY, path, "'unseen' lists every client: none would train")
    return (*_client_rows(clients, path), unseen)


def _client_rows(clients: list[Any], path: str) -> tuple[Ragged[np.ndarray], Ragged[np.ndarray]]:
    """Each client's ``train`` and ``test`` rows of the file's ``clients`` list."""
    rows = _well_formed(clients)
    if rows is not None:
        return rows
    train, test = [], []
    for c, entry in enumerate(clients):
        if not isinstance(entry, dict) or "train" not in entry or set(entry) - {"train", "test"}:
            raise bad_value(KEY, path, f"client {c} must be an object with 'train' and optional 'test' row lists")
        train.append(index_array(entry["train"], KEY, path, f"client {c} 'train'"))
        if not len(train[-1]):
            raise bad_value(KEY, path, f"client {c} has no training rows")
        test.append(index_array(entry.get("test", []), KEY, path, f"client {c} 'test'"))
    return Ragged.from_arrays(train), Ragged.from_arrays(test)


def _arrays(train_clients: np.ndarray, test_clients: np.ndarray) -> list[tuple[int, str]]:
    """``(client, "train" | "test")`` of the given clients' arrays in file order (client 0 train, client 0 test...)."""
    keys = sorted([(int(c), 0) for c in np.unique(train_clients)] + [(int(c), 1) for c in np.unique(test_clients)])
    return [(c, ("train", "test")[k]) for c, k in keys]


def check_covers(train: Ragged[np.ndarray], test: Ragged[np.ndarray], num_rows: int, path: str) -> None:
    """Every row index in range, listed once, and every training row in some client; else a one-line error naming the
    first offending client arrays in file order (as :func:`check_disjoint` names them)."""
    rows, owners = np.concatenate([train.values, test.values]), np.concatenate([train.owners(), test.owners()])
    is_train = np.arange(len(rows)) < len(train.values)
    out = rows >= num_rows
    if out.any():
        c, kind = _arrays(owners[out & is_train], owners[out & ~is_train])[0]
        biggest = int((train if kind == "train" else test)[c].max())
        raise bad_value(KEY, path, f"client {c} {kind} has index {biggest}, out of range (there are {num_rows} rows)")
    counts = np.bincount(rows, minlength=num_rows)
    if len(rows) and counts.max() > 1:
        row = int(counts.argmax())
        at = rows == row
        where = [f"client {c} {kind}" for c, kind in _arrays(owners[at & is_train], owners[at & ~is_train])]
        twice = f"{where[0]} twice" if len(where) == 1 else " and ".join(where)
        raise bad_value(KEY, path, f"row {row} is listed in {twice}; every row may appear once")
    missing = np.flatnonzero(counts == 0)
    if len(missing):
        why = f"{len(missing)} of the {num_rows} training rows (e.g. row {int(missing[0])}) are in no client"
        raise bad_value(KEY, path, f"{why}; every training row must be in exactly one client")


SAVE_CHUNK = 4096
"""Clients encoded per write by :func:`save_partition`: the JSON of a million clients never sits in memory whole."""


def _json_lists(arrays: Ragged[np.ndarray], start: int, stop: int) -> list[str]:
    """The entries of arrays ``start..stop-1``, each as ``json.dumps`` writes a list's inside (``1, 2, 3``)."""
    offsets = arrays.offsets[start : stop + 1]
    words = list(map(str, arrays.values[offsets[0] : offsets[-1]].tolist()))
    bounds = (offsets - offsets[0]).tolist()
    return [", ".join(words[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def save_partition(path: str | Path, split: Any) -> None:
    """Writes a :class:`~flx.datamodules.partitioners.ClientSplit` in the format of :func:`read_partition_file`:
    the bytes of ``json.dumps({"clients": [{"train": [...], "test": [...]}, ...]})``, written a chunk of clients at a
    time; a split with unseen clients (its held-out ones, ``partition.unseen_clients``, few_shot's) adds their ids,
    ``"unseen": [T, ..., C - 1]`` (the last ones)."""
    train, test = as_ragged(split.train), as_ragged(split.test)
    with open(path, "w") as file:
        file.write('{"clients": [')
        for start in range(0, len(train), SAVE_CHUNK):
            pairs = zip(_json_lists(train, start, start + SAVE_CHUNK), _json_lists(test, start, start + SAVE_CHUNK))
            file.write((", " if start else "") + ", ".join(f'{{"train": [{tr}], "test": [{te}]}}' for tr, te in pairs))
        held = getattr(split, "num_heldout", 0)  # the unseen clients: the last ones
        file.write(f'], "unseen": {list(range(len(train) - held, len(train)))}}}' if held else "]}")
