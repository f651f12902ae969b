"""``scripts/bench/run.py``: a bad argument stops the bench with one line before any measurement runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # run.py imports harness, process, workloads as the bench runs it
_spec = importlib.util.spec_from_file_location("bench_run", ROOT / "scripts" / "bench" / "run.py")
bench_run = sys.modules["bench_run"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_run)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--sections", "rounds,speed"], "bench: --sections: unknown speed; allowed: rounds, process, scaleout"),
        (["--sections", "rounds"], "bench: --out: {tmp} is a folder; give the JSON file to write ({tmp}/bench.json)"),
    ],
)
def test_a_bad_argument_stops_before_the_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], line: str
) -> None:
    """An unknown section, or an ``--out`` that is a folder (found once, after ~10 minutes of runs, when the results
    were written), exits with its line before the first run; the folder is left as it was."""
    (tmp_path / "kept.json").write_text("{}")
    monkeypatch.setattr(bench_run, "bench", lambda *a: pytest.fail("a measurement ran"))
    with pytest.raises(SystemExit) as exit_:
        bench_run.main([*argv, "--out", str(tmp_path)])
    assert str(exit_.value).startswith(line.format(tmp=tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]
