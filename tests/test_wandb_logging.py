"""What a run shows on W&B, read back from the offline run files the wandb library wrote (``flx.wandb_files``): the
config and code version, the run's name and group, the per-round metrics against ``fl/round`` (equal to the CSV of
the same run), the per-client tables of every evaluation round, and the line plots of FeDXL's AUCs, DRFA's lambda and
pFedFBE's personalised vs global accuracy, and the privacy ledger. One tiny run per algorithm, shared by its tests
(marked slow: Trainers)."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import wandb
from omegaconf import DictConfig, OmegaConf

from flx.config import precheck
from flx.errors import instantiate
from flx.run import build, train
from flx.sampling import SAMPLE_TAG, derive_seed, uniform_cohort
from flx.wandb_files import OfflineRun, load_run, read_records
from flx.wandb_logging import ROUND, code_version, run_config

pytestmark = pytest.mark.slow
QUIET = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]
FEDXL = [
    "algo=fedxl1",
    "data=digits_binary",
    "partition=iid",
    "partition.num_clients=6",
    "algo.clients_per_round=3",  # a cohort: the tables' sampled flags are not all true
    "algo.local_steps=2",
    "algo.rounds=3",
    "checkpoint=null",
    *QUIET,
]
DRFA = ["algo=drfa", "model=logreg", "partition.num_clients=5", "algo.local_steps=2", "algo.rounds=3", *QUIET]
PFEDFBE = [
    "algo=pfedfbe",
    "model=logreg",
    "partition.num_clients=4",
    "partition.test_fraction=0.3",
    "algo.clients_per_round=2",
    "algo.local_steps=2",
    "algo.rounds=2",
    "checkpoint=null",
    "privacy=central",  # pFedFBE composes with DP: its ledger on W&B too (shares the run)
    "privacy.noise_multiplier=1.0",
    *QUIET,
]
Run = tuple[DictConfig, Path, OfflineRun]


def _run(tmp_path_factory: pytest.TempPathFactory, name: str, overrides: list[str]) -> Run:
    out = tmp_path_factory.mktemp(name)
    cfg = precheck([*overrides, f"paths.output_dir={out}"])
    train(cfg)
    assert wandb.run is None, "train() left its W&B run open"
    return cfg, out, load_run(out)


@pytest.fixture(scope="module")
def fedxl(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(tmp_path_factory, "fedxl", [*FEDXL, "logger=[csv,wandb]"])


@pytest.fixture(scope="module")
def drfa(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(tmp_path_factory, "drfa", [*DRFA, "logger=wandb"])


@pytest.fixture(scope="module")
def pfedfbe(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run(tmp_path_factory, "pfedfbe", [*PFEDFBE, "logger=wandb"])


def csv_rows(out: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(out / "csv" / "metrics.csv")))


def assert_points(got: list[tuple[float, float]], expected: list[tuple[float, float]], what: str = "") -> None:
    """Same rounds, values equal to float32 precision (W&B and the CSV store the same logged floats)."""
    assert [x for x, _ in got] == [x for x, _ in expected], what
    assert [y for _, y in got] == pytest.approx([y for _, y in expected], rel=1e-6), what


def plot_lines(run: OfflineRun, key: str) -> dict[str, list[tuple[float, float]]]:
    """The lines of the last ``wandb.plot.line_series`` logged as ``key``: its table ``<key>_table``."""
    _, rows = run.tables(f"{key}_table")[-1]
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        lines.setdefault(row["lineKey"], []).append((row["step"], row["lineVal"]))
    return lines


# ---------------------------------------------------------------------------------------------------------- config
def test_config_is_the_resolved_config_with_the_code_version(fedxl: Run) -> None:
    cfg, _, run = fedxl
    assert run.config["algo"]["name"] == "fedxl1" and run.config["data"]["name"] == "digits_binary"
    assert run.config["algo"]["lr"] == pytest.approx(float(cfg.algo.lr)) and run.config["seed"] == 0
    assert run.config["algo"]["clients_per_round"] == 3  # resolved (the config says ${partition.num_clients})
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert run.config["code"]["git_commit"] == head and isinstance(run.config["code"]["git_dirty"], bool)
    assert run.config["code"]["flx_version"] == code_version()["flx_version"]
    assert (run.name, run.group) == ("fedxl1-digits_binary-s0", "fedxl1-digits_binary")


def test_a_user_set_name_and_group_win(tmp_path: Path) -> None:
    cfg = precheck(
        ["logger=wandb", "logger.wandb.name=mine", "logger.wandb.group=ours", f"paths.output_dir={tmp_path}"]
    )
    logger = instantiate(cfg.logger.wandb)
    init = logger._wandb_init  # no run is started: read what wandb.init would get
    assert (init["name"], init["group"]) == ("mine", "ours")


def test_run_config_without_a_hydra_run_keeps_what_it_cannot_resolve() -> None:
    cfg = OmegaConf.create({"algo": {"lr": 0.1, "eta": "${algo.lr}"}, "out": "${hydra:runtime.output_dir}"})
    config = run_config(cfg)
    assert config["out"] == "${hydra:runtime.output_dir}" and config["code"] == code_version()
    assert run_config(OmegaConf.create({"algo": {"lr": 0.1, "eta": "${algo.lr}"}}))["algo"] == {"lr": 0.1, "eta": 0.1}


def test_code_version_outside_a_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_git(*args: Any, **kwargs: Any) -> None:
        raise subprocess.CalledProcessError(128, "git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert set(code_version.__wrapped__()) == {"flx_version"}


def test_train_finishes_the_run(fedxl: Run) -> None:
    _, out, _ = fedxl
    (path,) = (out / "wandb").rglob("run-*.wandb")
    kinds = [r.WhichOneof("record_type") for r in read_records(path)]
    assert "exit" in kinds and kinds.count("run") == 1


# ---------------------------------------------------------------------------------------------------- per round
def test_round_is_the_x_axis_and_the_metrics_equal_the_csv(fedxl: Run) -> None:
    _, out, run = fedxl
    assert run.metrics["*"]["step_metric"] == ROUND and run.metrics["*"]["step_sync"]
    rows = csv_rows(out)
    for key in ("val/acc", "val/loss", "val/auroc", "val/pauc_0.3", "train/loss", "fl/samples", "test/acc"):
        expected = [(float(r[ROUND]), float(r[key])) for r in rows if r.get(key)]
        assert_points(run.series(key), expected, key)
    assert [r for r, _ in run.series("val/acc")] == [1, 2, 3] and [r for r, _ in run.series("test/acc")] == [3]


def test_per_client_table_on_every_evaluation_round(fedxl: Run) -> None:
    """Every validated round: a row per client with its accuracy and loss on its validation rows, their number, its
    training rows and whether the round's cohort (FedAvg's uniform draw of 3 of 6) held it."""
    cfg, _, run = fedxl
    dm, _, _ = build(cfg)
    rows_per_client = [len(y) for _, y in dm.client_eval_data("val")]
    tables = run.tables("val/client_acc_table")
    assert [row[ROUND] for row, _ in tables] == [1, 2, 3]
    samples = dict(run.series("fl/samples"))
    for row, table in tables:
        r = int(row[ROUND])
        rng = np.random.default_rng(derive_seed(cfg.seed, r - 1, SAMPLE_TAG))
        cohort = set(uniform_cohort(6, 3, rng))
        assert [t["client"] for t in table] == list(range(6))
        assert [t["samples"] for t in table] == rows_per_client
        assert {t["client"] for t in table if t["sampled"]} == cohort
        assert sum(t["train_samples"] for t in table if t["sampled"]) == samples[r]
        assert sum(t["acc"] for t in table) / 6 == pytest.approx(dict(run.series("val/client_acc_mean"))[r], rel=1e-6)
        assert all(t["loss"] > 0 for t in table)


# ---------------------------------------------------------------------------------------------------------- plots
def test_fedxl_auc_plot_equals_the_logged_values(fedxl: Run) -> None:
    _, _, run = fedxl
    lines = plot_lines(run, "plots/auc")
    assert set(lines) == {"val/auroc", "val/pauc_0.3", "val/pauc_0.5"}  # test/*: once after fit, not per round
    for key, points in lines.items():
        assert_points(points, run.series(key), key)
    assert not run.tables("plots/personal_vs_global_table")  # no personalised model: no plot


def test_drfa_lambda_plot_equals_lambda_json(drfa: Run) -> None:
    _, out, run = drfa
    history = json.loads((out / "lambda.json").read_text())["round_end"]
    lines = plot_lines(run, "lambda/plot")
    assert set(lines) == {*(f"lambda_{i}" for i in range(5)), "max", "min"}
    for i in range(5):
        assert_points(lines[f"lambda_{i}"], [(r + 1, lam[i]) for r, lam in enumerate(history)])
    assert_points(lines["max"], [(r + 1, max(lam)) for r, lam in enumerate(history)])
    assert_points(lines["min"], [(r + 1, min(lam)) for r, lam in enumerate(history)])
    assert [r for r, _ in run.series("lambda/max")] == [1, 2, 3]


def test_pfedfbe_personal_vs_global_plot(pfedfbe: Run) -> None:
    _, _, run = pfedfbe
    lines = plot_lines(run, "plots/personal_vs_global")
    assert set(lines) == {"val/personal_acc_mean", "val/client_acc_mean"}
    for key, points in lines.items():
        assert_points(points, run.series(key), key)
        assert len(points) == 2
    (row, table), _ = run.tables("val/client_personal_acc_table")
    assert row[ROUND] == 1 and {"client", "personal_acc", "train_samples", "sampled"} <= set(table[0])


def test_privacy_epsilon_is_a_series_against_the_round(pfedfbe: Run) -> None:
    """privacy=central logs its ledger every round: ``privacy/epsilon`` against ``fl/round`` equals the accountant's
    epsilon after 1 and 2 rounds (Poisson sampling of 2 expected of 4 clients, sigma 1, delta 1e-5)."""
    from flx import privacy

    _, _, run = pfedfbe
    mech = privacy.Mechanism("poisson", 1.0, 4, 2)
    expected = [(float(t), privacy.epsilon(mech, t, 1e-5, "pld")) for t in (1, 2)]
    assert_points(run.series("privacy/epsilon"), expected, "privacy/epsilon")
    # the summary says what the final line says: the epsilon spent and that every round was private
    assert run.summary["final/epsilon"] == pytest.approx(expected[-1][1]) and run.summary["final/private"] == "all"
