r"""Width-scalable nets for sub-model FL (HeteroFL, FedRolex, Federated Dropout, WHALE-FL): a 4-block CNN and a CIFAR
ResNet18, each with HeteroFL's Scaler and static BatchNorm (sBN).

Papers: E. Diao, J. Ding, V. Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning for
Heterogeneous Clients", ICLR 2021 (Scaler, sBN); H. Su et al., "WHALE-FL", 2024 (section "Datasets, Models, Parameters
and Baselines"; the widths are the authors' released code's, github.com/BESTTOOLBOX/WHALE-FL: the CNN with widths [64,
128, 256, 512] on MNIST and HAR, ResNet18 with [64, 128, 256, 512] on CIFAR-10).

ONE full-width net serves every client: a client's sub-network of width ratio :math:`\rho` is a set of 0/1 masks over
the net's tensors (:mod:`flx.models.width`), and ``set_width(rho, indices)`` sets the Scaler. Each net names its hidden
channel groups in ``width_groups`` and tags every layer with the groups of its dimensions, so masks and sub-model
extraction are one generic function for every net.

**Scaler.** :math:`\mathrm{Scaler}(a) = a / \rho` in training and :math:`a` in evaluation, after every convolution
(before its norm), so a sub-model's activations have the full model's scale when its weights are merged into the full
model (HeteroFL §3.2). ``set_width(rho, indices)`` is called by the scheduler at client start with the sub-model's
index sets (:func:`flx.models.width.width_indices`: a net whose layers depend on which channels are kept reads them,
:mod:`flx.models.scalable_lm`; these nets ignore them), and ``set_width(1.0)`` at client end; here the Scaler is the
only thing it changes. In front of sBN the division only moves the :math:`\epsilon` of the normalisation; with
``norm=none`` it is the whole compensation.

**Static BatchNorm** (:class:`StaticBatchNorm2d`). In training, BatchNorm normalises with the batch's statistics and
keeps no running statistics (``track_running_stats=False``): the net has **no buffers**, so ``fed.local_state`` is
exactly its parameters, nothing averages statistics of sub-models of different widths, and a masked-out channel (its
conv, scale and shift zeroed) stays exactly zero. For evaluation, HeteroFL recomputes the statistics once on the
global (full-width) model over the training data. Here:

- :func:`rebuild_bn_stats` ``(net, x, batch_size)`` runs the full-width net (``set_width(1.0)``) in training mode over
  the rows ``x`` in chunks, and sets each sBN layer's evaluation statistics to the exact mean and (biased) variance of
  that layer's inputs over all rows and positions (Chan's pairwise merge of the chunks, in float64);
- in ``eval()`` an sBN layer with statistics normalises with them; without them (never rebuilt, or cleared with
  :func:`clear_bn_stats`) it uses the batch's own, as ``track_running_stats=False`` does;
- :func:`bn_stats` is the context manager that rebuilds, evaluates and clears.

The statistics are plain attributes, not buffers: they are a function of the global weights and the data, rebuilt
before each evaluation, so they are neither uploaded, averaged, checkpointed nor ever stale across rounds. With
``batch_size >= len(x)`` the evaluation output on ``x`` equals the training-mode output on ``x`` as one batch (the
tests check it). With smaller chunks each layer's statistics are those of its inputs as produced by chunk-wise training
-mode forwards of the earlier layers (HeteroFL's pass, ``momentum=None``, averages the chunks' unbiased variances
instead, which leaves out the spread of the chunk means).

Deviations from HeteroFL's nets: the convolutions in front of sBN have no bias (a per-channel constant is removed by
the batch mean); the ResNet18 is the usual post-activation CIFAR ResNet18 (3x3 stem, no max-pool, BasicBlocks
[2, 2, 2, 2] with strides 1, 2, 2, 2), with the Scaler after every convolution, shortcuts included.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flx.errors import ConfigError, bad_value
from flx.models.nets import _as_widths, as_shape, check_num_classes
from flx.models.width import CLASSES, tag_width

__all__ = [
    "Scaler",
    "ScalableCNN",
    "ScalableResNet18",
    "StaticBatchNorm2d",
    "bn_stats",
    "clear_bn_stats",
    "rebuild_bn_stats",
    "set_width",
]

NORMS = ("bn", "none")


class Scaler(nn.Module):
    """``a / rho`` in training, ``a`` in evaluation (HeteroFL's Scaler); ``rho`` is set by :func:`set_width`."""

    def __init__(self) -> None:
        super().__init__()
        self.ratio = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return x / self.ratio if self.training else x

    def extra_repr(self) -> str:
        return f"ratio={self.ratio}"


class StaticBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm with batch statistics in training and no buffers; in ``eval()`` it normalises with the statistics
    :func:`rebuild_bn_stats` set (``stat_mean``, ``stat_var``: plain attributes), or with the batch's own."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__(num_features, eps=eps, affine=True, track_running_stats=False)
        self.stat_mean: Tensor | None = None
        self.stat_var: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.training or self.stat_mean is None:
            return super().forward(x)
        return F.batch_norm(x, self.stat_mean, self.stat_var, self.weight, self.bias, False, 0.0, self.eps)


def set_width(net: nn.Module, ratio: float) -> None:
    """Sets the width ratio ``rho`` of every :class:`Scaler` in ``net`` (1.0: the full net)."""
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise bad_value("width ratio", ratio, "expected a ratio in (0, 1]")
    for m in net.modules():
        if isinstance(m, Scaler):
            m.ratio = ratio


class ScalableCNN(nn.Module):
    """The CNN of HeteroFL and WHALE-FL: per width ``w_j`` a block ``Conv3x3 + Scaler + sBN + ReLU + MaxPool2``, then
    global average pooling and a linear head: ``(B, C, H, W) -> (B, w_j, H / 2^j, ...) -> (B, w_last) -> (B, K)``.

    The last block has no max-pool (global average pooling follows at once; HeteroFL's CNN drops it too), so 8x8
    inputs pass three pools. Channel groups: ``block{j}``, the output channels of block ``j``.

    Args:
        input_shape: per-sample image shape ``(C, H, W)``; ``H, W >= 2^(len(widths) - 1)``.
        num_classes: number of output logits.
        widths: the blocks' channels (full width).
        norm: ``bn`` (static BatchNorm) or ``none`` (convolutions then have a bias).

    Attributes:
        width_groups: group -> full channel count.
        feat_dim: width of :meth:`features`, ``widths[-1]``.
        head: the final ``Linear(feat_dim -> num_classes)``.
    """

    def __init__(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        widths: Sequence[int] = (64, 128, 256, 512),
        norm: str = "bn",
    ) -> None:
        super().__init__()
        self.input_shape, self.num_classes = _image_shape(input_shape, "cnn_scalable"), check_num_classes(num_classes)
        w, norm = _as_widths("model.widths", widths, allow_empty=False), _check_norm(norm)
        _, h, wd = self.input_shape
        if min(h, wd) < 2 ** (len(w) - 1):
            raise bad_value("input_shape", self.input_shape, f"{len(w)} blocks need H and W >= {2 ** (len(w) - 1)}")
        self.width_groups = {f"block{j}": c for j, c in enumerate(w)}
        layers: list[nn.Module] = []
        c_in, g_in = self.input_shape[0], None
        for j, (g, c) in enumerate(self.width_groups.items()):
            layers += [*_conv_unit(c_in, c, 3, 1, g, g_in, norm), nn.ReLU(inplace=True)]
            if j < len(w) - 1:
                layers.append(nn.MaxPool2d(2))  # (B, c, h, w) -> (B, c, h // 2, w // 2)
            c_in, g_in = c, g
        self.blocks = nn.Sequential(*layers)
        self.feat_dim = w[-1]
        self.head = tag_width(nn.Linear(self.feat_dim, self.num_classes), CLASSES, g_in)

    def set_width(self, ratio: float, indices: Mapping[str, Tensor] | None = None) -> None:
        """Sets the Scaler's ``rho`` (:func:`set_width`); ``indices`` (the sub-model's index sets) are not needed."""
        set_width(self, ratio)

    def features(self, x: Tensor) -> Tensor:
        """The penultimate features: ``(B, C, H, W) -> (B, feat_dim)`` (global average pool of the last block)."""
        return self.blocks(x).mean(dim=(2, 3))

    def forward(self, x: Tensor) -> Tensor:
        """Maps ``(B, C, H, W)`` to logits ``(B, num_classes)``."""
        return self.head(self.features(x))


class _Block(nn.Module):
    """BasicBlock ``relu(sBN(conv2(relu(sBN(conv1 x)))) + shortcut(x))`` with a Scaler after every convolution.

    Groups: conv1 maps ``g_in -> g_mid``, conv2 ``g_mid -> g_out``; the 1x1 shortcut ``g_in -> g_out`` (its indices
    are those of the block's convs).
    """

    def __init__(self, c_in: int, c_out: int, stride: int, groups: tuple[str, str, str], norm: str) -> None:
        super().__init__()
        g_in, g_mid, g_out = groups
        self.unit1 = nn.Sequential(*_conv_unit(c_in, c_out, 3, stride, g_mid, g_in, norm))
        self.unit2 = nn.Sequential(*_conv_unit(c_out, c_out, 3, 1, g_out, g_mid, norm))
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:  # (B, c_in, H, W) -> (B, c_out, H / s, W / s)
            self.shortcut = nn.Sequential(*_conv_unit(c_in, c_out, 1, stride, g_out, g_in, norm))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.unit2(F.relu(self.unit1(x))) + self.shortcut(x))


class ScalableResNet18(nn.Module):
    """CIFAR ResNet18 with Scalers and sBN: ``Conv3x3(C -> w_0)`` stem, four stages of 2 BasicBlocks (widths ``w_j``,
    strides 1, 2, 2, 2), global average pooling, linear head: ``(B, C, H, W) -> (B, w_3, H/8, W/8) -> (B, K)``.

    Channel groups: ``stream{j}`` (``j = 1..4``), the residual stream of stage ``j`` (the stem writes ``stream1``; the
    identity shortcuts add a stage's blocks together, so the stage shares one index set), and ``layer{j}.{b}``, the
    hidden channels inside block ``b`` of stage ``j``.

    Args:
        input_shape: per-sample image shape ``(C, H, W)``; any size.
        num_classes: number of output logits.
        widths: the four stages' channels (full width).
        norm: ``bn`` (static BatchNorm) or ``none``.
    """

    def __init__(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        widths: Sequence[int] = (64, 128, 256, 512),
        norm: str = "bn",
    ) -> None:
        super().__init__()
        self.input_shape = _image_shape(input_shape, "resnet18_scalable")
        self.num_classes = check_num_classes(num_classes)
        w, norm = _as_widths("model.widths", widths, allow_empty=False), _check_norm(norm)
        if len(w) != 4:
            raise bad_value("model.widths", list(w), "expected 4 widths: the channels of the 4 stages")
        self.width_groups: dict[str, int] = {}
        self.stem = nn.Sequential(*_conv_unit(self.input_shape[0], w[0], 3, 1, "stream1", None, norm), nn.ReLU())
        c_in, stages = w[0], []
        for j, (c, stride) in enumerate(zip(w, (1, 2, 2, 2)), start=1):
            self.width_groups[f"stream{j}"] = c
            blocks = []
            for b in range(2):
                g_in = f"stream{j - 1 if b == 0 and j > 1 else j}"
                self.width_groups[f"layer{j}.{b}"] = c
                blocks.append(_Block(c_in, c, stride if b == 0 else 1, (g_in, f"layer{j}.{b}", f"stream{j}"), norm))
                c_in = c
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.feat_dim = w[-1]
        self.head = tag_width(nn.Linear(self.feat_dim, self.num_classes), CLASSES, "stream4")
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def set_width(self, ratio: float, indices: Mapping[str, Tensor] | None = None) -> None:
        """Sets the Scaler's ``rho`` (:func:`set_width`); ``indices`` (the sub-model's index sets) are not needed."""
        set_width(self, ratio)

    def features(self, x: Tensor) -> Tensor:
        """The penultimate features: ``(B, C, H, W) -> (B, feat_dim)``."""
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))  # (B, w_3, H/8, W/8)
        return x.mean(dim=(2, 3))

    def forward(self, x: Tensor) -> Tensor:
        """Maps ``(B, C, H, W)`` to logits ``(B, num_classes)``."""
        return self.head(self.features(x))


# ---------------------------------------------------------------------------------------------- static BN statistics


@torch.no_grad()
def rebuild_bn_stats(net: nn.Module, x: Tensor, batch_size: int = 256) -> int:
    """Sets every :class:`StaticBatchNorm2d`'s evaluation statistics from the full-width net over the rows ``x``.

    Runs ``net`` at width 1 in training mode over ``x`` in ``ceil(len(x) / batch_size)`` chunks of near-equal size
    (at most ``batch_size`` rows; no lone last row, on which training-mode BatchNorm fails); each layer's statistics
    are the mean and biased variance of its inputs over all rows and positions. The net's modes and widths are
    restored.

    Returns:
        The number of sBN layers rebuilt.
    """
    layers = [m for m in net.modules() if isinstance(m, StaticBatchNorm2d)]
    if not layers or len(x) == 0:
        return 0
    moments: dict[StaticBatchNorm2d, tuple[float, Tensor, Tensor]] = {}
    hooks = [m.register_forward_pre_hook(lambda m, args: _merge(moments, m, args[0])) for m in layers]
    modes = [(m, m.training) for m in net.modules()]
    ratios = [(m, m.ratio) for m in net.modules() if isinstance(m, Scaler)]
    device = next(net.parameters()).device
    try:
        net.train()
        set_width(net, 1.0)
        for chunk in x.tensor_split(math.ceil(len(x) / int(batch_size))):  # as even as possible: no lone last row
            net(chunk.to(device))
    finally:
        for h in hooks:
            h.remove()
        for m, training in modes:
            m.training = training
        for m, ratio in ratios:
            m.ratio = ratio
    for m, (n, mean, m2) in moments.items():
        m.stat_mean, m.stat_var = mean.to(m.weight.dtype), (m2 / n).to(m.weight.dtype)
    return len(layers)


def clear_bn_stats(net: nn.Module) -> None:
    """Forgets the evaluation statistics: ``eval()`` normalises with each batch's own again."""
    for m in net.modules():
        if isinstance(m, StaticBatchNorm2d):
            m.stat_mean = m.stat_var = None


@contextmanager
def bn_stats(net: nn.Module, x: Tensor, batch_size: int = 256) -> Iterator[nn.Module]:
    """``with bn_stats(net, x, b): evaluate(net)``: statistics rebuilt on entry (:func:`rebuild_bn_stats`), cleared
    on exit, so they never outlive the weights they were computed for."""
    rebuild_bn_stats(net, x, batch_size)
    try:
        yield net
    finally:
        clear_bn_stats(net)


def _merge(moments: dict, m: nn.Module, x: Tensor) -> None:
    """Chan et al.'s pairwise update of (count, mean, sum of squared deviations) per channel with the chunk ``x``."""
    xs = x.detach().to(torch.float64).transpose(0, 1).flatten(1)  # (B, C, H, W) -> (C, B H W)
    n_b, mean_b = xs.shape[1], xs.mean(dim=1)
    m2_b = ((xs - mean_b[:, None]) ** 2).sum(dim=1)
    if m not in moments:
        moments[m] = (n_b, mean_b, m2_b)
        return
    n_a, mean_a, m2_a = moments[m]
    n, delta = n_a + n_b, mean_b - mean_a
    moments[m] = (n, mean_a + delta * (n_b / n), m2_a + m2_b + delta**2 * (n_a * n_b / n))


# ---------------------------------------------------------------------------------------------- building blocks


def _conv_unit(c_in: int, c_out: int, k: int, stride: int, g_out: str, g_in: str | None, norm: str) -> list[nn.Module]:
    """``Conv(k x k, stride) + Scaler (+ sBN)``: ``(B, c_in, H, W) -> (B, c_out, H / stride, W / stride)``."""
    conv = nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, bias=norm == "none")
    unit = [tag_width(conv, g_out, g_in), Scaler()]
    if norm == "bn":
        unit.append(tag_width(StaticBatchNorm2d(c_out), g_out))
    return unit


def _image_shape(input_shape: Sequence[int], name: str) -> tuple[int, ...]:
    shape = as_shape(input_shape)
    if len(shape) != 3:
        raise ConfigError(f"model={name} needs image inputs (C, H, W); got input_shape={shape}")
    return shape


def _check_norm(norm: str) -> str:
    if norm not in NORMS:
        raise bad_value("model.norm", norm, f"allowed: {', '.join(NORMS)}")
    return norm
