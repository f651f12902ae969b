"""Per-sample squared gradient norms in one backward (:mod:`flx.models.per_sample`): equal, in float64, to the norms of
per-sample gradients computed one sample at a time by autograd, for dense, convolutional (Gram form and formed
gradients), frozen-statistics BatchNorm and sequence inputs, with and without width masks; None where unsupported."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flx.models.per_sample import sq_norms
from flx.models.scalable import ScalableCNN, ScalableResNet18, set_width
from flx.models.width import width_masks

f64 = torch.float64


def _by_autograd(net: nn.Module, x: Tensor, y: Tensor, masks: list[Tensor] | None, loss=F.cross_entropy) -> Tensor:
    """One autograd gradient per sample (the net treats samples independently), masked, squared and summed."""
    params = [p for p in net.parameters() if p.requires_grad]
    masks = masks or [torch.ones_like(p) for p in params]
    out = []
    for n in range(len(x)):
        grads = torch.autograd.grad(loss(net(x[n : n + 1]), y[n : n + 1]), params, allow_unused=True)
        out.append(sum(((g * m) ** 2).sum() for g, m in zip(grads, masks) if g is not None))
    return torch.stack(out)


def _freeze_bn(net: nn.Module, x: Tensor) -> None:
    """Static BN in evaluation with the statistics of ``x`` (what WHALE's Fisher holds fixed)."""
    from flx.parts.systems.whale_utility import _batch_stats

    layers = [m for m in net.modules() if hasattr(m, "stat_mean")]
    for m, (mean, var) in _batch_stats(net, layers, x).items():
        m.stat_mean, m.stat_var, m.training = mean, var, False


def _batch(n: int, shape: tuple[int, ...], classes: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=f64), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("ratio", [1.0, 1 / 2, 1 / 4])
@pytest.mark.parametrize("mode", ["prefix", "random"])
def test_scalable_cnn_with_width_masks_matches_autograd(ratio: float, mode: str) -> None:
    """8x8 inputs: the first convs take the formed-gradient branch (T = 64 positions), the last the Gram branch."""
    torch.manual_seed(0)
    net = ScalableCNN(input_shape=(2, 8, 8), num_classes=5, widths=[3, 4, 6, 8]).to(f64).train()
    x, y = _batch(6, (2, 8, 8), 5)
    masks = width_masks(net, ratio, mode, generator=torch.Generator().manual_seed(3), classes=[1, 3])
    with torch.no_grad():
        for p, m in zip(net.parameters(), masks):
            p.mul_(m)
    set_width(net, ratio)
    _freeze_bn(net, x)
    fast = sq_norms(net, F.cross_entropy, x, y, masks)
    torch.testing.assert_close(fast, _by_autograd(net, x, y, masks), rtol=1e-10, atol=1e-12)


def test_resnet_with_strided_and_shortcut_convs_matches_autograd() -> None:
    torch.manual_seed(0)
    net = ScalableResNet18(input_shape=(3, 8, 8), num_classes=4, widths=[2, 3, 3, 4]).to(f64).train()
    x, y = _batch(3, (3, 8, 8), 4)
    _freeze_bn(net, x)
    torch.testing.assert_close(sq_norms(net, F.cross_entropy, x, y), _by_autograd(net, x, y, None), rtol=1e-10, atol=0)


class _Seq(nn.Module):
    """Dense layers over a (B, T, d) sequence, mean-pooled: per-sample gradients sum over positions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x))).mean(1)


@pytest.mark.parametrize("length", [2, 9])  # Gram form (T = 2) and formed gradients (T = 9)
def test_sequence_inputs_and_a_running_stats_bn_match_autograd(length: int) -> None:
    torch.manual_seed(0)
    net = _Seq().to(f64)
    x, y = _batch(4, (length, 5), 3)
    torch.testing.assert_close(sq_norms(net, F.cross_entropy, x, y), _by_autograd(net, x, y, None), rtol=1e-10, atol=0)
    bn = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 16, 3)).to(f64)
    with torch.no_grad():
        bn[1].running_mean.uniform_(-1, 1), bn[1].running_var.uniform_(0.5, 2), bn[1].weight.uniform_(0.5, 2)
    bn.eval()
    xb, yb = _batch(3, (1, 4, 4), 3)
    expected = _by_autograd(bn, xb, yb, None)
    torch.testing.assert_close(sq_norms(bn, F.cross_entropy, xb, yb), expected, rtol=1e-10, atol=0)


def test_unsupported_nets_give_none() -> None:
    """Batch statistics in play, a layer type it does not know, a layer called twice, a mask that is no outer
    product: None (the caller falls back to torch.func)."""
    x, y = _batch(3, (1, 4, 4), 2)
    conv_bn = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2)).to(f64).train()
    assert sq_norms(conv_bn, F.cross_entropy, x, y) is None
    layer_norm = nn.Sequential(nn.Flatten(), nn.LayerNorm(16), nn.Linear(16, 2)).to(f64)
    assert sq_norms(layer_norm, F.cross_entropy, x, y) is None
    lin = nn.Linear(16, 16).to(f64)
    shared = nn.Sequential(nn.Flatten(), lin, nn.Tanh(), lin, nn.Linear(16, 2)).to(f64)
    assert sq_norms(shared, F.cross_entropy, x, y) is None
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 2)).to(f64)
    checker = torch.ones(2, 16, dtype=f64)
    checker[0, 0] = 0  # not an outer product of a row and a column selection
    assert sq_norms(net, F.cross_entropy, x, y, [checker, torch.ones(2, dtype=f64)]) is None


def test_whale_fisher_falls_back_to_torch_func_for_other_layers() -> None:
    """A LayerNorm net is not supported here: WHALE's per-sample norms then come from torch.func, the same values."""
    from flx.parts.systems.whale_utility import per_sample_sq_norms

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 2)).to(f64)
    x, y = _batch(4, (1, 4, 4), 2)
    ones = [torch.ones_like(p) for p in net.parameters()]
    assert sq_norms(net, F.cross_entropy, x, y) is None
    got = per_sample_sq_norms(net, F.cross_entropy, x, y, ones)
    torch.testing.assert_close(got, _by_autograd(net, x, y, None), rtol=1e-10, atol=0)
