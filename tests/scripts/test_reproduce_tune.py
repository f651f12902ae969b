"""``--tune`` of the reproduction scripts: the step-size search (``scripts/reproduce/common.py``) and its use by
``scripts/reproduce/pfedfbe.py`` (a one-round run of one baseline, in-process)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "reproduce"))

import common  # noqa: E402


def test_tune_picks_the_lowest_finite_score_and_ranks_failures_last() -> None:
    def score(lr: float) -> float:
        if lr == 4.0:
            raise RuntimeError("diverged in round 3")
        return {0.5: 2.0, 1.0: 1.5, 2.0: math.nan, 3.0: 1.5}[lr]

    best, scores = common.tune([0.5, 1.0, 2.0, 3.0, 4.0], score)
    assert best == 1.0  # the first of the tied lowest
    assert scores == {0.5: 2.0, 1.0: 1.5, 2.0: math.inf, 3.0: 1.5, 4.0: math.inf}
    with pytest.raises(RuntimeError, match="every step size of the grid"):
        common.tune([1.0, 2.0], lambda lr: math.inf)


@pytest.mark.slow
def test_pfedfbe_tune_selects_on_its_own_seed_and_reports_the_step_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pfedfbe

    seen: list[tuple[float, int]] = []
    real_run = pfedfbe.run

    def run(args: list[str], seed: int, rounds: int) -> tuple[dict, dict]:
        lr = float(next(a for a in args if a.startswith("algo.lr=")).split("=")[1])
        seen.append((lr, seed))
        return real_run(args, seed, rounds)

    monkeypatch.setattr(pfedfbe, "run", run)
    monkeypatch.setattr(pfedfbe, "BASE", list(pfedfbe.BASE))
    argv = ["--settings", "lasso1", "--methods", "FedAvg", "--rounds", "1", "--seeds", "0", "--tune"]
    pfedfbe.main([*argv, "--out", str(tmp_path)])
    eta = pfedfbe.SETTINGS["lasso1"][3]
    grid = [eta * f for f in pfedfbe.TUNE_FACTORS]
    tuned = json.loads((tmp_path / "tuned.json").read_text())["lasso1"]["FedAvg"]
    assert seen[:-1] == [(lr, common.TUNE_SEED) for lr in grid]  # the search, on the tuning seed only
    assert seen[-1] == (tuned["lr"], 0)  # then the reported run, at the selected step size
    assert tuned["lr"] == min(grid, key=lambda lr: tuned["scores"][f"{lr:g}"])
    table = (tmp_path / "table.md").read_text()
    assert "step size tuned over" in table and f"| FedAvg | {tuned['lr']:g} |" in table
