"""LEAF FEMNIST (flx.datamodules.femnist): tiny folders in LEAF's real JSON format, read back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import raises_one_line

from flx.config import precheck
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.femnist import NUM_CLASSES, femnist
from flx.datamodules.files import locate
from flx.datamodules.partitioners import ByGroup


def user(seed: int, count: int) -> tuple[list[list[float]], list[int]]:
    """``count`` LEAF samples: 784 floats in [0, 1] (a multiple of 1/255, as LEAF stores pixels) and a class."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (count, 784)) / 255).tolist(), rng.integers(0, NUM_CLASSES, count).tolist()


def write(root: Path, split: str, name: str, users: dict[str, tuple[list, list]], leaf_layout: bool = False) -> Path:
    """``<root>/femnist/<split>/<name>`` (``leaf_layout``: LEAF's ``<root>/femnist/data/<split>``) in LEAF's format."""
    folder = root / "femnist" / ("data" if leaf_layout else "") / split
    folder.mkdir(parents=True, exist_ok=True)
    blob = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    (folder / name).write_text(json.dumps(blob))
    return folder


# writers over two train files (sorted by name: a_ before b_), test samples in another order
TRAIN = {"b.json": {"f0003_11": user(3, 2)}, "a.json": {"f0001_42": user(1, 4), "f0002_07": user(2, 3)}}
TEST = {"t.json": {"f0002_07": user(12, 1), "f0001_42": user(11, 2), "f9999_00": user(99, 5)}}
USERS = ("f0001_42", "f0002_07", "f0003_11")


def write_dataset(root: Path, leaf_layout: bool = False) -> None:
    for split, named in (("train", TRAIN), ("test", TEST)):
        for name, users in named.items():
            write(root, split, name, users, leaf_layout)


def expected(named: dict, users: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    samples = {u: s for file in named.values() for u, s in file.items()}
    x = np.concatenate([np.asarray(samples[u][0], np.float32) for u in users if u in samples])
    return x.reshape(-1, 1, 28, 28), np.concatenate([samples[u][1] for u in users if u in samples])


@pytest.mark.parametrize("leaf_layout", [False, True])
def test_leaf_folder_round_trips_users_rows_and_labels(tmp_path: Path, leaf_layout: bool) -> None:
    write_dataset(tmp_path, leaf_layout)
    data = femnist(root=str(tmp_path))
    assert data.name == "femnist" and data.num_classes == 62 and data.input_shape == (1, 28, 28)
    assert data.group_names == USERS and data.groups_train.tolist() == [0] * 4 + [1] * 3 + [2] * 2
    x, y = expected(TRAIN, USERS)
    assert torch.equal(data.x_train, torch.from_numpy(x)) and data.y_train.tolist() == y.tolist()
    x, y = expected(TEST, USERS)  # the kept writers' test samples, in the writers' order; f9999_00 is not kept
    assert torch.equal(data.x_test, torch.from_numpy(x)) and data.y_test.tolist() == y.tolist()
    assert data.groups_test.tolist() == [0, 0, 1]


def test_writers_are_the_clients_of_the_natural_partition(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    dm = FederatedDataModule(lambda: femnist(root=str(tmp_path), num_users=2), ByGroup(num_clients=2))
    dm.setup("fit")
    assert [c.tolist() for c in dm.client_train] == [[0, 1, 2, 3], [4, 5, 6]]
    assert dm.data.y_train.tolist() == expected(TRAIN, USERS[:2])[1].tolist()


def test_config_picks_one_client_per_writer(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    overrides = ["data=femnist", "data.loader.num_users=3", "algo.clients_per_round=3"]
    cfg = precheck([*overrides, f"paths.data_dir={tmp_path}"])
    assert cfg.partition._target_.endswith(".ByGroup") and cfg.partition.num_clients == 3
    assert cfg.model._target_.endswith(".CNN") and cfg.data.num_classes == 62


def test_missing_folder_is_one_line_naming_the_key_the_path_and_leafs_command(tmp_path: Path) -> None:
    where = (tmp_path / "femnist" / "train").resolve()
    message = raises_one_line(femnist, root=str(tmp_path), match=f"data=femnist: LEAF FEMNIST not found at {where}")
    assert "paths.data_dir" in message and "./preprocess.sh -s niid" in message
    loader = {"_target_": "flx.datamodules.datasets.femnist", "root": str(tmp_path)}
    raises_one_line(locate, loader, match=f"not found at {where}")  # the pre-run check, before any import
    write(tmp_path, "train", "a.json", TRAIN["a.json"])
    raises_one_line(femnist, root=str(tmp_path), match=f"not found at {where.parent / 'test'}")


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda r: r["x"].__setitem__(0, [0.5] * 783), "every x must be a list of 784 finite numbers"),
        (lambda r: r["x"].__setitem__(1, ["a"] * 784), "every x must be a list of 784 finite numbers"),
        (lambda r: r["y"].__setitem__(0, 62), "every y must be an integer in 0..61"),
        (lambda r: r["y"].__setitem__(0, 1.5), "every y must be an integer in 0..61"),
        (lambda r: r["y"].append(3), "3 x, 4 y, num_samples 3"),
    ],
)
def test_malformed_records_name_the_file(tmp_path: Path, edit, problem: str) -> None:
    folder = write(tmp_path, "train", "bad.json", {"w": user(0, 3)})
    blob = json.loads((folder / "bad.json").read_text())
    edit(blob["user_data"]["w"])
    (folder / "bad.json").write_text(json.dumps(blob))
    write(tmp_path, "test", "t.json", {"w": user(1, 1)})
    message = raises_one_line(femnist, root=str(tmp_path), match=f"corrupt or unreadable file {folder.resolve()}")
    assert f"bad.json: user 'w': {problem}" in message
