"""Every ``algo=`` runs out of the box: each ``configs/algo/*.yaml`` picks the groups it needs (simulated devices,
a binary task, AugFL's protocol) and trains on the bundled data with nothing else on the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from flx.config import CONFIG_DIR, group_options, precheck
from flx.run import build_datamodule, train

ALGOS = group_options("algo")
ROUNDS = 2
# cosmetic only: the progress bar's redraws would fill the test log
QUIET = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false"]
AUGFL_BASELINES = ["per_fedavg", "fedavg_ft"]
WHALE_FAMILY = ["whale", "whale_rolex", "whale_dropout", "heterofl", "fedrolex", "feddropout"]
BINARY = ["fedxl2", "fedxl1", "fedxl_localpair", "codasca"]


def _compose(out: Path, *overrides: str) -> DictConfig:
    return precheck([*overrides, *QUIET, f"paths.output_dir={out}"])


def test_every_algo_config_is_covered() -> None:
    """The parametrised run below takes its list from the folder: a new config is run without editing this file."""
    files = sorted(p.stem for p in Path(CONFIG_DIR, "algo").glob("*.yaml"))
    assert ALGOS == files and len(ALGOS) >= 42


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGOS)
def test_algo_runs_out_of_the_box(algo: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python train.py algo=<name> algo.rounds=2`` in-process: both rounds run, the last one is checkpointed, and
    the final test metrics (the final line's) are finite, accuracy a fraction."""
    metrics = train(_compose(tmp_path, f"algo={algo}", f"algo.rounds={ROUNDS}"))
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["epoch"] == ROUNDS - 1 and (tmp_path / "checkpoints" / f"round_{ROUNDS:05d}.ckpt").is_file()
    assert {"test/acc", "test/loss"} <= metrics.keys(), sorted(metrics)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert 0.0 <= metrics["test/acc"] <= 1.0
    assert f"final test_acc={metrics['test/acc']:.4f}" in capsys.readouterr().out


def _clients(cfg: DictConfig, out: Path) -> dict[str, object]:
    """The clients a run of ``cfg`` trains and evaluates, built as ``flx.run.build`` builds them (no training):
    the data split's row ids, each client's rows (``partition.json``: train, support, held-out) and the pool."""
    dm = build_datamodule(cfg)
    out.mkdir()
    dm.save(str(out))
    files = {name: json.loads((out / name).read_text()) for name in ("data_split.json", "partition.json")}
    return {**files, "x": dm.clients.x, "y": dm.clients.y, "train_clients": dm.clients.num_train_clients}


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    return all(a[k] == b[k] for k in a if k not in tensors) and all(torch.equal(a[k], b[k]) for k in tensors)


def test_augfl_baselines_hold_augfl_clients(tmp_path: Path) -> None:
    """AugFL's Table II baselines train and evaluate on AugFL's very clients by default: the same server split
    (``data.server_fraction`` = 0.2, from each config's ``algo.server_fraction``), so the same pool, the same
    few-shot partition, row for row. Without the split (``data.server_fraction=0``) the clients would differ."""
    augfl = _clients(_compose(tmp_path, "algo=augfl"), tmp_path / "augfl")
    assert augfl["data_split.json"]["server"] and augfl["train_clients"] == 40  # 50 clients, 20% held out
    for algo in AUGFL_BASELINES:
        cfg = _compose(tmp_path, f"algo={algo}")
        assert cfg.data.server_fraction == 0.2 and cfg.partition._target_.endswith("FewShot")
        assert _same(augfl, _clients(cfg, tmp_path / algo)), algo
    unsplit = _clients(_compose(tmp_path, "algo=per_fedavg", "data.server_fraction=0"), tmp_path / "unsplit")
    assert unsplit["partition.json"] != augfl["partition.json"]


@pytest.mark.parametrize("algo", WHALE_FAMILY)
def test_whale_family_selects_simulated_devices(algo: str, tmp_path: Path) -> None:
    """``algo=whale`` and the configs built on it run on ``system=mobile20`` unless the command line picks another
    system (``system=none`` is then refused when the run starts: tests/parts/test_subnetwork_run.py)."""
    assert _compose(tmp_path, f"algo={algo}").system.name == "mobile20"
    assert _compose(tmp_path, f"algo={algo}", "system=mobile20_code").system.name == "mobile20_code"
    assert "name" not in _compose(tmp_path, f"algo={algo}", "system=none").system


def test_binary_algos_select_a_binary_task(tmp_path: Path) -> None:
    """FeDXL and CODASCA need labels 0/1: by default they pick the bundled binary digits with positives on every
    client (``partition=iid``); ``data=`` and ``partition=`` on the command line still win."""
    for algo in BINARY:
        cfg = _compose(tmp_path, f"algo={algo}")
        assert (cfg.data.name, cfg.data.num_classes, cfg.partition._target_.rsplit(".", 1)[1]) == (
            "digits_binary",
            2,
            "IID",
        ), algo
    cfg = _compose(tmp_path, "algo=fedxl2", "data=breast_cancer", "partition=stratified")
    assert (cfg.data.name, cfg.partition._target_.rsplit(".", 1)[1]) == ("breast_cancer", "Stratified")


def test_default_run_is_unchanged_by_the_algorithm_picks(tmp_path: Path) -> None:
    """Moving ``data`` and ``system`` before ``algo`` in train.yaml's defaults leaves the plain run's groups as they
    were (``make train``: FedAvg on digits, Dirichlet(0.5), the MLP, no simulated devices)."""
    cfg = _compose(tmp_path)
    picks = (cfg.algo.name, cfg.data.name, cfg.partition._target_, cfg.model._target_, "name" in cfg.system)
    assert picks == ("fedavg", "digits", "flx.datamodules.partitioners.Dirichlet", "flx.models.nets.MLP", False)
