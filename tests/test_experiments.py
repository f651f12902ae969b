"""Every ``configs/experiment/*.yaml`` runs: two rounds of each through :func:`flx.run.train` (the experiment's own
values but ``algo.rounds`` and the run folder; one thread, no progress bar), finite, with a training loss that moved;
an experiment whose dataset is not bundled (MNIST, CIFAR) stops before training with the one-line "not found"
message. And a data config that an algorithm's defaults cannot train names the experiment to run instead
(``data.experiments``, :func:`flx.checks.check_experiments`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from runs import flx_lines, run

from flx.config import CONFIG_DIR, group_options, precheck
from flx.errors import ConfigError

EXPERIMENTS = group_options("experiment")
# experiments on datasets that are not bundled: -> the line's start with paths.data_dir=<an empty folder>
NOT_BUNDLED = {
    "augfl_cifar10": "data=cifar10: CIFAR-10 not found at",
    "augfl_cifar100": "data=cifar100: CIFAR-100 not found at",
    "whale_cifar10": "data=cifar10: CIFAR-10 not found at",
    "whale_mnist": "data=mnist: MNIST not found at",
}
BUNDLED = [name for name in EXPERIMENTS if name not in NOT_BUNDLED]
# the run's own settings, none of the experiment's: one thread (a shared CPU), no progress bar
QUIET = ["num_threads=1", "trainer.enable_progress_bar=false", "callbacks.progress_bar=null"]
_RUNS: dict[str, tuple[dict, dict]] = {}


def two_rounds(name: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """``experiment=<name>`` for 2 rounds (run once per module): its final metrics and ``curves.json``."""
    if name not in _RUNS:
        from flx.run import train

        out = tmp_path_factory.mktemp(name)
        final = train(precheck([f"experiment={name}", "algo.rounds=2", f"paths.output_dir={out}", *QUIET]))
        _RUNS[name] = final, json.loads((out / "curves.json").read_text())
    return _RUNS[name]


def test_every_experiment_is_bundled_or_declared_missing() -> None:
    assert set(NOT_BUNDLED) <= set(EXPERIMENTS)
    assert {"pfedfbe_lasso1", "fedxl2_digits", "fedxl1_digits", "drfa_digits", "augfl_digits", "whale_digits"} <= set(
        BUNDLED
    )
    for name in EXPERIMENTS:  # deltas only, on the _global_ package, as configs/experiment/example.yaml
        assert Path(CONFIG_DIR, "experiment", f"{name}.yaml").read_text().startswith("# @package _global_\n"), name


@pytest.mark.slow
@pytest.mark.parametrize("name", BUNDLED)
def test_experiment_trains_two_rounds(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    final, curves = two_rounds(name, tmp_path_factory)
    assert final and all(math.isfinite(v) for v in final.values()), final
    loss = curves["train/loss"]
    assert [r for r, _ in loss] == [1, 2]
    assert all(math.isfinite(v) for _, v in loss) and loss[0][1] != loss[1][1], loss


@pytest.mark.slow
def test_pfedfbe_lasso1_beats_the_zero_model_in_two_rounds(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Closed check: the model starts at w = 0 (model.init=zeros), whose test MSE is the mean of y^2 over the test
    rows (~2e3: y = <w*, x> + noise with 992 ones in w*); two rounds at the paper's eta and lambda lower it. With the
    pFedFBE defaults (eta 5e-3, lambda 200) the same data diverge in round 2."""
    from hydra.utils import instantiate

    final, _ = two_rounds("pfedfbe_lasso1", tmp_path_factory)
    cfg = precheck(["experiment=pfedfbe_lasso1", "paths.output_dir=/tmp/flx-unused"])
    data = instantiate(cfg.data.loader)()
    zero_mse = float(torch.mean(data.y_test.double() ** 2))
    assert zero_mse > 1500
    assert final["test/mse"] < 0.95 * zero_mse, (final["test/mse"], zero_mse)  # 1696 against 1883


@pytest.mark.parametrize("name", sorted(NOT_BUNDLED))
def test_experiment_on_missing_files_stops_with_one_line(name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        precheck([f"experiment={name}", f"paths.data_dir={tmp_path}", f"paths.output_dir={tmp_path / 'run'}"])
    line = str(err.value)
    assert "\n" not in line and line.startswith(NOT_BUNDLED[name]), line
    assert line.endswith("downloads are disabled, place the files there or set paths.data_dir)"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data", "experiment"), [("lasso_synthetic", "pfedfbe_lasso1"), ("matrix_completion", "pfedfbe_matrix")]
)
def test_pfedfbe_defaults_on_its_synthetic_data_name_the_experiment(data: str, experiment: str, tmp_path: Path) -> None:
    proc = run(tmp_path / "run", "algo=pfedfbe", f"data={data}")
    assert proc.returncode == 2, proc.stderr
    assert flx_lines(proc.stderr) == [
        f"flx: error: data={data}: algo=pfedfbe at its defaults (algo.lr=0.005, algo.lam=200.0) does not train "
        f"these data (it diverges); run the paper's setting, python train.py experiment={experiment}, or set "
        "algo.lr and algo.lam"
    ]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_the_hint_is_off_once_the_user_chose_a_step_size(tmp_path: Path) -> None:
    out = f"paths.output_dir={tmp_path}"
    for chosen in (["algo.lr=5e-4", "algo.lam=2000"], ["algo.lam=2000"], ["experiment=pfedfbe_lasso1"]):
        assert precheck(["algo=pfedfbe", "data=lasso_synthetic", *chosen, out]).data.name == "lasso_synthetic"
    assert precheck(["algo=fedmid", "data=lasso_synthetic", out]).algo.name == "fedmid"  # no hint for fedmid
    with pytest.raises(ConfigError, match=r"run the paper's setting, python train.py experiment=pfedfbe_lasso1"):
        precheck(["algo=pfedfbe", "data=lasso_synthetic", "algo.rounds=3", out])  # not a key of the hint
    assert os.listdir(tmp_path) == []
