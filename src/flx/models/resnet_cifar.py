r"""The CIFAR ResNets of Contrastive Representation Distillation (Tian, Krishnan, Isola, ICLR 2020): ResNet8x4 and
ResNet32x4, AugFL's meta-model and pretrained model (Yue, Qin, Deng, Ren, Zhang, Zhang, "AugFL: Augmenting Federated
Learning with Pretrained Models", Section VI-A).

Structure (``depth = 6 n + 2``, ``widths = [w_0, w_1, w_2, w_3]``, ``[32, 64, 128, 256]`` for the "x4" nets)::

    stem     Conv3x3(C -> w_0) + BN + ReLU                      (B, C, H, W)       -> (B, w_0, H, W)
    stage 1  n BasicBlocks w_0 -> w_1, stride 1                 -> (B, w_1, H, W)
    stage 2  n BasicBlocks w_1 -> w_2, stride 2                 -> (B, w_2, H/2, W/2)
    stage 3  n BasicBlocks w_2 -> w_3, stride 2                 -> (B, w_3, H/4, W/4)
    pool     global average pool, flatten                       -> (B, w_3)           the penultimate features
    head     Linear(w_3 -> K)                                   -> (B, K)

A BasicBlock is ``Conv3x3 + BN + ReLU + Conv3x3 + BN``, added to the shortcut, then ReLU; the shortcut is the identity,
or ``Conv1x1(stride) + BN`` where the width or the stride changes (the first block of every stage when ``w_0 != w_1``).
Convolutions have no bias. The depth counts the stem, the ``2 * 3 n`` block convolutions and the head. Parameters, with
``C`` input channels, ``K`` classes and, for stage ``j`` with ``w_{j-1} != w_j``,
``s_j = 10 w_{j-1} w_j + 9 w_j^2 + 6 w_j + (n - 1) (18 w_j^2 + 4 w_j)`` (the first block: two 3x3 convolutions, the
1x1 shortcut and 3 BatchNorms; then ``n - 1`` blocks of two convolutions and 2 BatchNorms)::

    9 C w_0 + 2 w_0 + s_1 + s_2 + s_3 + w_3 K + K

ResNet8x4 (``n = 1``) has 1,233,540 parameters and ResNet32x4 (``n = 5``) 7,433,860 for ``C = 3``, ``K = 100``: the
counts of the definition in AugFL's released code, 1.23M and 7.43M (``tests/models/test_resnet_cifar.py``).

Deviation: the authors' net ends with a fixed ``AvgPool2d(8)``, which assumes 32x32 inputs (an 8x8 map after the two
stride-2 stages); here the pool is ``AdaptiveAvgPool2d(1)``, which is the same operation on 32x32 inputs and also takes
any other size (8x8 digits, 28x28 MNIST, 64x64 Tiny-ImageNet) and any number of input channels, the resizing the paper
leaves unstated. BatchNorm is ordinary ``nn.BatchNorm2d``: what an algorithm does with its running
statistics is the algorithm's choice (the AugFL paper says nothing about BatchNorm).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from flx.errors import ConfigError, bad_value
from flx.models.nets import _as_widths, as_shape, check_num_classes

__all__ = ["BasicBlock", "ResNetCIFAR"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual shortcut: ``(B, c_in, H, W) -> (B, c_out, H/s, W/s)``.

    Args:
        c_in: input channels.
        c_out: output channels.
        stride: stride of the first convolution (and of the shortcut's 1x1 convolution).
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:  # the residual must match the block's output shape
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetCIFAR(nn.Module):
    """A CIFAR ResNet (CRD's ``resnet8x4`` / ``resnet32x4`` family); see the module docstring for the structure.

    Attributes:
        feat_dim: width of the penultimate features, ``widths[-1]``.
        head: the final ``Linear(feat_dim -> num_classes)``; ``forward(x) == head(features(x))``.

    Args:
        input_shape: per-sample image shape ``(C, H, W)``; any ``C``, any ``H`` and ``W``.
        num_classes: number of output logits.
        depth: ``6 n + 2`` (8, 14, 20, 26, 32, ...): ``n`` BasicBlocks per stage.
        widths: the stem's channels and those of the three stages.

    Raises:
        ConfigError: a non-image input, a depth that is not ``6 n + 2``, or not four positive widths.
    """

    def __init__(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        depth: int = 8,
        widths: Sequence[int] = (32, 64, 128, 256),
    ) -> None:
        super().__init__()
        self.input_shape = as_shape(input_shape)
        self.num_classes = check_num_classes(num_classes)
        if len(self.input_shape) != 3:
            raise ConfigError(f"model=resnet_cifar needs image inputs (C, H, W); got input_shape={self.input_shape}")
        blocks = _blocks_per_stage(depth)
        w = _as_widths("model.widths", widths, allow_empty=False)
        if len(w) != 4:
            raise bad_value("model.widths", list(w), "expected 4 widths: the stem's and the 3 stages' channels")
        self.depth, self.widths, self.feat_dim = int(depth), w, w[-1]

        stem_conv = nn.Conv2d(self.input_shape[0], w[0], 3, padding=1, bias=False)
        self.stem = nn.Sequential(stem_conv, nn.BatchNorm2d(w[0]), nn.ReLU(inplace=True))
        self.layer1 = _stage(w[0], w[1], blocks, stride=1)
        self.layer2 = _stage(w[1], w[2], blocks, stride=2)
        self.layer3 = _stage(w[2], w[3], blocks, stride=2)
        self.pool = GlobalAvgPool()  # == the authors' AvgPool2d(8) on 32x32 inputs
        self.head = nn.Linear(self.feat_dim, self.num_classes)
        _init(self)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The penultimate (pre-logit) features: ``(B, C, H, W) -> (B, feat_dim)``."""
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))  # (B, w_3, H/4, W/4)
        return self.pool(x).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps ``(B, C, H, W)`` to logits ``(B, num_classes)``."""
        return self.head(self.features(x))


class GlobalAvgPool(nn.Module):
    """``AdaptiveAvgPool2d(1)``: ``(B, C, H, W) -> (B, C, 1, 1)``, the mean over each channel's positions.

    Under ``torch.use_deterministic_algorithms`` on CUDA (``trainer.deterministic=true``), where the adaptive pool's
    backward has no deterministic kernel, the same mean is taken as ``x.mean((2, 3))``, whose backward is a broadcast;
    elsewhere the adaptive pool itself (the CPU results of earlier flx versions, bit for bit). No parameters: the
    checkpoints of either are the same.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.are_deterministic_algorithms_enabled():
            return x.mean((2, 3), keepdim=True)
        return F.adaptive_avg_pool2d(x, 1)


def _blocks_per_stage(depth: Any) -> int:
    """``n`` of ``depth = 6 n + 2``, or a one-line error."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
        raise bad_value("model.depth", depth, "expected 6n+2 for an integer n >= 1 (8, 14, 20, 26, 32, ...)")
    return (depth - 2) // 6


def _stage(c_in: int, c_out: int, blocks: int, stride: int) -> nn.Sequential:
    """``blocks`` BasicBlocks; the first changes the width and applies the stride."""
    return nn.Sequential(BasicBlock(c_in, c_out, stride), *(BasicBlock(c_out, c_out) for _ in range(blocks - 1)))


def _init(net: nn.Module) -> None:
    """He-normal convolutions (fan-out, ReLU gain), BatchNorm scale 1 and shift 0, as the CRD authors initialise."""
    for m in net.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
