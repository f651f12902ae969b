"""The CIFAR ResNets of CRD (:class:`flx.models.resnet_cifar.ResNetCIFAR`): parameter counts as formulas and as the
1.23M / 7.43M of the definition in AugFL's released code, any input size and channel count, the authors' AvgPool2d(8) on
32x32 inputs, one-line errors for bad options, and the ``model=resnet8x4`` / ``resnet32x4`` configs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import raises_one_line

from flx.config import precheck
from flx.models.build import net_from_config
from flx.models.resnet_cifar import ResNetCIFAR

SMALL = (4, 8, 8, 16)  # widths of a cheap net with the same structure


def _n_params(net: torch.nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


def _formula(c: int, k: int, depth: int, w: tuple[int, ...]) -> int:
    """Stem conv + BN; per stage the first block (two 3x3 convs, the 1x1 shortcut, 3 BNs) and ``n - 1`` plain blocks
    (two 3x3 convs, 2 BNs); the head. Every stage changes the width here, so every first block has a shortcut."""
    n = (depth - 2) // 6
    stem = 9 * c * w[0] + 2 * w[0]
    stages = sum(10 * a * b + 9 * b * b + 6 * b + (n - 1) * (18 * b * b + 4 * b) for a, b in zip(w[:-1], w[1:]))
    return stem + stages + w[-1] * k + k


@pytest.mark.parametrize(("depth", "digest"), [(8, 1.23e6), (32, 7.43e6)])
def test_configs_give_the_digest_parameter_counts(depth: int, digest: float) -> None:
    """``model=resnet8x4`` / ``resnet32x4`` with 100 classes on CIFAR images: the formula, and within 1% of the
    released code's counts (1,233,540 and 7,433,860)."""
    cfg = precheck([f"model=resnet{depth}x4", "data=digits"])
    assert cfg.model.depth == depth and list(cfg.model.widths) == [32, 64, 128, 256]
    net = net_from_config(cfg.model, (3, 32, 32), 100)
    count = _n_params(net)
    assert count == _formula(3, 100, depth, (32, 64, 128, 256))
    assert abs(count - digest) / digest < 0.01, count
    assert net.feat_dim == 256


@pytest.mark.parametrize(("c", "k", "depth"), [(1, 7, 14), (3, 2, 8), (5, 10, 20)])
def test_parameter_count_matches_formula(c: int, k: int, depth: int) -> None:
    net = ResNetCIFAR(input_shape=(c, 8, 8), num_classes=k, depth=depth, widths=SMALL)
    assert _n_params(net) == _formula(c, k, depth, SMALL)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in net.modules()) == depth - 1 + 3  # + three 1x1 shortcuts


@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32), (3, 64, 64), (4, 5, 9)])
def test_any_input_size_and_channel_count(shape: tuple[int, int, int]) -> None:
    net = ResNetCIFAR(input_shape=shape, num_classes=3, widths=SMALL)
    x = torch.randn(2, *shape)
    assert net.features(x).shape == (2, 16) and net(x).shape == (2, 3)


def test_adaptive_pool_is_the_authors_avgpool8_on_32x32() -> None:
    """The trunk maps 32x32 to 8x8 (two stride-2 stages), where AdaptiveAvgPool2d(1) == AvgPool2d(8)."""
    torch.manual_seed(0)
    net = ResNetCIFAR(input_shape=(3, 32, 32), num_classes=10, widths=SMALL).eval()
    x = torch.randn(3, 3, 32, 32)
    trunk = net.layer3(net.layer2(net.layer1(net.stem(x))))
    assert trunk.shape == (3, 16, 8, 8)
    torch.testing.assert_close(net.features(x), F.avg_pool2d(trunk, 8).flatten(1))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"depth": 9}, "model.depth=9: expected 6n+2"),
        ({"depth": 2}, "model.depth=2: expected 6n+2"),
        ({"depth": True}, "model.depth=True: expected 6n+2"),
        ({"widths": (32, 64, 128)}, "model.widths=[32, 64, 128]: expected 4 widths"),
        ({"widths": (32, 0, 128, 256)}, "model.widths=(32, 0, 128, 256): expected a non-empty sequence"),
        ({"input_shape": (30,)}, "model=resnet_cifar needs image inputs"),
        ({"num_classes": 0}, "num_classes=0: expected an int >= 1"),
    ],
)
def test_bad_options_are_one_line_errors(options: dict, match: str) -> None:
    kwargs = {"input_shape": (3, 32, 32), "num_classes": 10, **options}
    raises_one_line(ResNetCIFAR, **kwargs, match=match)
