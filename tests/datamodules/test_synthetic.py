"""Tests for the synthetic teacher dataset: determinism, shapes and dtypes, learnable labels, config errors."""

from __future__ import annotations

import pytest
import torch

from flx.datamodules.store import TensorData
from flx.datamodules.synthetic import synthetic
from flx.errors import ConfigError


def small(seed: int = 0, **kw: object) -> TensorData:
    args = {"num_samples": 2000, "input_shape": (2, 4, 4), "num_classes": 5, "test_samples": 300, "seed": seed}
    return synthetic(**{**args, **kw})


def test_deterministic_in_seed() -> None:
    a, b, c = small(0), small(0), small(1)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.x_train, c.x_train)
    assert not torch.equal(a.y_train, c.y_train)


def test_shapes_and_dtypes() -> None:
    d = small()
    assert d.x_train.shape == (2000, 2, 4, 4) and d.x_test.shape == (300, 2, 4, 4)
    assert d.y_train.shape == (2000,) and d.y_test.shape == (300,)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert d.num_classes == 5 and d.input_shape == (2, 4, 4) and d.name == "synthetic"
    assert int(d.y_train.min()) >= 0 and int(d.y_train.max()) < 5
    assert len(d.y_train.unique()) == 5  # every class occurs
    assert abs(float(d.x_train.mean())) < 0.05 and abs(float(d.x_train.std()) - 1) < 0.05


def test_tabular_shape() -> None:
    d = synthetic(num_samples=50, input_shape=[7], num_classes=3, test_samples=10)
    assert d.x_train.shape == (50, 7) and d.input_shape == (7,)


def test_labels_come_from_a_linear_teacher() -> None:
    """A least-squares linear probe on one-hot targets, fitted on train, beats chance (20 %) by a wide margin."""
    d = small()
    x_train, x_test = d.x_train.flatten(1).double(), d.x_test.flatten(1).double()
    ones = torch.ones(len(x_train), 1, dtype=torch.float64)
    targets = torch.nn.functional.one_hot(d.y_train, d.num_classes).double()
    w = torch.linalg.lstsq(torch.cat([x_train, ones], 1), targets).solution
    pred = (torch.cat([x_test, torch.ones(len(x_test), 1, dtype=torch.float64)], 1) @ w).argmax(1)
    assert float((pred == d.y_test).double().mean()) > 0.6


def test_shuffled_labels_are_not_learnable() -> None:
    """Control for the probe test: the same probe on permuted labels stays near chance."""
    d = small()
    y = d.y_train[torch.randperm(len(d.y_train), generator=torch.Generator().manual_seed(0))]
    x = torch.cat([d.x_train.flatten(1).double(), torch.ones(len(y), 1, dtype=torch.float64)], 1)
    w = torch.linalg.lstsq(x, torch.nn.functional.one_hot(y, d.num_classes).double()).solution
    xt = torch.cat([d.x_test.flatten(1).double(), torch.ones(len(d.y_test), 1, dtype=torch.float64)], 1)
    assert float(((xt @ w).argmax(1) == d.y_test).double().mean()) < 0.35


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"num_samples": 0}, "num_samples"),
        ({"num_classes": 1}, "num_classes"),
        ({"input_shape": (3, 0)}, "input_shape"),
    ],
)
def test_bad_values(kw: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"data.loader.{key}"):
        synthetic(**kw)
