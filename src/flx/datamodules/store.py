"""In-memory tensor store: a whole dataset as a few tensors; clients are index views into it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class TensorData:
    """A dataset loaded into memory.

    Attributes:
        x_train: inputs, shape ``(N, *input_shape)``: float32 features (images are ``(N, C, H, W)``), standardised,
            or int64 token ids (text, e.g. ``(N, L)`` character ids); never cast to the model's dtype.
        y_train: int64 labels, shape ``(N,)``.
        x_test: inputs of the global test split, shape ``(M, *input_shape)``, same dtype as ``x_train``.
        y_test: int64 labels, shape ``(M,)``.
        num_classes: number of classes.
        name: dataset name, for logs.
        groups_train: optional int64 group id of each training sample, shape ``(N,)`` (a sensitive attribute such
            as Adult's sex or race, or the LEAF user); ``partition=by_group`` splits by it.
        groups_test: optional int64 group id of each test sample, shape ``(M,)``, in the same numbering (for
            per-group evaluation); set exactly when ``groups_train`` is.
        group_names: the name of each group id (``group_names[g]``), or empty.
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int
    name: str = ""
    groups_train: Tensor | None = None
    groups_test: Tensor | None = None
    group_names: tuple[str, ...] = ()

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def __post_init__(self) -> None:
        assert self.x_train.dtype in (torch.float32, torch.int64) and self.x_test.dtype == self.x_train.dtype
        assert self.y_train.dtype == torch.int64 and self.y_test.dtype == torch.int64
        assert len(self.x_train) == len(self.y_train) and len(self.x_test) == len(self.y_test)
        assert (self.groups_train is None) == (self.groups_test is None)
        if self.groups_train is not None and self.groups_test is not None:
            assert self.groups_train.dtype == torch.int64 and self.groups_test.dtype == torch.int64
            assert self.groups_train.shape == self.y_train.shape and self.groups_test.shape == self.y_test.shape
