"""``flx-train`` (``flx.cli``): ``python train.py``'s command line from any folder, or one line where it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runs import QUIET, flx_lines

from flx import cli

ROOT = Path(__file__).resolve().parents[1]
ENTRY = [sys.executable, "-c", "from flx.cli import main; main()"]  # what the console script runs


def test_console_script_is_declared() -> None:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"] == {"flx-train": "flx.cli:main"}
    assert Path(cli.checkout_root()).samefile(ROOT) and cli.missing(cli.checkout_root()) is None


def test_without_a_checkout_stops_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An installed package with no checkout around it (not an editable install): exit 2, one line naming the folder
    and what it lacks, nothing run."""
    monkeypatch.setattr(cli, "checkout_root", lambda: str(tmp_path))
    (tmp_path / "configs").mkdir()
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("flx: error: flx-train runs the train.py and configs/")
    assert f"{tmp_path} (the checkout of an editable install) has no train.py: install flx" in err


@pytest.mark.slow
def test_runs_train_py_from_another_folder(tmp_path: Path) -> None:
    """From a folder that is not the checkout: the run finds the checkout's configs and ends with the final line;
    bad input keeps train.py's one line and exit status 2. Neither writes into the working folder."""
    cwd, run = tmp_path / "elsewhere", tmp_path / "run"
    cwd.mkdir()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT / "src")}  # this checkout's flx
    done = subprocess.run(
        [*ENTRY, "debug=default", *QUIET, f"hydra.run.dir={run}"], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and "final test_acc=" in done.stdout, done.stderr[-3000:]
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == 1  # debug=default: 2 rounds
    bad = subprocess.run([*ENTRY, "algo=nope"], cwd=cwd, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and len(flx_lines(bad.stderr)) == 1 and "algo" in flx_lines(bad.stderr)[0], bad.stderr
    assert "nope" in flx_lines(bad.stderr)[0] and "allowed: " in flx_lines(bad.stderr)[0]
    assert list(cwd.iterdir()) == []
