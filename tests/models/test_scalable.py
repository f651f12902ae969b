"""The width-scalable nets (:mod:`flx.models.scalable`): masking the full net realises the sub-model exactly (outputs
and gradients equal those of an independently built small net holding the extracted slices), the Scaler, static
BatchNorm and its rebuilt evaluation statistics, parameter counts, configs and one-line errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import raises_one_line
from torch import Tensor, nn

from flx.config import precheck
from flx.models.build import net_from_config
from flx.models.scalable import (
    ScalableCNN,
    ScalableResNet18,
    Scaler,
    StaticBatchNorm2d,
    bn_stats,
    clear_bn_stats,
    rebuild_bn_stats,
    set_width,
)
from flx.models.width import apply_masks, extract_state, local_entries, mask_grads, masks_from_indices, width_indices

f64 = torch.float64
RATIOS = (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16)
# (class, per-sample shape, small full widths): 16 channels so that 1/16 keeps one; the ResNet ends at 2x2 maps
NETS = {
    "cnn": (ScalableCNN, (2, 8, 8), (16, 16, 32, 32)),
    "resnet18": (ScalableResNet18, (3, 16, 16), (16, 16, 32, 32)),
}


def _net(kind: str, widths: tuple[int, ...] | None = None, seed: int = 0, **kw: object) -> nn.Module:
    cls, shape, full = NETS[kind]
    torch.manual_seed(seed)
    net = cls(input_shape=shape, num_classes=5, widths=widths or full, **kw).to(f64)
    with torch.no_grad():  # non-trivial norm scales and shifts (their defaults are 1 and 0)
        for p in net.parameters():
            if p.dim() == 1:
                p.normal_()
    return net


def _batch(kind: str, n: int = 6, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *NETS[kind][1], generator=g, dtype=f64), torch.randint(0, 5, (n,), generator=g)


def _small_widths(kind: str, indices: dict[str, Tensor]) -> list[int]:
    prefix = "block" if kind == "cnn" else "stream"
    start = 0 if kind == "cnn" else 1
    return [len(indices[f"{prefix}{j}"]) for j in range(start, start + 4)]


@pytest.mark.parametrize("kind", sorted(NETS))
@pytest.mark.parametrize(
    ("ratio", "mode"), [*((r, "prefix") for r in RATIOS), (0.5, "rolling"), (0.25, "rolling"), (0.5, "random")]
)
def test_masked_full_net_is_the_extracted_small_net(kind: str, ratio: float, mode: str) -> None:
    """Zeroing the entries outside the width-``ratio`` index sets and ``set_width(ratio)`` makes the full net compute
    what a net of widths ``ceil(ratio C)`` holding the slices ``W[I_out][:, I_in]`` computes (train mode, batch BN),
    and its masked gradients are the small net's gradients in the slices and zero elsewhere (fp64)."""
    full = _net(kind)
    indices = width_indices(full, ratio, mode, round_idx=3, generator=torch.Generator().manual_seed(7))
    masks = masks_from_indices(full, indices)
    small = _net(kind, widths=tuple(_small_widths(kind, indices)), seed=1)
    small.load_state_dict(extract_state(full, indices), strict=True)
    apply_masks([t for _, t in local_entries(full)], masks)
    full.set_width(ratio)
    small.set_width(ratio)
    x, y = _batch(kind)

    out_full, out_small = full(x), small(x)
    torch.testing.assert_close(out_full, out_small, rtol=1e-12, atol=1e-12)

    F.cross_entropy(out_full, y).backward()
    F.cross_entropy(out_small, y).backward()
    params = [p for _, p in local_entries(full)]
    mask_grads(params, masks)
    grads = extract_state(full, indices, [p.grad for p in params])
    scale = max(float(p.grad.abs().max()) for p in small.parameters())  # atol: fp64 residue of entries that are ~0
    for (name, p), m in zip(local_entries(full), masks):
        assert not p.grad[m == 0].any(), name
        torch.testing.assert_close(grads[name], small.get_parameter(name).grad, rtol=1e-9, atol=1e-10 * scale)


def test_raw_gradients_outside_a_prefix_submodel_are_already_zero() -> None:
    """A zeroed channel outputs 0 (conv 0, BN scale and shift 0), and every weight reading it is 0, so plain SGD on
    the masked net never leaves the sub-model; the core still masks the gradients (the label-aware head, weight decay
    on stale entries, other losses), see ``tests/models/test_width.py``."""
    net = _net("resnet18")
    masks = masks_from_indices(net, width_indices(net, 0.25, "prefix"))
    apply_masks(list(net.parameters()), masks)
    x, y = _batch("resnet18")
    F.cross_entropy(net(x), y).backward()
    for (name, p), m in zip(net.named_parameters(), masks):
        assert not p.grad[m == 0].any(), name


def test_scaler_divides_by_the_ratio_in_training_only() -> None:
    s = Scaler()
    x = torch.randn(3, 4, dtype=f64)
    net = nn.Sequential(s, nn.Sequential(Scaler()))
    set_width(net, 0.25)
    assert all(m.ratio == 0.25 for m in net.modules() if isinstance(m, Scaler))
    torch.testing.assert_close(net.train()(x), x / 0.25 / 0.25, rtol=0, atol=0)  # two Scalers
    torch.testing.assert_close(net.eval()(x), x, rtol=0, atol=0)
    raises_one_line(set_width, net, 0.0, match="expected a ratio in (0, 1]")


def test_without_norm_the_scaler_is_the_width_compensation() -> None:
    """``norm=none``: the blocks are positively homogeneous (conv with bias aside), so with zero conv biases
    ``set_width(rho)`` multiplies the penultimate features by ``rho^-L`` in training (L = 4 blocks), not in eval."""
    net = _net("cnn", norm="none")
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.Conv2d):
                m.bias.zero_()
    x, _ = _batch("cnn")
    base = net.features(x)
    net.set_width(0.5)
    torch.testing.assert_close(net.features(x), base * 0.5**-4, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(net.eval().features(x), base, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(NETS))
def test_static_bn_has_no_buffers_so_the_upload_is_the_parameters(kind: str) -> None:
    net = _net(kind)
    assert list(net.buffers()) == []
    assert [n for n, _ in local_entries(net)] == [n for n, _ in net.named_parameters()]
    assert any(isinstance(m, StaticBatchNorm2d) for m in net.modules())


@pytest.mark.parametrize("kind", sorted(NETS))
def test_rebuilt_stats_in_one_chunk_make_eval_equal_the_one_batch_training_forward(kind: str) -> None:
    """With ``batch_size >= len(x)`` every layer's statistics are those of its inputs in the one-batch training
    forward, so ``eval()(x)`` (rebuilt statistics) equals ``train()(x)`` (batch statistics) at width 1. Modes and
    widths are restored."""
    net = _net(kind)
    x, _ = _batch(kind, n=10)
    net.train()
    expected = net(x)
    net.set_width(0.5)
    net.eval()
    layers = rebuild_bn_stats(net, x, batch_size=64)
    assert layers == sum(isinstance(m, StaticBatchNorm2d) for m in net.modules()) > 0
    assert not net.training and all(m.ratio == 0.5 for m in net.modules() if isinstance(m, Scaler))
    torch.testing.assert_close(net(x), expected, rtol=1e-10, atol=1e-10)


def test_chunked_rebuild_gives_the_pooled_moments_of_a_layers_inputs() -> None:
    """The first sBN layer's inputs do not depend on the chunking: its statistics are the mean and biased variance of
    ``conv(x)`` over all rows and positions, for chunks of 3 out of 10 rows (uneven last chunk)."""
    net = _net("cnn")
    x, _ = _batch("cnn", n=10)
    rebuild_bn_stats(net, x, batch_size=3)
    a = net.blocks[0](x)  # (10, C, 8, 8): the first conv's output, the first sBN's input
    bn = net.blocks[2]
    torch.testing.assert_close(bn.stat_mean, a.mean(dim=(0, 2, 3)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.stat_var, a.var(dim=(0, 2, 3), unbiased=False), rtol=1e-12, atol=1e-12)


def test_eval_without_statistics_uses_the_batch_and_bn_stats_clears_on_exit() -> None:
    net = _net("cnn")
    x, _ = _batch("cnn", n=8)
    batch_stats = net.train()(x)
    net.eval()
    torch.testing.assert_close(net(x), batch_stats, rtol=0, atol=0)  # never rebuilt: the batch's own statistics
    with bn_stats(net, x[:4], batch_size=2) as evaluated:
        rebuilt = evaluated(x)
        assert all(m.stat_mean is not None for m in net.modules() if isinstance(m, StaticBatchNorm2d))
    assert not torch.allclose(rebuilt, batch_stats)
    assert all(m.stat_mean is None for m in net.modules() if isinstance(m, StaticBatchNorm2d))
    rebuild_bn_stats(net, x)
    clear_bn_stats(net)
    torch.testing.assert_close(net(x), batch_stats, rtol=0, atol=0)


def _cnn_count(c: int, k: int, w: tuple[int, ...]) -> int:
    """Per block a 3x3 conv without bias and sBN (scale, shift); the head."""
    return sum(9 * a * b + 2 * b for a, b in zip((c, *w[:-1]), w)) + w[-1] * k + k


@pytest.mark.parametrize("name", ["cnn_scalable", "resnet18_scalable"])
def test_configs_build_the_digest_nets(name: str) -> None:
    """``model=cnn_scalable`` (MNIST, 10 classes): 1,555,914 parameters (the formula; the authors' released code sizes
    the CNN at about 1.55M); ``model=resnet18_scalable`` (CIFAR-10): the CIFAR ResNet18's 11,173,962."""
    cfg = precheck([f"model={name}", "data=digits"])
    assert list(cfg.model.widths) == [64, 128, 256, 512] and cfg.model.norm == "bn"
    shape = (1, 28, 28) if name == "cnn_scalable" else (3, 32, 32)
    net = net_from_config(cfg.model, shape, 10)
    count = sum(p.numel() for p in net.parameters())
    expected = _cnn_count(1, 10, (64, 128, 256, 512)) if name == "cnn_scalable" else 11_173_962
    assert count == expected and math.isclose(count, 1.55e6 if name == "cnn_scalable" else 11.17e6, rel_tol=0.01)


def test_one_line_errors() -> None:
    raises_one_line(ScalableCNN, input_shape=(1, 4, 4), num_classes=3, match="4 blocks need H and W >= 8")
    raises_one_line(ScalableCNN, input_shape=(8,), num_classes=3, match="model=cnn_scalable needs image inputs")
    raises_one_line(ScalableCNN, input_shape=(1, 8, 8), num_classes=3, norm="ln", match="model.norm='ln'")
    raises_one_line(ScalableResNet18, input_shape=(3, 8, 8), num_classes=3, widths=(4, 8), match="expected 4 widths")
