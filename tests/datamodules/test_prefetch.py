"""Data loaded in a background thread while Lightning is imported (flx.datamodules.prefetch): the same run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from flx.config import precheck
from flx.datamodules import prefetch
from flx.errors import ConfigError
from flx.run import build

SMALL = ["data=synthetic", "data.loader.num_samples=600", "data.loader.input_shape=[3,8,8]", "model=cnn"]
SMALL += ["partition.num_clients=6", "algo.clients_per_round=3", "num_threads=1"]


@pytest.fixture(autouse=True)
def _spare_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests prefetch on any machine (one with a single core would otherwise load in build, as before)."""
    monkeypatch.setattr(prefetch, "spare_core", lambda: True)


def _built(out: Path, prefetched: bool, *extra: str):
    cfg = precheck([*SMALL, *extra, f"paths.output_dir={out}"])
    if prefetched:
        prefetch.start(cfg)
    return build(cfg)


def test_a_prefetched_run_is_the_loaded_run(tmp_path: Path) -> None:
    """The datamodule gets the thread's tensors, and they, the clients' rows and the initial model are bitwise those of
    a run that loads its data itself (loaders draw from their own generators; the seeding comes after the load)."""
    (dm_a, mod_a, _), (dm_b, mod_b, _) = _built(tmp_path / "a", True), _built(tmp_path / "b", False)
    for name in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        assert torch.equal(getattr(dm_a.data, name), getattr(dm_b.data, name)), name
    assert all(torch.equal(a, b) for a, b in zip(dm_a.client_train, dm_b.client_train))
    assert all(torch.equal(a, b) for a, b in zip(mod_a.net.parameters(), mod_b.net.parameters()))
    assert prefetch.take(precheck([*SMALL, f"paths.output_dir={tmp_path}"])) is None  # handed over once


def test_data_prefetched_for_another_config_is_not_used(tmp_path: Path) -> None:
    cfg = precheck([*SMALL, f"paths.output_dir={tmp_path}"])
    prefetch.start(cfg)
    other = precheck([*SMALL, "data.loader.num_samples=700", f"paths.output_dir={tmp_path}"])
    assert prefetch.take(other) is None
    prefetch.start(cfg)
    data = prefetch.take(cfg)
    assert data is not None and len(data.y_train) > 0
    assert prefetch.take(cfg) is None  # handed over once


def test_a_loading_error_is_raised_where_the_run_takes_the_data(tmp_path: Path) -> None:
    """A value the loader rejects (checked only when it runs) fails the run with the loader's own one-line error."""
    with pytest.raises(ConfigError, match="data.loader.num_classes"):
        _built(tmp_path, True, "data.loader.num_classes=1")


@pytest.mark.parametrize(
    ("cores", "env", "spare"),
    [(2, {}, True), (2, {"WORLD_SIZE": "2"}, False), (4, {"WORLD_SIZE": "2"}, True), (8, {"SLURM_NTASKS": "8"}, False)],
)
def test_the_load_runs_beside_the_imports_only_with_a_core_to_spare(
    monkeypatch: pytest.MonkeyPatch, cores: int, env: dict, spare: bool
) -> None:
    """Two usable cores per process of the run: one process on two cores prefetches, two ranks on two cores do not
    (each load would compete with the other rank's imports); without one, start() leaves the load to build."""
    monkeypatch.undo()  # the real spare_core
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert prefetch.spare_core() is spare
