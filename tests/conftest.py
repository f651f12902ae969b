"""Shared test setup: one CPU thread (2-core machines run small models faster without oversubscription); W&B offline,
quiet and without its system-metrics sampler (a process probing the machine for each run), and a round checkpoint at
every due round (FLX_CHECKPOINT_MIN_SECONDS=0), unless a test says otherwise; the default run shared by the
crash-safety and SLURM tests, and a 2-round run shared by the resume and CSV tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
for _key, _value in {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_X_DISABLE_STATS": "true",
    "WANDB_X_DISABLE_MACHINE_INFO": "true",
    # every due round checkpointed (checkpoint.min_seconds=0): the suite's runs take ~30 ms a round and its checkpoint
    # and resume tests name the rounds whose files they expect; tests of the default floor unset it
    "FLX_CHECKPOINT_MIN_SECONDS": "0",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """``python train.py`` with the default config (what ``make train`` runs), once per session: the reference of the
    crash-safety and SLURM tests."""
    from runs import run

    out = tmp_path_factory.mktemp("default")
    proc = run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="session")
def two_rounds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default config run for 2 rounds (``round_00001.ckpt``, ``round_00002.ckpt``, ``last.ckpt``,
    ``csv/metrics.csv``), once per session: the folder the resume and CSV tests copy, damage and continue."""
    from runs import run

    out = tmp_path_factory.mktemp("two_rounds")
    proc = run(out, "algo.rounds=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out
