"""Tests for pFedFBE's data (the paper's Sec. 4.1-4.3): the Lasso and matrix-completion generators against the paper's
specification (and our documented choices where it is silent), their clients through ``partition=by_group``, and the
2-labels-per-client split."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import raises_one_line
from hydra.utils import instantiate
from torch import Tensor

from flx.config import precheck
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.partitioners import IID
from flx.datamodules.pfedfbe_data import client_truth, lasso_synthetic, matrix_completion
from flx.datamodules.protocol import data_protocol
from flx.datamodules.store import TensorData
from flx.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
LASSO = {s: lasso_synthetic(setting=s) for s in (1, 2)}  # the paper's sizes, ~0.3 s each
MATRIX = matrix_completion()


def residual(data: TensorData, split: str = "train") -> Tensor:
    """``y - <w*_g, x>`` of every row of ``split``, with ``g`` the row's generated client."""
    x, y, g = (getattr(data, f"{k}_{split}") for k in ("x", "y", "groups"))
    return y - (x.flatten(1) * data.truth[g].flatten(1)).sum(1)


def dm_of(overrides: list[str]) -> FederatedDataModule:
    """The datamodule ``train.py <overrides>`` builds (loader, partition and protocol from the composed config)."""
    cfg = precheck(overrides)
    parts = instantiate(cfg.data.loader), instantiate(cfg.partition), cfg.seed
    dm = FederatedDataModule(*parts, client_eval=cfg.client_eval, protocol=data_protocol(cfg))
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("data", [LASSO[1], LASSO[2], MATRIX], ids=["lasso1", "lasso2", "matrix"])
def test_thirty_clients_of_128_rows_each_with_their_own_test_rows(data: TensorData) -> None:
    """N = 30 clients x 128 training rows, d = 1024 parameters; the group of a row is its client, client-major."""
    clients = torch.arange(30).repeat_interleave(128)
    assert data.x_train.flatten(1).shape == (30 * 128, 1024) and data.y_train.shape == (30 * 128,)
    assert torch.equal(data.groups_train, clients) and torch.equal(data.groups_test, clients)
    assert data.x_test.shape == data.x_train.shape and data.real_targets and data.num_classes == 0
    assert data.x_train.dtype == data.y_train.dtype == data.truth.dtype == torch.float64


def test_lasso_setting_1_shares_the_printed_ground_truth() -> None:
    """Setting (I): w* = [1_992, 0_32] for every client, as printed in Sec. 4.1."""
    expected = torch.cat([torch.ones(992), torch.zeros(32)]).double()
    assert LASSO[1].truth.shape == (30, 1024) and torch.equal(LASSO[1].truth, expected.expand(30, -1))


def test_lasso_setting_2_gives_each_client_8_ones_and_2_halves_of_its_own() -> None:
    """Setting (II): w*_j = 1 on the first 8 coordinates, 0.5 on 2 distinct coordinates of {8..1023} drawn per client,
    0 elsewhere; the clients' halves differ."""
    truth = LASSO[2].truth
    assert torch.equal(truth[:, :8], torch.ones(30, 8, dtype=truth.dtype))
    rest = truth[:, 8:]
    assert ((rest == 0.5).sum(1) == 2).all() and ((rest == 0) | (rest == 0.5)).all()
    assert len({tuple(row.nonzero().flatten().tolist()) for row in rest}) > 25  # 30 draws of 2 among 1016


def test_matrix_truths_are_rank_5_diagonals_with_a_spike_per_client() -> None:
    """W*_j = diag(1, 1, 1, 1, 0.25 at one index of {4..31} drawn per client): rank 5, 32 x 32 = 1024 parameters."""
    truth = MATRIX.truth
    assert truth.shape == (30, 32, 32) and MATRIX.x_train.shape == (30 * 128, 32, 32)
    diag = torch.diagonal(truth, dim1=1, dim2=2)
    assert torch.equal(truth, torch.diag_embed(diag))
    assert torch.equal(diag[:, :4], torch.ones(30, 4, dtype=truth.dtype))
    assert ((diag[:, 4:] == 0.25).sum(1) == 1).all() and ((diag[:, 4:] == 0) | (diag[:, 4:] == 0.25)).all()
    assert (torch.linalg.matrix_rank(truth) == 5).all()
    assert len(set((diag[:, 4:] == 0.25).int().argmax(1).tolist())) > 10  # the spike's index varies per client


@pytest.mark.parametrize("data", [LASSO[1], LASSO[2], MATRIX], ids=["lasso1", "lasso2", "matrix"])
def test_targets_are_the_truths_response_plus_unit_gaussian_noise(data: TensorData) -> None:
    """y - <w*_j, x> ~ N(0, 1): over 3840 rows the sample std is 1 +- 0.012 (1 / sqrt(2 n)) and the mean 0 +- 0.016
    (1 / sqrt(n)); tolerances are 4 of those. The test rows follow the same law."""
    for split in ("train", "test"):
        r = residual(data, split)
        assert abs(r.std().item() - 1.0) < 0.05 and abs(r.mean().item()) < 0.065


def test_without_noise_the_targets_are_exactly_linear() -> None:
    """noise=0: y = <w*_j, x> to float64 round-off (b* = 0: no intercept)."""
    for data in (lasso_synthetic(setting=2, num_clients=3, noise=0.0), matrix_completion(num_clients=3, noise=0.0)):
        assert residual(data).abs().max() < 1e-10


def test_inputs_are_unit_gaussians_around_a_mean_per_client() -> None:
    """x_j = mu_j + delta, mu_j ~ N(0, I), delta ~ N(0, I): within a client the spread is 1 (std over 128 x 1024
    entries), and the client means (mu_j + the mean of 128 deltas) spread with std sqrt(1 + 1/128) over clients."""
    x = LASSO[1].x_train.view(30, 128, 1024)
    means = x.mean(1)  # (30, 1024)
    assert abs((x - means[:, None]).std().item() - 1.0) < 0.01
    assert abs(means.std().item() - (1 + 1 / 128) ** 0.5) < 0.02


def test_the_settings_share_inputs_and_noise_and_differ_only_in_the_truth() -> None:
    """Client j's inputs and noise come from its own stream: setting II differs from I exactly by <w2 - w1, x>."""
    one, two = LASSO[1], LASSO[2]
    assert torch.equal(one.x_train, two.x_train) and torch.equal(one.x_test, two.x_test)
    torch.testing.assert_close(residual(one), residual(two), rtol=0, atol=1e-9)
    assert not torch.equal(one.y_train, two.y_train)


def test_seeded_determinism_and_stable_streams() -> None:
    """The same seed gives the same tensors, another seed other ones; client j's training rows depend neither on the
    number of clients nor on the test rows per client."""
    small = {"num_clients": 4, "dim": 16, "samples": 5, "test_samples": 3}
    a, b = lasso_synthetic(setting=2, **small), lasso_synthetic(setting=2, **small)
    for key in ("x_train", "y_train", "x_test", "y_test", "truth"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key
    assert not torch.equal(a.x_train, lasso_synthetic(setting=2, **small, seed=1).x_train)
    more = lasso_synthetic(setting=2, **(small | {"num_clients": 6, "test_samples": 7}))
    assert torch.equal(more.x_train[:20], a.x_train) and torch.equal(more.truth[:4], a.truth)
    assert torch.equal(matrix_completion(num_clients=3, seed=5).y_test, matrix_completion(num_clients=3, seed=5).y_test)


def test_float32_on_request_holds_the_float64_draws_rounded() -> None:
    """data.dtype=float32 stores the same draws, rounded once; float64 is the default."""
    small = {"setting": 2, "num_clients": 2, "dim": 16, "samples": 4, "test_samples": 2}
    single, double = lasso_synthetic(**small, dtype="float32"), lasso_synthetic(**small)
    assert single.x_train.dtype == single.y_train.dtype == single.truth.dtype == torch.float32
    assert torch.equal(single.x_train, double.x_train.float()) and torch.equal(single.y_test, double.y_test.float())


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: lasso_synthetic(setting=3), "data.setting=3: allowed: 1"),
        (lambda: lasso_synthetic(setting=2, dim=9), "data.loader.halves=2: must be at most 1"),
        (lambda: lasso_synthetic(samples=0), "data.loader.samples=0: must be an integer >= 1"),
        (lambda: lasso_synthetic(dtype="float16"), "data.dtype='float16': allowed: float32, float64"),
        (lambda: matrix_completion(side=4, ones=4), "data.loader.ones=4: must be at most 3"),
        (lambda: matrix_completion(noise=-1.0), "data.loader.noise=-1.0: must be a number >= 0"),
    ],
)
def test_bad_options_stop_with_one_line(call, match: str) -> None:
    raises_one_line(call, match=match)


def test_data_config_picks_by_group_the_linear_model_and_half_mse_and_the_command_line_wins() -> None:
    """``data=lasso_synthetic`` selects partition=by_group with one client per generated client, task=half_mse and
    model=linear; command-line choices replace them; by_group elsewhere keeps its 10 clients."""
    cfg = precheck(["data=lasso_synthetic"])
    assert cfg.partition._target_.endswith("ByGroup") and cfg.partition.num_clients == 30
    assert cfg.task.scale == 0.5 and cfg.model._target_ == "flx.models.nets.Linear" and cfg.data.val_fraction == 0
    cfg = precheck(["data=matrix_completion", "partition=iid", "task=regression", "model=mlp"])
    assert cfg.partition._target_.endswith("IID") and cfg.task.scale == 1.0 and cfg.model._target_.endswith("MLP")
    assert precheck(["data=digits", "partition=by_group"]).partition.num_clients == 10


@pytest.mark.parametrize("name", ["lasso_synthetic", "matrix_completion"])
def test_by_group_gives_exactly_the_generated_clients(name: str) -> None:
    """Through the datamodule: client c holds exactly generated client c's 128 rows (every row in one client), and
    client_truth maps the truths to the clients; the per-client test rows are the group's (client_eval=test_group)."""
    setting = ["data.setting=2"] if name == "lasso_synthetic" else []
    dm = dm_of([f"data={name}", *setting, "client_eval=test_group"])
    assert dm.num_clients == 30 and dm.data.num_val == 0
    for c, ((x, _), rows) in enumerate(zip(dm.client_eval_data("test"), dm.client_train)):
        assert torch.equal(rows, torch.arange(128 * c, 128 * (c + 1)))
        assert torch.equal(x, dm.data.x_test[128 * c : 128 * (c + 1)])
    assert torch.equal(client_truth(dm.data, dm.client_train), dm.data.truth)


def test_client_truth_needs_one_truth_per_client() -> None:
    """An iid partition mixes the generated clients: fine in setting I (one truth), an error in setting II."""
    for setting, ok in ((1, True), (2, False)):
        dm = FederatedDataModule(LASSO[setting], IID(num_clients=30))
        dm.setup("fit")
        if ok:
            assert torch.equal(client_truth(dm.data, dm.client_train), LASSO[1].truth)
        else:
            raises_one_line(client_truth, dm.data, dm.client_train, match="use partition=by_group")
    with pytest.raises(ConfigError, match="has no ground truth"):
        client_truth(TensorData(torch.zeros(2, 1), torch.zeros(2), torch.zeros(1, 1), torch.zeros(1), 0), [])


def test_two_labels_gives_20_clients_with_2_labels_each_on_digits() -> None:
    """``partition=two_labels`` (pFedFBE's MNIST split; embedded digits here): 20 clients, exactly 2 labels each, each
    label held by 4 clients, every client-side training row in exactly one client (train or its 25 % test part)."""
    dm = dm_of(["data=digits", "partition=two_labels"])
    y = dm.data.y_train.numpy()
    labels = [set(y[np.concatenate([tr, te])].tolist()) for tr, te in zip(dm.split.train, dm.split.test)]
    assert dm.num_clients == 20 and all(len(held) == 2 for held in labels)
    assert sorted(np.bincount([c for held in labels for c in held]).tolist()) == [4] * 10
    rows = np.sort(np.concatenate(dm.split.train + dm.split.test))
    assert np.array_equal(rows, np.arange(len(y)))
    for tr, te in zip(dm.split.train, dm.split.test):
        assert abs(len(te) - 0.25 * (len(tr) + len(te))) <= 0.5


@pytest.mark.slow
def test_train_runs_on_the_lasso_data_in_float64(tmp_path: Path) -> None:
    """``train.py data=lasso_synthetic task=regression model=linear partition=by_group algo.rounds=2`` (at the
    paper's step size 5e-4, in float64) exits 0 and prints the test MSE."""
    args = ["data=lasso_synthetic", "task=regression", "model=linear", "partition=by_group", "algo.rounds=2"]
    args += ["algo.lr=0.0005", "trainer.precision=64-true", "client_eval=test_group", "logger=none"]
    cmd = [sys.executable, "train.py", *args, f"hydra.run.dir={tmp_path}", "trainer.enable_progress_bar=false"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final test_mse=" in proc.stdout
