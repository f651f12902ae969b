"""``scripts/gpu_check.py`` (``make gpu-check``): its CPU analogue runs every section and each check passes; bad
arguments stop it with one line before anything runs; the metric comparison of section (a) holds its tolerance."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """One ``python scripts/gpu_check.py --device cpu`` (all sections), shared by the assertions below."""
    out = tmp_path_factory.mktemp("gpu_check")
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    rows = json.loads((out / "gpu_check.json").read_text())["rows"] if (out / "gpu_check.json").is_file() else []
    assert (out / "gpu_check.md").read_text().count("\n| ") == len(rows) + 2  # header, rule, a line per row
    return proc, rows


def _row(rows: list[dict], section: str, start: str) -> dict:
    found = [r for r in rows if r["section"] == section and r["check"].startswith(start)]
    assert len(found) == 1, (section, start, [r["check"] for r in rows])
    return found[0]


@pytest.mark.slow
def test_cpu_analogue_passes_every_check(cpu_run: tuple[subprocess.CompletedProcess, list[dict]]) -> None:
    """Exit status 0 and the table's rows, section by section: (a) each CPU config against a second CPU run, the
    same metrics to the bit; (b) bf16 finite, 16-mixed skipped on the CPU; (c) 2 gloo processes within 1e-4 of one
    process, NCCL skipped; (d) kill -9 and resume bitwise; (e) per workload the flx == plain check passed and the
    speeds measured, ResNet-18 vectorised skipped (BatchNorm); (f) central and local DP as on the CPU."""
    proc, rows = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not [
        r for r in rows if r["status"] not in ("passed", "measured") and not r["status"].startswith("skipped: ")
    ]
    for algo in gpu_check.CPU_ALGOS:
        row = _row(rows, "a", f"algo={algo}: cpu vs cpu")
        assert row["status"] == "passed" and row["value"].startswith("max diff 0.00e+00"), row
        assert row["detail"]["cpu"].keys() >= {"test/acc", "test/loss"}
    assert _row(rows, "b", "trainer.precision=bf16-mixed")["status"] == "passed"
    assert _row(rows, "b", "trainer.precision=16-mixed")["status"].startswith("skipped: Lightning has no fp16")
    gloo = _row(rows, "c", "2 processes (gloo)")
    assert gloo["status"] == "passed" and gloo["detail"]["max_abs_diff"] <= gpu_check.MODEL_TOL, gloo
    assert _row(rows, "c", "2 processes (nccl)")["status"] == "skipped: no CUDA (NCCL runs on GPUs only)"
    resume = _row(rows, "d", "kill -9 in round 5")
    assert resume["status"] == "passed" and resume["value"] == "resumed from round 4; bitwise equal"
    for name in ("cnn sequential", "cnn vectorised", "resnet18 sequential"):
        assert _row(rows, "e", f"{name}: flx == plain loop")["status"] == "passed"
        speed = _row(rows, "e", f"{name}: rounds/s")
        assert speed["status"] == "measured" and min(speed["detail"]["rounds_per_s"].values()) > 0, speed
    assert "BatchNorm2d" in _row(rows, "e", "resnet18 vectorised")["status"]
    central, local = _row(rows, "f", "privacy=central"), _row(rows, "f", "privacy=local")
    assert central["status"] == local["status"] == "passed" and central["value"].startswith("max diff 0.00e+00")
    assert len(rows) == 3 + 2 + 2 + 1 + 7 + 2
    assert f"\n{len(rows)} rows in " in proc.stdout and "FAILED" not in proc.stdout


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--sections", "a,z"], "gpu_check: error: --sections: unknown z; allowed: a, b, c, d, e, f"),
        (["--algos", "fedavg,nope"], "gpu_check: error: --algos: unknown nope; allowed: afl, apfl, augfl, "),
        (["--budget-s", "0"], "gpu_check: error: --budget-s: 0.0; allowed: > 0 seconds"),
    ],
)
def test_a_bad_argument_stops_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], line: str
) -> None:
    """Exit status 2, one line naming the option, the value and what is allowed; the --out folder is untouched."""
    (tmp_path / "kept.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main([*argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(line), err
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]


def test_a_spent_budget_skips_the_configs_of_a(tmp_path: Path) -> None:
    """Past ``--budget-s``, section (a) runs no config: each row says ``skipped: the time budget ...`` (never
    passed), the table is written and the exit status is 0 (nothing failed)."""
    assert gpu_check.main(["--sections", "a", "--device", "cpu", "--budget-s", "1e-9", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert [(r["check"], r["status"]) for r in rows] == [
        (f"algo={algo}", "skipped: the time budget (--budget-s) ran out") for algo in gpu_check.CPU_ALGOS
    ]


def test_table_cells_keep_their_columns() -> None:
    """A ``|`` in a cell (an error message) is escaped: every line of the markdown table has the header's columns."""
    rows = [gpu_check.Row("a", "algo=x", "FAILED", value="ValueError: a | b"), gpu_check.Row("b", "y", "passed")]
    lines = gpu_check.table(rows).splitlines()
    assert [line.replace("\\|", "").count("|") for line in lines] == [7] * 4 and "a \\| b" in lines[2]


def test_metric_gap_holds_the_documented_tolerance() -> None:
    """|device - cpu| <= 1e-3 x max(1, |cpu|): absolute below 1 (accuracies), relative above (losses); other keys,
    or a NaN on either side, never pass."""
    ok = gpu_check.metric_gap({"test/acc": 0.5, "test/loss": 4.0}, {"test/acc": 0.5009, "test/loss": 4.0039})
    assert ok[1] == "test/loss" and math.isclose(ok[0], 0.0039, rel_tol=1e-6) and ok[2]
    assert not gpu_check.metric_gap({"test/acc": 0.5}, {"test/acc": 0.5011})[2]
    assert not gpu_check.metric_gap({"test/loss": 4.0}, {"test/loss": 4.0041})[2]
    assert not gpu_check.metric_gap({"test/acc": 0.5}, {"test/acc": math.nan})[2]
    assert gpu_check.metric_gap({"test/acc": 0.5}, {"val/acc": 0.5})[:3:2] == (math.inf, False)
