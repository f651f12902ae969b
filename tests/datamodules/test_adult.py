"""Tests for the Adult loader: tiny adult.data / adult.test files in UCI's real format, loaded through the real code.

The real files: comma+space separated rows of 15 fields, ``?`` for a missing value; ``adult.test`` opens with the
comment line ``|1x3 Cross validator`` and its labels end with a dot; both end with a blank line.
"""

from __future__ import annotations

import gzip
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import raises_one_line

from flx.config import precheck
from flx.datamodules.adult import COLUMNS, FEATURES, GROUPS, adult
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.partitioners import ByGroup
from flx.errors import ConfigError

TEST_HEADER = "|1x3 Cross validator"
# one real row of adult.data, as a template: (column -> value)
TEMPLATE = dict(
    zip(
        COLUMNS,
        "39, State-gov, 77516, Bachelors, 13, Never-married, Adm-clerical, Not-in-family, White, Male, 2174, 0, 40, "
        "United-States, <=50K".split(", "),
    )
)


def row(**values: object) -> str:
    """One data row: the template with some columns replaced (``education_num`` stands for ``education-num``)."""
    fields = {**TEMPLATE, **{k.replace("_", "-"): str(v) for k, v in values.items()}}
    return ", ".join(fields[c] for c in COLUMNS)


def write_adult(root: Path, train: Sequence[str], test: Sequence[str], gz: bool = False) -> Path:
    """Writes ``<root>/adult/adult.data`` and ``adult.test`` as UCI ships them (test: comment line, blank end)."""
    folder = root / "adult"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("adult.data", "\n".join(train) + "\n\n"), ("adult.test", "\n".join([TEST_HEADER, *test]))):
        path = folder / (name + ".gz" if gz else name)
        path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return folder


# four train rows and three test rows with hand-checkable values
TRAIN = [
    row(age=20, workclass="Private", capital_loss=0, sex="Female", race="White", income="<=50K"),
    row(age=30, workclass="?", capital_loss=0, sex="Male", race="Black", income=">50K"),
    row(age=40, workclass="State-gov", capital_loss=0, sex="Female", race="Other", income="<=50K"),
    row(age=50, workclass="Private", capital_loss=0, sex="Male", race="White", income=">50K"),
]
TEST = [
    row(age=45, workclass="Never-worked", capital_loss=100, sex="Male", race="Asian-Pac-Islander", income=">50K."),
    row(age=35, workclass="?", capital_loss=0, sex="Female", race="Amer-Indian-Eskimo", income="<=50K."),
    row(age=20, workclass="State-gov", capital_loss=0, sex="Female", race="White", income="<=50K."),
]


def col(name: str) -> int:
    return FEATURES.index(name)


def test_exact_features_labels_and_groups(tmp_path: Path) -> None:
    """Standardised with the train file's statistics (population std).

    age: train 20, 30, 40, 50 -> mean 35, std sqrt(125). workclass: sorted train categories Private=0, State-gov=1;
    ``?`` and the unseen Never-worked get 2, so the train codes 0, 2, 1, 0 have mean 3/4 and std sqrt(11/16).
    capital-loss is 0 on every train row: std 0 counts as 1.
    """
    write_adult(tmp_path, TRAIN, TEST)
    data = adult(root=str(tmp_path))
    assert data.input_shape == (14,) and data.num_classes == 2 and data.name == "adult-sex"
    assert data.x_train.dtype == torch.float32 and len(data.x_train) == 4 and len(data.x_test) == 3
    age_std, work_std = math.sqrt(125.0), math.sqrt(11 / 16)
    expect_age = [(a - 35) / age_std for a in (45, 35, 20)]
    torch.testing.assert_close(data.x_test[:, col("age")], torch.tensor(expect_age))
    expect_work = [(c - 0.75) / work_std for c in (2, 2, 1)]
    torch.testing.assert_close(data.x_test[:, col("workclass")], torch.tensor(expect_work))
    torch.testing.assert_close(data.x_train[:, col("workclass")], torch.tensor([-0.75, 1.25, 0.25, -0.75]) / work_std)
    assert data.x_test[:, col("capital-loss")].tolist() == [100.0, 0.0, 0.0]
    # a column equal on every train row (fnlwgt, education, ...) standardises to 0
    assert data.x_train[:, col("fnlwgt")].abs().max() == 0
    assert data.y_train.tolist() == [0, 1, 0, 1] and data.y_test.tolist() == [1, 0, 0]  # test labels end with "."
    assert data.groups_train.tolist() == [0, 1, 0, 1] and data.groups_test.tolist() == [1, 0, 0]
    assert data.group_names == ("Female", "Male")


def test_every_train_feature_is_standardised(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ages, hours, education = rng.integers(17, 90, 50), rng.integers(1, 99, 50), rng.choice(["HS-grad", "Masters"], 50)
    rows = [row(age=a, hours_per_week=h, education=e) for a, h, e in zip(ages, hours, education)]
    write_adult(tmp_path, rows, rows[:3])
    x = adult(root=str(tmp_path)).x_train.double()
    varying = [col("age"), col("hours-per-week"), col("education")]
    torch.testing.assert_close(x[:, varying].mean(0), torch.zeros(3, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        x[:, varying].std(0, correction=0), torch.ones(3, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_race_groups_and_gz_files(tmp_path: Path) -> None:
    write_adult(tmp_path, TRAIN, TEST, gz=True)
    data = adult(root=str(tmp_path), split_by="race")
    assert data.name == "adult-race" and data.group_names == GROUPS["race"]
    assert data.group_names == ("White", "Black", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other")
    assert data.groups_train.tolist() == [0, 1, 4, 0] and data.groups_test.tolist() == [2, 3, 0]


def test_missing_number_counts_as_the_train_mean(tmp_path: Path) -> None:
    write_adult(tmp_path, [row(age=20), row(age="?"), row(age=40)], [row(age="?")])
    data = adult(root=str(tmp_path))
    # mean and std over the known ages 20 and 40 only: 30 and 10
    assert data.x_train[:, col("age")].tolist() == [-1.0, 0.0, 1.0] and data.x_test[0, col("age")] == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------------------


def test_missing_files_name_the_file_and_the_folder(tmp_path: Path) -> None:
    folder = (tmp_path / "adult").resolve()
    message = raises_one_line(adult, root=str(tmp_path), match=f"Adult not found at {folder}")
    assert "adult.data" in message and "missing adult.data, adult.test" in message and "paths.data_dir" in message
    write_adult(tmp_path, TRAIN, TEST)
    (folder / "adult.test").unlink()
    raises_one_line(adult, root=str(tmp_path), match="missing adult.test;")


@pytest.mark.parametrize(
    ("train", "test", "where", "problem"),
    [
        ([TRAIN[0], "39, State-gov, 77516"], TEST, "adult.data: line 2", "expected 15 comma-separated fields, got 3"),
        (TRAIN, [TEST[0], row(age="abc")], "adult.test: line 3", "age 'abc' is not a number"),
        (TRAIN, [row(age="inf")], "adult.test: line 2", "age 'inf' is not a finite number"),
        ([row(income=">60K")], TEST, "adult.data: line 1", "income '>60K' is not <=50K or >50K"),
        (TRAIN, [TEST[0], TEST[1], row(sex="X")], "adult.test: line 4", "sex 'X' is not one of Female, Male"),
        ([], TEST, "adult.data", "no data rows"),
    ],
)
def test_malformed_rows_name_the_file_and_line(tmp_path: Path, train, test, where: str, problem: str) -> None:
    folder = write_adult(tmp_path, train, test).resolve()
    message = raises_one_line(adult, root=str(tmp_path), match=f"data=adult: corrupt or unreadable file {folder}/")
    assert f"{where}: {problem}" in message


def test_split_by_is_validated(tmp_path: Path) -> None:
    write_adult(tmp_path, TRAIN, TEST)
    raises_one_line(
        adult, root=str(tmp_path), split_by="age", match="data.loader.split_by='age': must be one of sex, race"
    )


# ---------------------------------------------------------------------------------------------------------------------
# the group split through the datamodule (FedTorch's Adult split)
# ---------------------------------------------------------------------------------------------------------------------

SEXES, RACES = GROUPS["sex"], GROUPS["race"]


def random_rows(n: int, seed: int = 0) -> tuple[list[str], np.ndarray, np.ndarray]:
    """``n`` rows with random sex and race (every race at least twice); returns the rows and both group id arrays."""
    rng = np.random.default_rng(seed)
    sex = rng.integers(0, 2, n)
    race = np.concatenate([np.repeat(np.arange(5), 2), rng.integers(0, 5, n - 10)])
    rows = [row(age=20 + i % 50, sex=SEXES[s], race=RACES[r]) for i, (s, r) in enumerate(zip(sex, race))]
    return rows, sex, race


@pytest.mark.parametrize(("split_by", "per_group"), [("sex", 5), ("race", 2)])
def test_by_group_gives_each_group_contiguous_chunks(tmp_path: Path, split_by: str, per_group: int) -> None:
    """N = 10: each group's samples, in file order, are cut into N / #groups near-equal contiguous chunks."""
    rows, sex, race = random_rows(83)
    write_adult(tmp_path, rows, rows[:5])
    dm = FederatedDataModule(lambda: adult(root=str(tmp_path), split_by=split_by), ByGroup(num_clients=10))
    dm.setup("fit")
    groups = sex if split_by == "sex" else race
    assert dm.num_clients == 10 and not dm.has_client_rows("test")
    everything = torch.cat(list(dm.client_train)).sort().values
    assert torch.equal(everything, torch.arange(83))  # every train sample in exactly one client
    for g in range(len(GROUPS[split_by])):
        clients = dm.client_train[g * per_group : (g + 1) * per_group]
        assert torch.equal(torch.cat(clients), torch.from_numpy(np.flatnonzero(groups == g)))  # contiguous, in order
        sizes = [len(c) for c in clients]
        n = int((groups == g).sum())
        assert sizes == [n // per_group + (k < n % per_group) for k in range(per_group)]


def test_by_group_with_a_dataset_without_groups_is_one_line(tmp_path: Path) -> None:
    from flx.datamodules.datasets import breast_cancer

    dm = FederatedDataModule(breast_cancer, ByGroup(num_clients=10))
    raises_one_line(dm.setup, "fit", match="partition='by_group': needs a dataset with sample groups (data=adult")


def test_by_group_needs_a_multiple_of_the_groups(tmp_path: Path) -> None:
    write_adult(tmp_path, *random_rows(40)[:1], TEST)
    dm = FederatedDataModule(lambda: adult(root=str(tmp_path), split_by="race"), ByGroup(num_clients=4))
    raises_one_line(dm.setup, "fit", match="partition.num_clients=4: by_group needs a multiple of the number of groups")


def test_hydra_config_builds_the_adult_datamodule(tmp_path: Path) -> None:
    """``train.py data=adult partition=by_group partition.num_clients=10 model=logreg`` composes and builds."""
    from hydra.utils import instantiate

    from flx.run import build_net

    rows, sex, _ = random_rows(60)
    write_adult(tmp_path, rows, rows[:7])
    cfg = precheck(
        ["data=adult", "partition=by_group", "partition.num_clients=10", "model=logreg", f"paths.data_dir={tmp_path}"]
    )
    assert cfg.data.loader.split_by == "sex"
    dm = FederatedDataModule(instantiate(cfg.data.loader), instantiate(cfg.partition), cfg.seed)
    dm.setup("fit")
    assert dm.num_clients == 10 and dm.data.groups_test.tolist() == sex[:7].tolist()
    for c, rows_c in enumerate(dm.client_train):
        assert set(sex[rows_c.numpy()].tolist()) == {c // 5}  # clients 0-4 Female only, 5-9 Male only
    net = build_net(cfg.model, dm.data.input_shape, dm.data.num_classes)
    assert net(dm.data.x_test).shape == (7, 2)
    with pytest.raises(ConfigError, match=r"data.loader.split_by='gender': must be one of sex, race"):
        cfg = precheck(["data=adult", "data.loader.split_by=gender", f"paths.data_dir={tmp_path}"])
        instantiate(cfg.data.loader)()


@pytest.mark.slow
def test_train_runs_end_to_end_with_the_paper_mlp(tmp_path: Path) -> None:
    """DRFA's Adult race setting through ``train``: 10 clients (2 per race), MLP 14 -> 50 -> 50 -> 2, two rounds."""
    from flx.run import build, train

    rows, _, race = random_rows(80)
    write_adult(tmp_path / "data", rows, rows[:20])
    overrides = ["data=adult", "data.loader.split_by=race", "partition=by_group", "partition.num_clients=10"]
    overrides += ["data.val_fraction=0"]  # the DRFA protocol: every training row in a client (race[] indexes them)
    overrides += ["model=mlp", "model.hidden=[50,50]", "algo.rounds=2", "algo.local_steps=2", "logger=none"]
    overrides += ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]
    overrides += [f"paths.data_dir={tmp_path / 'data'}", f"paths.output_dir={tmp_path / 'out'}"]
    dm, module, _ = build(precheck(overrides))
    assert [set(race[c.numpy()].tolist()) for c in dm.client_train] == [{g} for g in range(5) for _ in range(2)]
    widths = [14, 50, 50, 2]
    assert sum(p.numel() for p in module.net.parameters()) == sum(a * b + b for a, b in zip(widths, widths[1:]))
    metrics = train(precheck(overrides))
    assert 0.0 <= metrics["test/acc"] <= 1.0 and np.isfinite(metrics["test/loss"])
