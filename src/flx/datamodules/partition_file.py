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

from flx.datamodules.protocol import _read_json, check_disjoint, index_array
from flx.errors import bad_value

KEY = "partition.path"


def read_partition_file(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each client's ``(train, test)`` rows from ``path`` (structure checked here, ranges in :func:`check_covers`)."""
    obj = _read_json(path, KEY)
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
