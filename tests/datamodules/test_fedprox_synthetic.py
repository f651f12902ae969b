"""FedProx's Synthetic(alpha, beta) (flx.datamodules.fedprox_synthetic): the generator's distributions, checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import raises_one_line

from flx.config import precheck
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.fedprox_synthetic import draw_devices, fedprox_synthetic, input_std
from flx.datamodules.partitioners import ByGroup
from flx.datamodules.protocol import DataProtocol

SIZES = (4.0, 2.0, 50)


def devices(seed: int, alpha: float = 1.0, beta: float = 1.0, iid: bool = False, scale: str = "std"):
    return draw_devices(np.random.default_rng(seed), alpha, beta, iid, 30, 60, 10, SIZES, scale)


@pytest.mark.parametrize("iid", [False, True])
def test_shapes_devices_sizes_and_labels_of_each_devices_model(iid: bool) -> None:
    data = fedprox_synthetic(alpha=0.5, beta=0.5, iid=iid, seed=4)
    dev = devices(4, 0.5, 0.5, iid)  # the same draws, replayed
    assert data.num_classes == 10 and data.input_shape == (60,) and data.group_names[-1] == "device_29"
    sizes = np.random.default_rng(4).lognormal(4.0, 2.0, 30).astype(np.int64) + 50  # the sizes are the first draw
    assert np.array_equal(dev.sizes, sizes)
    train, test = np.bincount(data.groups_train, minlength=30), np.bincount(data.groups_test, minlength=30)
    assert np.array_equal(train, (0.9 * sizes).astype(np.int64)) and np.array_equal(train + test, sizes)
    for g, x, y in ((data.groups_train, data.x_train, data.y_train), (data.groups_test, data.x_test, data.y_test)):
        for k in range(30):
            logits = x[g == k].double().numpy() @ dev.W[k] + dev.b[k]
            top2 = np.sort(logits, axis=1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 1e-3  # float32 storage cannot flip these
            assert np.array_equal(logits.argmax(axis=1)[clear], y[g == k].numpy()[clear])
    if iid:  # one model and one input distribution for every device
        assert all(np.array_equal(dev.W[k], dev.W[0]) and np.array_equal(dev.b[k], dev.b[0]) for k in range(30))
        assert not dev.v.any()


def test_inputs_have_mean_v_k_and_covariance_diag_j_to_minus_1_2() -> None:
    data = fedprox_synthetic(size_mean=7.0, size_sigma=0.1, seed=1)  # ~1100 rows per device: 33,000 in all
    dev = draw_devices(np.random.default_rng(1), 1.0, 1.0, False, 30, 60, 10, (7.0, 0.1, 50), "std")
    x = torch.cat([data.x_train, data.x_test]).double().numpy()
    g = torch.cat([data.groups_train, data.groups_test]).numpy()
    centred = x - dev.v[g]
    var, n = input_std(60) ** 2, len(x)
    assert np.all(np.abs(centred.var(axis=0) - var) < 5 * var * np.sqrt(2 / n))
    assert np.all(np.abs(centred.mean(axis=0)) < 5 * np.sqrt(var / n))
    assert np.allclose(var, np.arange(1, 61) ** -1.2)


def test_alpha_beta_zero_is_one_model_distribution_and_alpha_spreads_the_models() -> None:
    """alpha = beta = 0: u_k = B_k = 0, so every W_k, b_k, v_k is N(0, 1) (means 0, variances 1 over many draws); the
    spread of the devices' model means is 1/610 then, alpha^2 + 1/610 with scale=std, alpha + 1/610 with variance."""
    zero = [devices(s, 0.0, 0.0) for s in range(20)]
    assert all(not d.u.any() and not d.B.any() for d in zero)
    entries = np.concatenate([np.concatenate([d.W.ravel(), d.b.ravel()]) for d in zero])  # 366,000 draws
    v = np.concatenate([d.v.ravel() for d in zero])  # 36,000
    for draws in (entries, v):
        assert abs(draws.mean()) < 5 / np.sqrt(len(draws)) and abs(draws.var() - 1) < 5 * np.sqrt(2 / len(draws))

    def spread(alpha: float, scale: str) -> float:
        means = np.concatenate(
            [
                np.concatenate([d.W.reshape(30, -1), d.b], axis=1).mean(axis=1)
                for d in (devices(s, alpha, 0.0, scale=scale) for s in range(40))
            ]
        )  # 1200 device means
        return float(means.var())

    for alpha, scale, expected in ((0.0, "std", 0.0), (0.5, "std", 0.25), (0.25, "variance", 0.25), (1.0, "std", 1.0)):
        tolerance = 5 * (expected + 1 / 610) * np.sqrt(2 / 1200)
        assert abs(spread(alpha, scale) - (expected + 1 / 610)) < tolerance, (alpha, scale)


def test_config_gives_one_client_per_device() -> None:
    cfg = precheck(["data=fedprox_synthetic", "paths.output_dir=/tmp/flx-unused"])
    assert cfg.partition._target_.endswith(".ByGroup") and cfg.partition.num_clients == 30
    assert cfg.model._target_.endswith(".LogisticRegression") and cfg.data.num_classes == 10
    data = fedprox_synthetic(seed=0)
    dm = FederatedDataModule(data, ByGroup(num_clients=30), protocol=DataProtocol(standardize=False))
    dm.setup("fit")
    for k, rows in enumerate(dm.client_train):
        assert torch.equal(rows, torch.nonzero(data.groups_train == k).ravel())


def test_seeded_and_bad_keys_are_one_line() -> None:
    a, b, c = fedprox_synthetic(seed=2), fedprox_synthetic(seed=2), fedprox_synthetic(seed=3)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
    assert not torch.equal(a.y_train[:50], c.y_train[:50])
    raises_one_line(fedprox_synthetic, alpha=-1.0, match="data.loader.alpha=-1.0")
    raises_one_line(fedprox_synthetic, scale="var", match="data.loader.scale='var'")
    raises_one_line(fedprox_synthetic, iid="yes", match="data.loader.iid='yes'")
    raises_one_line(fedprox_synthetic, train_share=1.0, match="data.loader.train_share=1.0")
