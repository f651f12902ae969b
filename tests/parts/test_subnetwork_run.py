"""``algo=whale system=mobile20 model=cnn_scalable`` through the real entry point (tiny widths, 3 rounds): the levels,
the Fisher mean, the width and ``sim/clock`` are logged, a time to target is logged once reached, the test accuracy
is printed; the baselines' configs compose (marked slow: Trainers)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from flx.config import precheck
from flx.errors import ConfigError
from flx.run import build, train
from flx.wandb_files import load_run
from flx.wandb_logging import ROUND

pytestmark = pytest.mark.slow
QUIET = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]
TINY = ["model=cnn_scalable", "model.widths=[4,4,8,8]", "partition.num_clients=6", "algo.local_steps=2", *QUIET]


def logged(out: Path, key: str) -> list[float]:
    return [float(r[key]) for r in csv.DictReader(open(out / "csv" / "metrics.csv")) if r.get(key)]


def test_whale_logs_levels_fisher_and_the_clock(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = precheck(
        ["algo=whale", "system=mobile20", *TINY, "algo.rounds=3", "algo.target_acc=0.0", f"paths.output_dir={out}"]
    )
    metrics = train(cfg)
    assert "test/acc" in metrics
    clock = logged(out, "sim/clock")
    assert len(clock) == 3 and clock[0] < clock[1] < clock[2]
    levels = [logged(out, f"whale/level_{p}") for p in range(1, 6)]
    assert all(len(v) == 3 for v in levels)
    assert [sum(v[r] for v in levels) for r in range(3)] == [6.0, 6.0, 6.0]  # every client, every round
    assert [v[0] for v in levels] == [0.0, 0.0, 0.0, 0.0, 6.0]  # cold start: the smallest level
    assert all(f > 0 for f in logged(out, "whale/fi_mean"))
    assert logged(out, "sim/time_to_target") == pytest.approx([clock[0]] * 3, rel=1e-6)  # reached in round 1
    # whale.json: per round and client the level and sqrt(mean FI^2), and the clock; the logged values are its sums
    history = json.loads((out / "whale.json").read_text())["rounds"]
    assert [h["round"] for h in history] == sorted(set(logged(out, ROUND))) == [1, 2, 3]  # fl/round's numbers
    assert [h["clock"] for h in history] == pytest.approx(clock)
    for r, h in enumerate(history):
        assert [list(h["level"].values()).count(p) for p in range(1, 6)] == [v[r] for v in levels]
        assert sum(h["fi"].values()) / len(h["fi"]) == pytest.approx(logged(out, "whale/fi_mean")[r], rel=1e-6)


def test_whale_resume_equals_uninterrupted_and_writes_wandb_plots(tmp_path: Path) -> None:
    """4 rounds == 2 + 2 from the checkpoint: the model, the Fisher windows, the level history and the clock. The
    uninterrupted run logs to W&B offline (read back from its run files): the level / Fisher histograms each round,
    the history table (rounds numbered as ``fl/round``) and the Fisher trace at the end, a line per client."""
    base = ["algo=whale", "system=mobile20", *TINY]
    train(precheck([*base, "algo.rounds=4", "logger=wandb", f"paths.output_dir={tmp_path / 'a'}"]))
    train(precheck([*base, "algo.rounds=2", "logger=none", f"paths.output_dir={tmp_path / 'b'}"]))
    ckpt = tmp_path / "b" / "checkpoints" / "last.ckpt"
    train(precheck([*base, "algo.rounds=4", "logger=none", f"ckpt_path={ckpt}", f"paths.output_dir={tmp_path / 'c'}"]))
    a, c = (torch.load(tmp_path / r / "checkpoints" / "last.ckpt", weights_only=False) for r in "ac")
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], c["state_dict"][k]), k
    (key,) = [k for k in a["callbacks"] if "Subnetwork" in k]
    part_a, part_c = a["callbacks"][key], c["callbacks"][key]
    assert part_a["windows"] == part_c["windows"] and len(part_a["windows"][0]) == 4
    assert part_a["history"] == part_c["history"] and len(part_a["history"]) == 4
    levels = [sorted(h["level"].values()) for h in part_a["history"]]
    assert levels[0] == [5] * 6 and levels[-1] != levels[0], levels  # cold start, then the utility moves them
    assert json.loads((tmp_path / "c" / "whale.json").read_text())["rounds"] == json.loads(
        json.dumps(part_a["history"])
    )
    run = load_run(tmp_path / "a")
    hists = [row for row in run.history if "whale/level_hist" in row]
    assert [row[ROUND] for row in hists] == [1, 2, 3, 4] and all("whale/fi_hist" in row for row in hists)
    assert [sum(row["whale/level_hist"]["values"]) for row in hists] == [6] * 4  # every client, every round
    ((_, table),) = run.tables("whale/history")
    assert len(table) == 4 * 6 and {r["round"] for r in table} == {1, 2, 3, 4}
    assert [r["level"] for r in table] == [lvl for h in part_a["history"] for lvl in h["level"].values()]
    _, rows = run.tables("whale/fisher_trace_table")[-1]
    lines: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        lines.setdefault(row["lineKey"], []).append((row["step"], row["lineVal"]))
    history = part_a["history"]
    assert list(lines) == [f"client {c}" for c in range(6)]
    for c in range(6):
        assert [x for x, _ in lines[f"client {c}"]] == pytest.approx([h["clock"] for h in history], rel=1e-12)
        assert [y for _, y in lines[f"client {c}"]] == pytest.approx([h["fi"][c] for h in history], rel=1e-12)


@pytest.mark.parametrize("algo", ["heterofl", "fedrolex", "feddropout", "whale_rolex", "whale_dropout"])
def test_baseline_configs_build(tmp_path: Path, algo: str) -> None:
    _, _, trainer = build(precheck([f"algo={algo}", "system=mobile20", *TINY, f"paths.output_dir={tmp_path}"]))
    part = next(cb for cb in trainer.callbacks if type(cb).__name__ == "Subnetwork")
    assert part.params.extractor == {"heterofl": "prefix", "whale_rolex": "rolling", "fedrolex": "rolling"}.get(
        algo, "random"
    )
    assert part.params.scheduler == ("whale" if algo.startswith("whale") else "fixed")


def test_whale_without_a_system_fails_with_one_line(tmp_path: Path) -> None:
    """algo=whale picks system=mobile20 by default; system=none given on the command line still stops it."""
    cfg = precheck(["algo=whale", "system=none", *TINY, "algo.rounds=1", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="system=none"):
        train(cfg)
