"""In-memory tensor store: a whole dataset as a few tensors; clients are index views into it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TensorData:
    """A dataset loaded into memory.

    Attributes:
        x_train: float32 inputs, shape ``(N, *input_shape)`` (images are ``(N, C, H, W)``), standardised.
        y_train: int64 labels, shape ``(N,)``.
        x_test: float32 inputs of the global test split, shape ``(M, *input_shape)``.
        y_test: int64 labels, shape ``(M,)``.
        num_classes: number of classes.
        name: dataset name, for logs.
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    name: str = ""

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def __post_init__(self) -> None:
        assert self.x_train.dtype == torch.float32 and self.x_test.dtype == torch.float32
        assert self.y_train.dtype == torch.int64 and self.y_test.dtype == torch.int64
        assert len(self.x_train) == len(self.y_train) and len(self.x_test) == len(self.y_test)
