"""Binary imbalanced datasets: label mapping, the exact imbalance ratio, flips per class, clean test split."""

from __future__ import annotations

import functools

import pytest
import torch

from flx.datamodules.binary import binarize
from flx.datamodules.store import TensorData
from flx.errors import ConfigError


def _toy(n_per_class: int = 100, classes: int = 4) -> TensorData:
    y = torch.arange(classes).repeat_interleave(n_per_class)
    x = torch.randn(len(y), 3, generator=torch.Generator().manual_seed(0))
    return TensorData(x, y, x[:40].clone(), y[:40].clone(), classes, "toy")


def test_positive_classes_map_to_one_and_test_is_untouched() -> None:
    data = binarize(_toy, positive=[1, 3])
    expected = ((_toy().y_train == 1) | (_toy().y_train == 3)).long()
    assert data.num_classes == 2 and data.name == "toy-binary"
    assert torch.equal(data.y_train, expected) and torch.equal(data.x_train, _toy().x_train)
    assert torch.equal(data.y_test, ((_toy().y_test == 1) | (_toy().y_test == 3)).long())


def test_default_positives_are_first_half() -> None:
    assert torch.equal(binarize(_toy).y_train, (_toy().y_train < 2).long())


@pytest.mark.parametrize("imratio", [0.02, 0.1, 1 / 6, 0.3])
def test_imratio_is_exact_and_keeps_all_negatives(imratio: float) -> None:
    """200 negatives stay; positives kept = round(imratio / (1 - imratio) * 200), a subset of the originals."""
    data = binarize(_toy, imratio=imratio, seed=3)
    n_pos = int(data.y_train.sum())
    assert n_pos == round(imratio / (1 - imratio) * 200) and int((data.y_train == 0).sum()) == 200
    assert abs(n_pos / len(data.y_train) - imratio) < 1 / len(data.y_train)
    original = {tuple(r.tolist()) for r in _toy().x_train}
    assert all(tuple(r.tolist()) in original for r in data.x_train)  # rows kept, not made up


def test_flip_rate_flips_that_fraction_of_each_class_once() -> None:
    clean, noisy = binarize(_toy, imratio=0.2, seed=1), binarize(_toy, imratio=0.2, flip_rate=0.2, seed=1)
    assert torch.equal(clean.x_train, noisy.x_train)  # same subsample: flips come after it
    for c in (0, 1):
        members = clean.y_train == c
        assert int((noisy.y_train[members] != c).sum()) == round(0.2 * int(members.sum()))
    assert torch.equal(noisy.y_test, clean.y_test)


def test_seeded() -> None:
    a, b = binarize(_toy, imratio=0.1, seed=5), binarize(_toy, imratio=0.1, seed=5)
    c = binarize(_toy, imratio=0.1, seed=6)
    assert torch.equal(a.x_train, b.x_train) and not torch.equal(a.x_train, c.x_train)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"positive": [0, 1, 2, 3]}, "data.loader.positive"),
        ({"positive": [7]}, "data.loader.positive"),
        ({"imratio": 1.0}, "data.loader.imratio"),
        ({"imratio": 0.9}, "data.loader.imratio"),  # needs 1800 positives, has 200
        ({"flip_rate": 0.5}, "data.loader.flip_rate"),
    ],
)
def test_bad_options(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        binarize(functools.partial(_toy), **kwargs)
