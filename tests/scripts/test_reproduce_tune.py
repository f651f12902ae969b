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
    eta = pfedfbe.eta("lasso1")
    grid = [eta * f for f in pfedfbe.TUNE_FACTORS]
    tuned = json.loads((tmp_path / "tuned.json").read_text())["lasso1"]["FedAvg"]
    assert seen[:-1] == [(lr, common.TUNE_SEED) for lr in grid]  # the search, on the tuning seed only
    assert seen[-1] == (tuned["lr"], 0)  # then the reported run, at the selected step size
    assert tuned["lr"] == min(grid, key=lambda lr: tuned["scores"][f"{lr:g}"])
    table = (tmp_path / "table.md").read_text()
    assert "step size tuned over" in table and f"| FedAvg | {tuned['lr']:g} |" in table


def test_tune_maximize_picks_the_highest_and_ranks_failures_lowest() -> None:
    def score(v: float) -> float:
        if v == 3.0:
            raise RuntimeError("no best checkpoint")
        return {1.0: 0.7, 2.0: 0.9, 4.0: math.nan, 5.0: 0.9}[v]

    best, scores = common.tune([1.0, 2.0, 3.0, 4.0, 5.0], score, maximize=True, name="lambda")
    assert best == 2.0  # the first of the tied highest
    assert scores == {1.0: 0.7, 2.0: 0.9, 3.0: -math.inf, 4.0: -math.inf, 5.0: 0.9}
    with pytest.raises(RuntimeError, match="every lambda of the grid"):
        common.tune([1.0], lambda v: math.nan, maximize=True, name="lambda")
    assert common.tune([1.0, 2.0, 3.0, 4.0, 5.0], score, maximize=True, prefer=5.0)[0] == 5.0  # tied: preferred
    assert common.tune([1.0, 2.0, 3.0, 4.0, 5.0], score, maximize=True, prefer=1.0)[0] == 2.0  # not among the best


def _argmax(grid: tuple[float, ...], scores: dict[str, float], prefer: float | None = None) -> float:
    """The selection rule written out: the highest score, ties to ``prefer`` if tied, else to the first."""
    top = max(scores[f"{x:g}"] for x in grid)
    tied = [x for x in grid if scores[f"{x:g}"] == top]
    return prefer if prefer in tied else tied[0]


def _value(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _recording(module: object, monkeypatch: pytest.MonkeyPatch, *keys: str) -> list[tuple[dict, int]]:
    """Replaces ``module.run`` by the real run that also records each run's ``keys`` overrides (numbers as floats;
    the last one of a key, as Hydra takes it) and its seed."""
    seen: list[tuple[dict, int]] = []
    real_run = module.run

    def run(args: list[str], seed: int, *rest: int) -> tuple:
        values = dict(a.split("=", 1) for a in args if a.split("=", 1)[0] in keys)
        seen.append(({k: _value(v) for k, v in values.items()}, seed))
        return real_run(args, seed, *rest)

    monkeypatch.setattr(module, "run", run)
    return seen


@pytest.mark.slow
def test_fedxl_tune_selects_on_the_validation_metric_of_its_own_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Local Pair on Table 2 (KL-OPAUC): the step size of the grid with the highest best-round val/pauc_0.3 on
    TUNE_SEED, then lambda likewise at that step size; the reported seed runs at both (two-point grids for time)."""
    import fedxl

    for name in ("BASE", "TABLE2", "TABLE3", "TUNED"):
        value = getattr(fedxl, name)
        monkeypatch.setattr(fedxl, name, {k: list(v) for k, v in value.items()} if name != "BASE" else list(value))
    monkeypatch.setattr(fedxl, "TUNE_LR", (0.01, 1.0))
    monkeypatch.setattr(fedxl, "TUNE_LAM", (1.0, 5.0))
    seen = _recording(fedxl, monkeypatch, "algo.lr", "algo.lam")
    argv = ["--tables", "table2", "--methods", "Local Pair", "--rounds", "1", "--seeds", "0", "--tune"]
    fedxl.main([*argv, "--out", str(tmp_path)])
    tuned = json.loads((tmp_path / "tuned.json").read_text())["table2"]["Local Pair"]
    assert [s for _, s in seen[:-1]] == [common.TUNE_SEED] * 4  # the search, on the tuning seed only
    assert [v["algo.lr"] for v, _ in seen[:2]] == [0.01, 1.0]
    assert tuned["lr"] == _argmax((0.01, 1.0), tuned["scores"])
    assert seen[2:4] == [({"algo.lr": tuned["lr"], "algo.lam": lam}, common.TUNE_SEED) for lam in (1.0, 5.0)]
    assert tuned["lam"] == _argmax((1.0, 5.0), tuned["lam_scores"])
    assert seen[-1] == ({"algo.lr": tuned["lr"], "algo.lam": tuned["lam"]}, 0)  # the reported run
    table = (tmp_path / "table2.md").read_text()
    assert f"step size tuned over {[0.01, 1.0]}" in table and "val/pauc_0.3" in table.splitlines()[0]
    assert f"| Local Pair | {tuned['lr']:g} | {tuned['lam']:g} |" in table


def test_drfa_late_score_is_the_mean_of_the_last_quarter_of_the_rounds() -> None:
    import drfa

    curve = [(1, 0.5), (2, 0.6), (3, 0.7), (4, 0.8), (5, 0.9), (6, 1.0), (7, 0.2), (8, 0.4)]
    assert drfa.late(curve, 8) == pytest.approx((0.2 + 0.4) / 2)  # rounds 7 and 8: 8 // 4 = 2 of them
    assert drfa.late(curve[:3], 3) == 0.7 and drfa.late(curve[:1], 1) == 0.5  # at least the last round
    assert math.isnan(drfa.late([], 8))


@pytest.mark.slow
def test_drfa_tune_takes_eta_from_fedavg_then_q_on_its_own_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q-FedAvg alone: eta is tuned on FedAvg (the paper's "optimized for the FedAvg and used for all"), then q at that
    eta, both on TUNE_SEED with validation rows held out, each the argmax of the late worst-client validation
    accuracy; the reported run (no held-out rows) uses both (two-point grids for time)."""
    import drfa

    monkeypatch.setattr(drfa, "BASE", list(drfa.BASE))
    monkeypatch.setattr(drfa, "TUNED", {})
    monkeypatch.setattr(drfa, "TUNE_LR", (0.01, 1.0))
    monkeypatch.setattr(drfa, "TUNE_Q", (0.2, 5.0))
    seen = _recording(drfa, monkeypatch, "algo", "algo.lr", "algo.q", "data.val_fraction")
    drfa.main(["--methods", "q-FedAvg", "--rounds", "1", "--seeds", "0", "--tune", "--out", str(tmp_path)])
    tuned = json.loads((tmp_path / "tuned.json").read_text())
    lr, q = tuned["FedAvg"]["lr"], tuned["q-FedAvg"]["q"]
    assert [s for _, s in seen[:-1]] == [common.TUNE_SEED] * 4  # the search, on the tuning seed only
    fedavg = [{"algo": "fedavg", "algo.lr": x, "data.val_fraction": 0.2} for x in (0.01, 1.0)]
    assert [v for v, _ in seen[:2]] == fedavg
    assert lr == _argmax((0.01, 1.0), tuned["FedAvg"]["lr_scores"], drfa.PAPER["lr"])
    assert [v for v, _ in seen[2:4]] == [
        {"algo": "qfedavg", "algo.lr": lr, "algo.q": x, "data.val_fraction": 0.2} for x in (0.2, 5.0)
    ]
    assert q == _argmax((0.2, 5.0), tuned["q-FedAvg"]["q_scores"], drfa.PAPER["q"])
    assert seen[-1] == ({"algo": "qfedavg", "algo.lr": lr, "algo.q": q}, 0)  # the reported run ...
    # ... with every training row in a client: the experiment's data.val_fraction, not overridden
    assert drfa.BASE[0] == "experiment=drfa_digits" and drfa.PROTOCOL.data.val_fraction == 0
    table = (tmp_path / "table.md").read_text()
    assert f"tuned on seed {common.TUNE_SEED}" in table and f"| q-FedAvg | 10 | {lr:g} | q = {q:g} |" in table


def _square_or_fail(x: int) -> int:
    if x < 0:
        raise ValueError(f"negative: {x}")
    return x * x


@pytest.mark.parametrize("jobs", [1, 2])
def test_executor_returns_each_result_in_order_and_raises_a_failed_runs_error(jobs: int) -> None:
    """``--jobs``: the inline runner (1) and the worker processes (2) give the same results, and a failed run's
    exception comes out of its ``result()`` (where ``tune`` ranks it last), not out of ``submit``."""
    pool = common.executor(jobs)
    futures = [pool.submit(_square_or_fail, x) for x in (3, -1, 4)]
    assert futures[0].result() == 9 and futures[2].result() == 16
    with pytest.raises(ValueError, match="negative: -1"):
        futures[1].result()
    best, scores = common.tune([3.0, -1.0, 4.0], lambda x: pool.submit(_square_or_fail, int(x)).result())
    assert (best, scores) == (3.0, {3.0: 9.0, -1.0: math.inf, 4.0: 16.0})
    pool.shutdown()
