"""``system=mobile20`` through the real entry point: FedAvg logs ``sim/round_time`` and an increasing ``sim/clock``
(also in ``curves.json``), the clock is in the checkpoint and a resumed run continues it (marked slow: Trainers)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig

from flx.config import precheck
from flx.errors import ConfigError
from flx.resume import check_ckpt
from flx.run import build, train
from flx.sampling import SAMPLE_TAG, derive_seed, uniform_cohort

pytestmark = pytest.mark.slow
QUIET = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]
SMALL = ["model=logreg", "partition.num_clients=6", "algo.clients_per_round=3", "algo.local_steps=3", *QUIET]
RUN = [*SMALL, "system=mobile20", "logger=csv", "algo.rounds=3", "checkpoint.keep_last=null"]


def compose(out: Path, *overrides: str) -> DictConfig:
    return precheck([*overrides, f"paths.output_dir={out}"])


def logged(out: Path, key: str) -> list[float]:
    return [float(r[key]) for r in csv.DictReader(open(out / "csv" / "metrics.csv")) if r.get(key)]


def clock_of(ckpt: Path) -> dict:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["flx"]["sim_clock"]


def test_fedavg_logs_the_simulated_clock_and_resume_continues_it(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    train(compose(a, *RUN))
    clock, rounds = logged(a, "sim/clock"), logged(a, "sim/round_time")
    assert len(clock) == 3 and all(t > 0 for t in rounds)
    assert clock == pytest.approx([sum(rounds[: r + 1]) for r in range(3)], rel=1e-6)  # logged as float32
    assert clock[0] < clock[1] < clock[2]

    # the same times from the simulator, over FedAvg's cohorts (uniform, seeded by (seed, round)), all full width
    _, module, _ = build(compose(tmp_path / "x", *RUN))
    system = module.spec.system
    cohorts = [uniform_cohort(6, 3, np.random.default_rng(derive_seed(0, r, SAMPLE_TAG))) for r in range(3)]
    expected = [system.round_time(r, dict.fromkeys(cohort, 1.0)) for r, cohort in enumerate(cohorts)]
    assert rounds == pytest.approx(expected, rel=1e-6)
    saved = clock_of(a / "checkpoints" / "last.ckpt")
    assert saved["elapsed"] == pytest.approx(sum(expected), rel=1e-12)
    curves = json.loads((a / "curves.json").read_text())
    assert [v for _, v in curves["sim/clock"]] == pytest.approx(clock)

    # resumed from round 2: the clock goes on from the checkpoint's, to the uninterrupted run's value (bitwise)
    train(compose(b, *RUN, f"ckpt_path={a / 'checkpoints' / 'round_00002.ckpt'}"))
    assert clock_of(b / "checkpoints" / "last.ckpt") == saved
    assert logged(b, "sim/clock") == pytest.approx(clock[2:])

    # a checkpoint with a simulated clock resumes only with the same system
    with pytest.raises(ConfigError, match="system"):
        check_ckpt(compose(tmp_path / "c", *SMALL, "algo.rounds=3"), str(a / "checkpoints" / "last.ckpt"))
