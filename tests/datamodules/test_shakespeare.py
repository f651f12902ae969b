"""Tests for the LEAF Shakespeare loader: tiny LEAF JSON files (the real layout and keys), loaded by the real code."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import raises_one_line

from flx.config import precheck
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.partitioners import ByGroup
from flx.datamodules.shakespeare import (
    LEAF_CHARS,
    NUM_CHARS,
    SEQ_LEN,
    UNKNOWN_CHAR,
    UNKNOWN_ID,
    ids_to_text,
    shakespeare,
    text_to_ids,
)

TEXT = (
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n"
    "And by opposing end them. To die--to sleep,\nNo more; and by a sleep to say we end\n"
)

Samples = tuple[list[str], list[str]]


def windows(start: int, count: int) -> Samples:
    """LEAF samples: ``x`` = the 80 characters from ``start + i``, ``y`` = the character after them."""
    xs = [TEXT[start + i : start + i + SEQ_LEN] for i in range(count)]
    return xs, [TEXT[start + i + SEQ_LEN] for i in range(count)]


def leaf_json(users: dict[str, Samples]) -> dict:
    """A LEAF JSON object with the real keys."""
    return {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }


def write_leaf(root: Path, split: str, files: dict[str, dict[str, Samples]]) -> Path:
    """Writes ``<root>/shakespeare/<split>/<name>`` for each file name and its users; returns the folder."""
    folder = root / "shakespeare" / split
    folder.mkdir(parents=True, exist_ok=True)
    for name, users in files.items():
        (folder / name).write_text(json.dumps(leaf_json(users)))
    return folder


# users in two train files; file names sorted: "a_..." before "b_...", so the user order is HAMLET, OPHELIA, KING
TRAIN = {
    "b_train_9.json": {"THE_TRAGEDY_OF_HAMLET_KING": windows(60, 2)},
    "a_train_9.json": {"THE_TRAGEDY_OF_HAMLET_HAMLET": windows(0, 4), "THE_TRAGEDY_OF_HAMLET_OPHELIA": windows(20, 3)},
}
TEST = {
    "all_test_9.json": {"THE_TRAGEDY_OF_HAMLET_OPHELIA": windows(40, 1), "THE_TRAGEDY_OF_HAMLET_HAMLET": windows(4, 2)}
}
USERS = ("THE_TRAGEDY_OF_HAMLET_HAMLET", "THE_TRAGEDY_OF_HAMLET_OPHELIA", "THE_TRAGEDY_OF_HAMLET_KING")


def write_dataset(root: Path, train: dict = TRAIN, test: dict = TEST) -> None:
    write_leaf(root, "train", train)
    write_leaf(root, "test", test)


# ---------------------------------------------------------------------------------------------------------------------
# the character vocabulary
# ---------------------------------------------------------------------------------------------------------------------


def test_vocabulary_is_leafs_80_characters() -> None:
    assert len(LEAF_CHARS) == len(set(LEAF_CHARS)) == 80 and UNKNOWN_ID == 80 and NUM_CHARS == 81
    assert text_to_ids(LEAF_CHARS).tolist() == list(range(80))
    ids = {c: int(text_to_ids(c)[0]) for c in "\n !?AZ[]az}"}
    assert ids == {"\n": 0, " ": 1, "!": 2, "?": 24, "A": 25, "Z": 50, "[": 51, "]": 52, "a": 53, "z": 78, "}": 79}


def test_round_trip_and_unknown_characters() -> None:
    assert ids_to_text(text_to_ids(TEXT)) == TEXT  # the sample text uses only vocabulary characters
    for unknown in ("\t", "{", "|", "é", "—", "\U0001f600"):
        assert text_to_ids(unknown).tolist() == [UNKNOWN_ID]
    assert text_to_ids("a\té").tolist() == [53, UNKNOWN_ID, UNKNOWN_ID]
    assert ids_to_text(torch.tensor([25, UNKNOWN_ID, 1])) == "A" + UNKNOWN_CHAR + " "
    assert text_to_ids("").shape == (0,)


# ---------------------------------------------------------------------------------------------------------------------
# the loader
# ---------------------------------------------------------------------------------------------------------------------


def test_loads_int64_ids_users_as_groups(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    data = shakespeare(root=str(tmp_path))
    assert data.name == "shakespeare" and data.num_classes == 81 and data.input_shape == (80,)
    assert data.x_train.dtype == torch.int64 and data.x_train.shape == (9, 80) and data.x_test.shape == (3, 80)
    assert data.group_names == USERS
    assert data.groups_train.tolist() == [0] * 4 + [1] * 3 + [2] * 2
    assert data.groups_test.tolist() == [0, 0, 1]  # kept users' order, not the test file's order
    expected_x = windows(0, 4)[0] + windows(20, 3)[0] + windows(60, 2)[0]
    assert [ids_to_text(r) for r in data.x_train] == expected_x
    assert ids_to_text(data.y_train) == "".join(windows(0, 4)[1] + windows(20, 3)[1] + windows(60, 2)[1])
    assert [ids_to_text(r) for r in data.x_test] == windows(4, 2)[0] + windows(40, 1)[0]
    assert ids_to_text(data.y_test) == TEXT[84] + TEXT[85] + TEXT[120]


def test_num_users_keeps_the_first_users(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    data = shakespeare(root=str(tmp_path), num_users=2)
    assert data.group_names == USERS[:2] and len(data.y_train) == 7 and data.groups_test.tolist() == [0, 0, 1]
    data = shakespeare(root=str(tmp_path), num_users=1)
    assert len(data.y_train) == 4 and len(data.y_test) == 2  # OPHELIA's test sample is left out with her


@pytest.mark.parametrize(
    ("num_users", "match"),
    [
        (4, "num_users=4: the train files hold only 3 users; use at most 3, or null"),
        (0, "num_users=0: must be an integer >= 1"),
    ],
)
def test_bad_num_users(tmp_path: Path, num_users: int, match: str) -> None:
    write_dataset(tmp_path)
    raises_one_line(shakespeare, root=str(tmp_path), num_users=num_users, match=f"data.loader.{match}")


def test_missing_folder_names_where(tmp_path: Path) -> None:
    where = (tmp_path / "shakespeare" / "train").resolve()
    message = raises_one_line(shakespeare, root=str(tmp_path), match=f"LEAF Shakespeare not found at {where}")
    assert "*.json" in message and "paths.data_dir" in message
    write_leaf(tmp_path, "train", TRAIN)
    raises_one_line(shakespeare, root=str(tmp_path), match=f"not found at {where.parent / 'test'}")


def _count(blob: dict) -> None:
    blob["num_samples"][0] = 5


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda b: b.pop("user_data"), "expected a LEAF JSON object with keys users, num_samples, user_data"),
        (lambda b: b["user_data"]["u"]["x"].__setitem__(1, "short"), "user 'u': every x must be a string of 80"),
        (lambda b: b["user_data"]["u"]["y"].__setitem__(0, "ab"), "user 'u': every y must be a single character"),
        (_count, "user 'u': 2 x, 2 y, num_samples 5"),
        (lambda b: b["users"].append("ghost"), "users and num_samples must be lists of the same length"),
    ],
)
def test_malformed_json_names_the_file(tmp_path: Path, edit: Callable[[dict], object], problem: str) -> None:
    blob = leaf_json({"u": tuple(list(s) for s in windows(0, 2))})
    edit(blob)
    folder = write_leaf(tmp_path, "train", {})
    (folder / "bad.json").write_text(json.dumps(blob))
    write_leaf(tmp_path, "test", TEST)
    message = raises_one_line(shakespeare, root=str(tmp_path), match=f"corrupt or unreadable file {folder.resolve()}")
    assert f"bad.json: {problem}" in message


def test_unparsable_json_and_duplicate_users(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    bad = tmp_path / "shakespeare" / "test" / "zz.json"
    bad.write_text('{"users": [')
    raises_one_line(shakespeare, root=str(tmp_path), match=f"{bad.resolve()}: JSONDecodeError")
    bad.unlink()
    write_leaf(tmp_path, "train", {"c_more.json": {USERS[0]: windows(0, 1)}})
    raises_one_line(shakespeare, root=str(tmp_path), match=f"c_more.json: user '{USERS[0]}' also appears in an earlier")


def test_no_test_sample_of_a_kept_user(tmp_path: Path) -> None:
    write_dataset(tmp_path, test={"t.json": {"SOMEONE_ELSE": windows(0, 1)}})
    raises_one_line(shakespeare, root=str(tmp_path), match="no test sample of the 3 kept users")


# ---------------------------------------------------------------------------------------------------------------------
# one client per user, integer inputs end to end
# ---------------------------------------------------------------------------------------------------------------------


def test_one_client_per_user_and_token_ids_stay_int64(tmp_path: Path) -> None:
    write_dataset(tmp_path)
    dm = FederatedDataModule(lambda: shakespeare(root=str(tmp_path)), ByGroup(num_clients=3))
    dm.setup("fit")
    assert [c.tolist() for c in dm.client_train] == [[0, 1, 2, 3], [4, 5, 6], [7, 8]]
    store = dm.clients.to(torch.device("cpu"), torch.float64)  # the net's dtype: must not touch token ids
    assert store.x.dtype == torch.int64 and torch.equal(store.x, dm.data.x_train)
    x_test = dm.test_dataloader()[0].tensors[0]
    assert x_test.dtype == torch.int64


def test_hydra_config_builds_datamodule_and_gru(tmp_path: Path) -> None:
    """``data=shakespeare partition=by_group model=gru`` composes; the net maps the id batches to 81 logits."""
    from hydra.utils import instantiate

    from flx.run import build_net

    write_dataset(tmp_path)
    overrides = ["data=shakespeare", "data.loader.num_users=2", "partition=by_group", "partition.num_clients=2"]
    cfg = precheck([*overrides, "algo.clients_per_round=2", "model=gru", f"paths.data_dir={tmp_path}"])
    dm = FederatedDataModule(instantiate(cfg.data.loader), instantiate(cfg.partition), cfg.seed)
    dm.setup("fit")
    assert dm.num_clients == 2 and [len(c) for c in dm.client_train] == [4, 3]
    net = build_net(cfg.model, dm.data.input_shape, dm.data.num_classes)
    assert net(dm.data.x_test).shape == (3, 81)


@pytest.mark.slow
def test_train_runs_end_to_end_on_token_ids(tmp_path: Path) -> None:
    """Two federated rounds of the GRU on int64 inputs through ``train`` (ClientStore, local steps, val and test)."""
    from flx.run import train

    write_dataset(tmp_path / "data")
    cfg = precheck(
        [
            "data=shakespeare",
            "data.loader.num_users=null",
            "partition=by_group",
            "partition.num_clients=3",
            "model=gru",
            "algo.clients_per_round=3",
            "algo.rounds=2",
            "algo.local_steps=2",
            "algo.batch_size=2",
            "logger=none",
            "callbacks.progress_bar=null",
            "trainer.enable_progress_bar=false",
            "trainer.accelerator=cpu",
            f"paths.data_dir={tmp_path / 'data'}",
            f"paths.output_dir={tmp_path / 'out'}",
        ]
    )
    metrics = train(cfg)
    assert 0.0 <= metrics["test/acc"] <= 1.0 and np.isfinite(metrics["test/loss"])
