"""Shared test setup: one CPU thread (2-core machines run small models faster without oversubscription)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """``python train.py`` with the default config (what ``make train`` runs), once per session: the reference of the
    crash-safety and SLURM tests."""
    from runs import run

    out = tmp_path_factory.mktemp("default")
    proc = run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc
