"""``scripts/reproduce/baselines_claims.py --quick --out DIR`` (in-process): the page's numbers are those of its runs.

FedNova's quadratic example: the runs' last iterates equal the closed-form fixed points (computed here again from
the targets and tau), FedAvg's is O(1) from the optimum and FedNova's much closer, and the table row prints those
distances. FedProx's Synthetic(1,1), both budgets: every table cell is the stored record's value (the training-loss
curve's last value, its max over the last half, its jumps, its largest rise, the last test accuracy), each run's
command in the page.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "reproduce"))

import baselines_claims as bc  # noqa: E402
from common import config_key, mean_std  # noqa: E402


def _weighted(weights: list[float]) -> list[float]:
    return [sum(w * e[d] for w, e in zip(weights, bc.TARGETS)) / sum(weights) for d in range(4)]


def _dist(a: list[float], b: list[float]) -> float:
    return math.sqrt(sum((u - v) ** 2 for u, v in zip(a, b)))


@pytest.mark.slow
def test_quick_page_holds_the_runs_numbers(tmp_path: Path) -> None:
    bc.main(["--quick", "--out", str(tmp_path)])
    page = (tmp_path / "claims.md").read_text()
    assert "python scripts/reproduce/baselines_claims.py --quick" in page
    assert (tmp_path / "claims_quadratic.png").stat().st_size > 0 and (tmp_path / "claims_synthetic.png").exists()

    # (a) the quadratic limits: closed forms by hand, the runs at them, the table row printing them
    study = json.loads((tmp_path / "claims_quadratic.json").read_text())
    (eta_key, row), eta = next(iter(study.items())), bc.QUICK_ETAS[0]
    done = [1 - (1 - eta) ** t for t in bc.TAU]
    avg, nova = _weighted(done), _weighted([d / t for d, t in zip(done, bc.TAU)])
    optimum, surrogate = _weighted([1.0, 1.0, 1.0]), _weighted([float(t) for t in bc.TAU])
    assert max(abs(a - b) for a, b in zip(row["final"]["avg"], avg)) < 1e-10
    assert max(abs(a - b) for a, b in zip(row["final"]["nova"], nova)) < 1e-10
    d_avg, d_nova = _dist(row["final"]["avg"], optimum), _dist(row["final"]["nova"], optimum)
    assert d_nova < 0.3 * d_avg and _dist(row["final"]["avg"], surrogate) < 0.3 * d_avg
    cells = [eta_key, str(row["rounds"]), f"{d_avg:.3e}", f"{_dist(row['final']['avg'], surrogate):.3e}"]
    cells += [f"{_dist(avg, optimum):.3e}", f"{d_nova:.3e}", f"{_dist(nova, optimum):.3e}", f"{d_nova / eta:.3e}"]
    assert "| " + " | ".join(cells) + " |" in page

    # (b) every Synthetic(1,1) row of both budgets: the stored record's numbers (5 rounds scaled, 2 heavy)
    for study, (unit, _, methods) in bc.STUDIES.items():
        rounds = bc.study_rounds(study, 5)
        assert f"### K = {unit} ({unit} to {10 * unit} local steps), {rounds} rounds" in page
        for name in methods:
            overrides = bc.synth_overrides(study, name, 0, 5)
            assert f"algo.local_steps={unit if 'random' in name else 10 * unit}" in overrides
            record = json.loads((tmp_path / "claims_runs" / f"{config_key(overrides)}.json").read_text())
            curve = record["curves"]["train/objective"]
            assert [r for r, _ in curve] == list(range(1, rounds + 1))
            losses = [v for _, v in curve]
            steps = list(zip(losses, losses[1:]))
            jumps = sum(1 for a, b in steps if b > 1.05 * a)
            rise = max([0.0, *((b - a) / a for a, b in steps)])
            cells = [name, mean_std([losses[-1]]), mean_std([max(losses[rounds // 2 :])])]
            cells += [mean_std([float(jumps)], digits=1), mean_std([rise])]
            cells.append(mean_std([record["curves"]["test/acc"][-1][1]]))
            assert "| " + " | ".join(cells) + " | `train.py " + " ".join(overrides[:2]) in page, (study, name)
