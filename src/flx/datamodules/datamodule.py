"""``FederatedDataModule``: one in-memory tensor store, clients as index views into it.

The train "dataloader" is the round loader of :mod:`flx.loop` (it yields client ids); local minibatches
are drawn by the federation straight from the store, so a client costs no copy and no DataLoader.
Validation/test iterate the global test split (sharded over ranks without padding, so metrics are exact)
and, when the partitioner keeps per-client test splits, every client's own test samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from flx.config import CLIENT_EVAL
from flx.datamodules.store import TensorData
from flx.errors import bad_value
from flx.loop import RoundLoader


class TensorBatches:
    """Minibatches of rows of a few aligned tensors, in order (an evaluation loader with a length)."""

    def __init__(self, tensors: tuple[Tensor, ...], batch_size: int, rows: Tensor | None = None) -> None:
        self.tensors, self.batch_size = tensors, batch_size
        self.rows = torch.arange(len(tensors[0])) if rows is None else rows

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        for b in self.rows.split(self.batch_size):
            yield tuple(t[b] for t in self.tensors)


class ClientStore:
    """The federation's view of the training data: the store tensors and each client's row indices."""

    def __init__(self, x: Tensor, y: Tensor, client_indices: list[Tensor]) -> None:
        self.x, self.y, self.client_indices = x, y, client_indices

    def to(self, device: torch.device, dtype: torch.dtype) -> ClientStore:
        """Moves the store to ``device``; float inputs are cast to ``dtype``, integer token ids stay int64."""
        x_dtype = dtype if self.x.is_floating_point() else None
        self.x, self.y = self.x.to(device=device, dtype=x_dtype), self.y.to(device)
        return self


class FederatedDataModule(pl.LightningDataModule):
    """Loads a dataset once, partitions its train split over clients, serves the federated loaders.

    Args:
        dataset: a callable returning :class:`TensorData` (a Hydra partial of a loader in
            :mod:`flx.datamodules.datasets`), or the data itself.
        partitioner: a callable ``(labels, seed) -> ClientSplit`` (see :mod:`flx.datamodules.partitioners`); when
            the data has sample groups (``TensorData.groups_train``) it is called as ``(labels, seed, groups=...)``.
        seed: partition seed.
        eval_batch_size: batch size of validation/test loaders.
        client_eval: what each client's accuracy (``*/client_acc_*``) is measured on: ``holdout`` (its own test
            split, ``partition.test_fraction``), ``test_labels`` (the global test rows of the labels it trains on:
            per-class accuracy for one class per client) or ``test_group`` (the global test rows of its sample
            group, e.g. Adult's sex or race; every client must hold one group).
    """

    def __init__(
        self,
        dataset: Callable[[], TensorData] | TensorData,
        partitioner: Callable[..., Any],
        seed: int = 0,
        eval_batch_size: int = 1024,
        client_eval: str = "holdout",
    ) -> None:
        super().__init__()
        if client_eval not in CLIENT_EVAL:
            raise bad_value("client_eval", client_eval, f"allowed: {', '.join(CLIENT_EVAL)}")
        self.dataset, self.partitioner, self.seed, self.eval_batch_size = dataset, partitioner, seed, eval_batch_size
        self.client_eval = client_eval
        self.data: TensorData | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.data is not None:
            return
        self.data = self.dataset if isinstance(self.dataset, TensorData) else self.dataset()
        groups = {} if self.data.groups_train is None else {"groups": self.data.groups_train.numpy()}
        split = self.partitioner(self.data.y_train.numpy(), self.seed, **groups)
        self.client_train = [torch.as_tensor(a, dtype=torch.long) for a in split.train]
        self.client_test = [torch.as_tensor(a, dtype=torch.long) for a in split.test]
        self._client_eval_rows = self.client_test if self.client_eval == "holdout" else self._global_test_rows()
        self.clients = ClientStore(self.data.x_train, self.data.y_train, self.client_train)

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    def _global_test_rows(self) -> list[Tensor]:
        """Per client, the rows of the GLOBAL test split that share its labels (or its one sample group)."""
        d = self.data
        if self.client_eval == "test_labels":
            return [torch.isin(d.y_test, d.y_train[rows].unique()).nonzero().flatten() for rows in self.client_train]
        if d.groups_train is None:
            why = "needs a dataset with sample groups (data=adult, data=shakespeare)"
            raise bad_value("client_eval", self.client_eval, why)
        out = []
        for cid, rows in enumerate(self.client_train):
            groups = d.groups_train[rows].unique()
            if len(groups) != 1:
                why = f"client {cid} holds {len(groups)} groups; every client must hold one (partition=by_group)"
                raise bad_value("client_eval", self.client_eval, why)
            out.append((d.groups_test == groups[0]).nonzero().flatten())
        return out

    @property
    def has_client_test(self) -> bool:
        return sum(len(t) for t in self._client_eval_rows) > 0

    def train_dataloader(self) -> RoundLoader:
        return RoundLoader()

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """A training "batch" is a client id: nothing to move (saves Lightning's generic collection walk)."""
        return batch if isinstance(batch, int) else super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _rank_rows(self, n: int) -> Tensor:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return torch.arange(rank, n, world)

    def _eval_loaders(self) -> list[TensorBatches]:
        d = self.data
        loaders = [TensorBatches((d.x_test, d.y_test), self.eval_batch_size, self._rank_rows(len(d.y_test)))]
        if self.has_client_test:
            per_client = self._client_eval_rows
            rows = torch.cat(per_client)
            owner = torch.cat([torch.full((len(t),), c, dtype=torch.long) for c, t in enumerate(per_client)])
            x, y = (d.x_train, d.y_train) if self.client_eval == "holdout" else (d.x_test, d.y_test)
            tensors = (x[rows], y[rows], owner)
            loaders.append(TensorBatches(tensors, self.eval_batch_size, self._rank_rows(len(rows))))
        return loaders

    def val_dataloader(self) -> list[TensorBatches]:
        return self._eval_loaders()

    def test_dataloader(self) -> list[TensorBatches]:
        return self._eval_loaders()
