"""The partitions are pinned: every scheme gives, for a fixed seed, exactly the rows it gave before clients were
stored as one flat array (:mod:`flx.datamodules.ragged`), when each client was its own numpy array. The docs' result
tables depend on it.

The expected values were computed by that earlier code (flx at e240e2f): small splits written out in full, larger
ones as a digest of every client's train, test and support rows (int64 bytes, in client order).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_partitioners import LABELS, build

from flx.datamodules.few_shot import FewShot
from flx.datamodules.partition_file import read_partition_file, save_partition
from flx.datamodules.partitioners import PARTITIONERS, ByGroup, ClientSplit
from flx.errors import ConfigError

SMALL = np.array([0, 1, 2, 1, 0, 2, 2, 1, 0, 0, 1, 2, 1, 1, 0, 2])

# (scheme, kwargs, train rows per client, test rows per client) of SMALL with seed 1
SMALL_SPLITS = [
    (
        "iid",
        {"num_clients": 3, "test_fraction": 0.25},
        [[4, 7, 12, 14], [0, 5, 8, 9], [3, 6, 11, 13]],
        [[1, 10], [2], [15]],
    ),
    ("dirichlet", {"num_clients": 3, "alpha": 0.5}, [[1, 2, 5, 6, 7, 11, 12], [10, 14], [0, 3, 4, 8, 9, 13, 15]], None),
    ("stratified", {"num_clients": 3}, [[1, 2, 4, 5, 12, 14], [0, 6, 7, 8, 10, 11], [3, 9, 13, 15]], None),
    (
        "shards",
        {"num_clients": 4, "classes_per_client": 2, "test_fraction": 0.3},
        [[4, 5, 11], [6, 12, 15], [0, 8, 10], [3, 13]],
        [[2, 14], [1], [7], [9]],
    ),
    ("one_class", {"num_clients": 4}, [[4, 8, 14], [1, 3, 7, 10, 12, 13], [2, 5, 6, 11, 15], [0, 9]], None),
    (
        "quantity_skew",
        {"num_clients": 3, "alpha": 1.0},
        [[1, 6, 10], [14], [0, 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15]],
        None,
    ),
]

# (scheme, kwargs, seed, digest of the split of LABELS; by_group with GROUPS)
DIGESTS = [
    ("iid", {"num_clients": 1}, 0, "15da3e5b4342c378"),
    ("iid", {"num_clients": 1}, 3, "15da3e5b4342c378"),
    ("iid", {"num_clients": 7}, 0, "8c99c813ebe23557"),
    ("iid", {"num_clients": 7}, 3, "aafca3c93601bc3a"),
    ("iid", {"num_clients": 50, "test_fraction": 0.2}, 0, "77ab8644e9b4dd23"),
    ("iid", {"num_clients": 50, "test_fraction": 0.2}, 3, "46b48bb01ca2ee9b"),
    ("stratified", {"num_clients": 16}, 0, "81ebee3256d5ed3f"),
    ("stratified", {"num_clients": 16}, 3, "7e9cbec514512ca5"),
    ("stratified", {"num_clients": 30, "test_fraction": 0.2}, 0, "c3f8d0340ca4496b"),
    ("stratified", {"num_clients": 30, "test_fraction": 0.2}, 3, "414d6caadcdd3c43"),
    ("dirichlet", {"num_clients": 10, "alpha": 0.3}, 0, "f9f998c6f782c585"),
    ("dirichlet", {"num_clients": 10, "alpha": 0.3}, 3, "bc1d66c90471ad20"),
    ("dirichlet", {"num_clients": 37, "alpha": 5.0, "test_fraction": 0.25, "min_size": 5}, 0, "7cd7eb7360f45008"),
    ("dirichlet", {"num_clients": 37, "alpha": 5.0, "test_fraction": 0.25, "min_size": 5}, 3, "29e8fe3894ed7486"),
    ("shards", {"num_clients": 10, "classes_per_client": 1}, 0, "a79b98bade511e8b"),
    ("shards", {"num_clients": 10, "classes_per_client": 1}, 3, "b0b197bc78390973"),
    ("shards", {"num_clients": 25, "classes_per_client": 2}, 0, "779aa25379059e0b"),
    ("shards", {"num_clients": 25, "classes_per_client": 2}, 3, "6c731477bb841f02"),
    ("shards", {"num_clients": 40, "classes_per_client": 3, "test_fraction": 0.1}, 0, "9a00b48a0847d352"),
    ("shards", {"num_clients": 40, "classes_per_client": 3, "test_fraction": 0.1}, 3, "c09bd12964cb57c0"),
    ("one_class", {"num_clients": 10}, 0, "461c9ea31683ae29"),
    ("one_class", {"num_clients": 10}, 3, "461c9ea31683ae29"),
    ("one_class", {"num_clients": 23, "test_fraction": 0.3}, 0, "e0288f930adbb6c4"),
    ("one_class", {"num_clients": 23, "test_fraction": 0.3}, 3, "602396886ed5acda"),
    ("quantity_skew", {"num_clients": 3, "alpha": 5.0}, 0, "ada2805859b39d82"),
    ("quantity_skew", {"num_clients": 3, "alpha": 5.0}, 3, "e7f8813b472657d4"),
    ("quantity_skew", {"num_clients": 20, "alpha": 0.5, "test_fraction": 0.2, "min_size": 10}, 0, "f1a59f471c53d314"),
    ("quantity_skew", {"num_clients": 20, "alpha": 0.5, "test_fraction": 0.2, "min_size": 10}, 3, "976be30db08b09b0"),
    ("from_file", {"num_clients": 9}, 0, "c152b32a307ac1ca"),
    ("from_file", {"num_clients": 9}, 3, "c152b32a307ac1ca"),
    ("from_file", {"num_clients": 9, "test_fraction": 0.3}, 0, "c5895d020bd3a334"),
    ("from_file", {"num_clients": 9, "test_fraction": 0.3}, 3, "7ab40efd363fd12d"),
    ("few_shot", {"num_clients": 30, "classes_per_client": 2, "samples_min": 10}, 0, "5104abf5ebf8056f"),
    ("few_shot", {"num_clients": 30, "classes_per_client": 2, "samples_min": 10}, 3, "1be1c3f701d64aa4"),
    (
        "few_shot",
        {"num_clients": 11, "classes_per_client": 3, "samples_min": 7, "heldout_fraction": 0.3},
        0,
        "4425e606756157e2",
    ),
    (
        "few_shot",
        {"num_clients": 11, "classes_per_client": 3, "samples_min": 7, "heldout_fraction": 0.3},
        3,
        "5e8714cd2d4ff56f",
    ),
    ("stratified", {"num_clients": 120}, 0, "296bbce46ce9dd38"),
    ("stratified", {"num_clients": 120}, 3, "b8f114c860b369f4"),
    ("iid", {"num_clients": 2000}, 0, "d0eaa2f08594dc12"),
    ("iid", {"num_clients": 2000}, 3, "907527551b2bbbec"),
    ("dirichlet", {"num_clients": 5, "alpha": 0.1, "test_fraction": 0.5}, 0, "962550212ad7f338"),
    ("dirichlet", {"num_clients": 5, "alpha": 0.1, "test_fraction": 0.5}, 3, "1fc3a60dc203b5c0"),
    ("by_group", {"num_clients": 10}, 0, "0d8950e8bce7efd4"),
    ("by_group", {"num_clients": 10}, 3, "0d8950e8bce7efd4"),
    ("by_group", {"num_clients": 15, "test_fraction": 0.2}, 0, "87d774d05a9dc496"),
    ("by_group", {"num_clients": 15, "test_fraction": 0.2}, 3, "147cdd89afd4e002"),
]
GROUPS = (np.arange(len(LABELS)) * 7919) % 5


def digest(split: ClientSplit) -> str:
    """The first 16 hex digits of the sha256 of every client's rows (train, then test, then support)."""
    h = hashlib.sha256()
    for name in ("train", "test", "support"):
        parts = getattr(split, name)
        if parts is None:
            h.update(b"none")
            continue
        for p in parts:
            assert p.dtype == np.int64
            h.update(p.tobytes())
            h.update(b"|")
        h.update(b"#")
    h.update(str(split.num_heldout).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize(("name", "kwargs", "train", "test"), SMALL_SPLITS, ids=[s[0] for s in SMALL_SPLITS])
def test_small_splits_are_the_pinned_ones(name: str, kwargs: dict[str, Any], train: list, test: list | None) -> None:
    split = PARTITIONERS[name](**kwargs)(SMALL, seed=1)
    assert [p.tolist() for p in split.train] == train
    assert [p.tolist() for p in split.test] == (test or [[]] * len(train))


def test_few_shot_split_is_the_pinned_one() -> None:
    split = FewShot(4, classes_per_client=2, samples_min=2, heldout_fraction=0.25)(np.repeat(np.arange(3), 8), seed=2)
    assert [p.tolist() for p in split.train] == [[14, 22], [11, 12, 19, 20], [7, 16], [13, 23]]
    assert [p.tolist() for p in split.test] == [[], [], [], [10]]
    assert [p.tolist() for p in split.support] == [[22], [12, 19], [16], [13, 23]] and split.num_heldout == 1


@pytest.mark.parametrize(
    ("name", "kwargs", "seed", "expected"), DIGESTS, ids=[f"{d[0]}-{i}" for i, d in enumerate(DIGESTS)]
)
def test_splits_are_the_pinned_ones(name: str, kwargs: dict[str, Any], seed: int, expected: str) -> None:
    if name == "by_group":
        split = ByGroup(**kwargs)(LABELS, seed, groups=GROUPS)
    else:
        split = build(name, **kwargs)(LABELS, seed=seed)
    assert digest(split) == expected


def test_every_sample_is_in_exactly_one_client_and_views_are_the_flat_rows() -> None:
    split = PARTITIONERS["dirichlet"](num_clients=50, alpha=0.2, test_fraction=0.3)(LABELS, seed=4)
    rows = np.concatenate([split.train.values, split.test.values])
    assert np.array_equal(np.sort(rows), np.arange(len(LABELS)))
    for part in (split.train, split.test):
        assert np.array_equal(np.concatenate(list(part)), part.values)
        assert [len(p) for p in part] == part.sizes().tolist()
        assert all(np.all(np.diff(p) > 0) for p in part)  # sorted, distinct


def test_the_partition_file_is_json_dumps_of_the_clients(tmp_path: Path) -> None:
    """``save_partition`` streams the file; its bytes are those of ``json.dumps`` of the lists (the format read back
    by ``partition=from_file``), over several write chunks."""
    split = PARTITIONERS["iid"](num_clients=9000, test_fraction=0.1)(np.zeros(20000, dtype=np.int64), seed=0)
    save_partition(tmp_path / "p.json", split)
    clients = [{"train": tr.tolist(), "test": te.tolist()} for tr, te in zip(split.train, split.test)]
    assert (tmp_path / "p.json").read_text() == json.dumps({"clients": clients})
    train, test = read_partition_file(str(tmp_path / "p.json"))  # read all clients at once (well formed)
    for got, want in ((train, split.train), (test, split.test)):
        assert np.array_equal(got.values, want.values) and np.array_equal(got.offsets, want.offsets)


@pytest.mark.parametrize(
    ("clients", "match"),
    [
        ([{"train": [0, 1, 2], "test": [7]}, {"train": [3, 9]}], "client 0 test has index 7, out of range"),
        ([{"train": [0, 1, 1]}, {"train": [2, 3, 4]}], "row 1 is listed in client 0 train twice"),
        ([{"train": [0, 1]}, {"train": [2, 3], "test": [4, 0]}], "row 0 is listed in client 0 train and client 1 test"),
    ],
)
def test_from_file_names_the_first_offending_client(tmp_path: Path, clients: list, match: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"clients": clients}))
    with pytest.raises(ConfigError, match=match):
        PARTITIONERS["from_file"](str(path))(np.zeros(5, dtype=np.int64), seed=0)
