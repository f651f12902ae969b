"""In-memory tensor store: a whole dataset as a few tensors; clients are index views into it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass
class TensorData:
    """A dataset loaded into memory.

    Attributes:
        x_train: inputs, shape ``(N, *input_shape)``: float32 features (images are ``(N, C, H, W)``), standardised,
            or int64 token ids (text, e.g. ``(N, L)`` character ids); float64 where a generator is asked for it
            (``data.dtype``, :mod:`flx.datamodules.pfedfbe_data`). Cast to the model's dtype by the client store.
        y_train: int64 class labels, shape ``(N,)``, or float32 (float64 with float64 inputs) real-valued targets
            (regression, e.g. ``data=diabetes``), shape ``(N,)`` or ``(N, K)``: see :attr:`real_targets`; or int64
            token targets ``(N, L)``, one id per input position and ``-100`` where nothing is scored (a masked
            language model, ``data=wikitext2``): see :attr:`token_targets`.
        x_test: inputs of the global test split, shape ``(M, *input_shape)``, same dtype as ``x_train``.
        y_test: targets of the global test split, shape ``(M, ...)``, same dtype as ``y_train``.
        num_classes: number of classes; 0 for real-valued targets.
        name: dataset name, for logs.
        groups_train: optional int64 group id of each training sample, shape ``(N,)`` (a sensitive attribute such
            as Adult's sex or race, or the LEAF user); ``partition=by_group`` splits by it.
        groups_test: optional int64 group id of each test sample, shape ``(M,)``, in the same numbering (for
            per-group evaluation); set exactly when ``groups_train`` is.
        group_names: the name of each group id (``group_names[g]``), or empty.
        x_val, y_val, groups_val: the validation split (rows carved from the training split by
            :func:`flx.datamodules.protocol.carve`), or ``None`` when the data have not been carved.
        rows: after the carve, the pool ids (training rows ``0..N-1``, then test rows ``N..``) of each split
            (``train``: the client-side rows, ``val``, ``test``, ``server``), before any imbalance subsample; ``None``
            before.
        num_server: the server split (``data.server_fraction``): the LAST ``num_server`` rows of ``x_train`` /
            ``y_train`` (/ ``groups_train``). No client holds them and the partitioner never sees them; the clients'
            rows are the first :attr:`num_client_rows`.
        truth: for generated data with a known model, the ground-truth weights of each sample group, shape
            ``(G, *weight_shape)``, indexed by the group ids of ``groups_train`` / ``groups_test`` (pFedFBE's Lasso:
            ``(30, 1024)``; matrix completion: ``(30, 32, 32)``); ``None`` for real data. Kept through the carve.
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
    x_val: Tensor | None = None
    y_val: Tensor | None = None
    groups_val: Tensor | None = None
    rows: dict[str, np.ndarray] | None = None
    num_server: int = 0
    truth: Tensor | None = None

    @property
    def num_client_rows(self) -> int:
        """Training rows on the client side (partitioned over the clients): the first rows of ``x_train``."""
        return len(self.y_train) - self.num_server

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def __post_init__(self) -> None:
        assert (
            self.x_train.dtype in (torch.float32, torch.float64, torch.int64)
            and self.x_test.dtype == self.x_train.dtype
        )
        assert (
            self.y_train.dtype in (torch.int64, torch.float32, torch.float64)
            and self.y_test.dtype == self.y_train.dtype
        )
        assert len(self.x_train) == len(self.y_train) and len(self.x_test) == len(self.y_test)
        assert 0 <= self.num_server <= len(self.y_train)
        assert (self.groups_train is None) == (self.groups_test is None)
        assert self.truth is None or self.groups_train is not None  # one truth per sample group
        if self.groups_train is not None and self.groups_test is not None:
            assert self.groups_train.dtype == torch.int64 and self.groups_test.dtype == torch.int64
            assert self.groups_train.shape == self.y_train.shape and self.groups_test.shape == self.y_test.shape
        if self.x_val is not None and self.y_val is not None:
            assert self.x_val.dtype == self.x_train.dtype and self.y_val.dtype == self.y_train.dtype
            assert len(self.x_val) == len(self.y_val)
            assert (self.groups_val is None) == (self.groups_train is None)

    @property
    def real_targets(self) -> bool:
        """Whether the targets are real numbers (float32 or float64: regression) rather than int64 class labels."""
        return self.y_train.is_floating_point()

    @property
    def token_targets(self) -> bool:
        """Whether the targets are int64 token ids ``(N, L)`` (a masked language model), not one label per row."""
        return not self.real_targets and self.y_train.dim() == 2

    @property
    def class_labels(self) -> bool:
        """Whether the targets are one int64 class label per row: what a carve or a partition can stratify by."""
        return not self.real_targets and not self.token_targets

    @property
    def num_val(self) -> int:
        """Rows of the validation split (0 when there is none)."""
        return 0 if self.y_val is None else len(self.y_val)
