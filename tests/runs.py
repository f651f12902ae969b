"""Runs of the real entry point (``train.py`` in a subprocess) shared by the crash-safety and SLURM tests."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false"]
# what a subprocess needs to find the test-only parts (helpers.SleepPerRound, ...) and to stay quiet
ENV = {"PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")])}


def _command(out: Path, args: tuple[str, ...], env: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "train.py", *QUIET, *args, f"hydra.run.dir={out}"]
    full_env = {**os.environ, **ENV, **(env or {})}
    # a test process that used W&B itself holds a W&B service (its address in WANDB_SERVICE): a run of train.py is a
    # program of its own, as a user starts it, not a client of the test's service (whose streams outlive a killed run)
    full_env.pop("WANDB_SERVICE", None)
    return cmd, full_env


def run(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python train.py <args>`` with the default config otherwise, writing to ``out``."""
    cmd, full_env = _command(out, args, env)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=full_env)


def start(out: Path, *args: str, stderr: int | None = subprocess.DEVNULL) -> subprocess.Popen:
    """:func:`run` started in the background (its stdout discarded; its stderr as ``stderr`` says, text)."""
    cmd, full_env = _command(out, args, None)
    return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_model(a: dict, b: dict) -> None:
    """Bitwise equal global models."""
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k


def trained_rounds(out: Path) -> list[int]:
    """The round of each training row (one with ``train/loss``) of ``<out>/csv/metrics.csv``, in file order: a resumed
    run's rows continue its rounds, and a round replayed after a resume appears twice."""
    with open(out / "csv" / "metrics.csv", newline="") as f:
        return [int(float(row["fl/round"])) for row in csv.DictReader(f) if row["train/loss"]]


def flx_lines(stderr: str) -> list[str]:
    """flx's own stderr lines (Lightning's banner, e.g. 'GPU available: False', may precede them)."""
    return [line for line in stderr.splitlines() if line.startswith("flx: ")]


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")
