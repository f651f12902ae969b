"""``scripts/benchmark.py``: the table is the stored runs' numbers, the step size is the grid's best validation score
(a diverging step ranks last), and a sweep resumes from its run store (a killed sweep trains only what it had not
finished, a diverged run is stored as such). One small sweep (2 methods, 1 setting, 2 seeds, 2 rounds, a grid of a
sane step and one that diverges) is shared by every test."""

from __future__ import annotations

import csv
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "reproduce"))

import benchmark  # noqa: E402

ARGS = ["--methods", "FedAvg", "FedProx", "--settings", "Dir(0.5)", "--seeds", "0", "1", "--rounds", "2"]
ARGS += ["--local-epochs", "1", "--unseen", "0", "--jobs", "1"]
GRID = (0.03, 1e6)  # the second diverges in its first round


def _trained(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Records the overrides of every run that trains (the store answers the others)."""
    import flx.run

    calls: list[list[str]] = []
    real = flx.run.train

    def train(cfg, *a, **kw):
        calls.append([str(cfg.seed), str(cfg.algo.name), str(cfg.algo.lr)])
        return real(cfg, *a, **kw)

    monkeypatch.setattr(flx.run, "train", train)
    return calls


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(benchmark, "GRID", GRID)
        benchmark.main([*ARGS, "--out", str(out)])
    return out


@pytest.mark.slow
def test_the_table_holds_the_stored_runs_numbers(sweep: Path) -> None:
    """Each cell is mean ± std over the seeds of the runs in the store, in percent; the csv has one row per run."""
    rows = list(csv.DictReader(open(sweep / "table.csv")))
    assert len(rows) == 4 and {r["method"] for r in rows} == {"FedAvg", "FedProx"}
    table = (sweep / "table.md").read_text()
    for method in ("FedAvg", "FedProx"):
        accs = [float(r["test_acc"]) * 100 for r in rows if r["method"] == method]
        cell = f"{statistics.mean(accs):.2f} ± {statistics.stdev(accs):.2f}"
        line = next(ln for ln in table.splitlines() if ln.startswith(f"| {method} |"))
        assert cell in line, (cell, line)
    assert (sweep / "accuracy.png").stat().st_size > 0
    records = [json.loads(p.read_text()) for p in (sweep / "runs").glob("*.json")]
    assert len(records) == 4 + 4  # 2 methods x 2 grid values on the tuning seed, 2 methods x 2 seeds
    failed = [r for r in records if "failed" in r]
    assert len(failed) == 2 and all("algo.lr=1000000.0" in r["overrides"] for r in failed)
    assert all(r["curves"]["test/acc"] and "val/client_acc_mean" not in r["curves"] for r in records if r not in failed)


@pytest.mark.slow
def test_the_step_size_is_the_best_validation_score_on_the_tuning_seed(sweep: Path) -> None:
    tuned = json.loads((sweep / "tuned.json").read_text())["Dir(0.5)"]
    rows = list(csv.DictReader(open(sweep / "table.csv")))
    for method, got in tuned.items():
        scores = {float(k): v for k, v in got["scores"].items()}
        assert got["seed"] == benchmark.TUNE_SEED and got["lr"] == max(scores, key=lambda lr: (scores[lr], -lr))
        assert got["lr"] == 0.03 and scores[1e6] == -math.inf  # the diverged step ranks last
        assert {float(r["lr"]) for r in rows if r["method"] == method} == {got["lr"]}


@pytest.mark.slow
def test_a_killed_sweep_trains_only_the_runs_it_had_not_finished(
    sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rerun over a copy of the store with one reported run removed (a sweep killed before it finished): only that
    run trains (not the diverged ones either), and the table is the same; ``--stored-only`` trains nothing."""
    import shutil

    out = tmp_path / "again"
    shutil.copytree(sweep, out)
    stored = sorted((out / "runs").glob("*.json"))
    victim = next(p for p in stored if "seed=1" in json.loads(p.read_text())["overrides"])
    victim.unlink()
    monkeypatch.setattr(benchmark, "GRID", GRID)
    calls = _trained(monkeypatch)
    benchmark.main([*ARGS, "--out", str(out)])
    assert len(calls) == 1 and calls[0][0] == "1"

    def body(path: Path) -> list[str]:
        return [ln for ln in path.read_text().splitlines() if not ln.startswith(("Produced by", "Wall time"))]

    assert body(out / "table.md") == body(sweep / "table.md")
    benchmark.main([*ARGS, "--out", str(out), "--stored-only"])
    assert len(calls) == 1
