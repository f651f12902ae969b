"""``FederatedDataModule``: one in-memory tensor store, clients as index views into it.

The train "dataloader" is the round loader of :mod:`flx.loop` (it yields client ids); local minibatches
are drawn by the federation straight from the store, so a client costs no copy and no DataLoader.
Validation iterates the VALIDATION split (``data.val_fraction`` of the training rows, carved before any
imbalance, label noise or partitioning: :mod:`flx.datamodules.protocol`) and test the global test split, each
sharded over ranks without padding (so metrics are exact), each followed by a per-client loader (``client_eval``).
With no validation split (``data.val_fraction=0``) the validation loop is skipped, unless ``eval_test`` adds the
test loaders to it (test curves per round, logged as ``test/*``).
The server split (``data.server_fraction``, carved after the validation split) is ``server_rows``: rows of the same
training store the clients index, held by no client; ``server_resources`` carries it to the server with its frozen
models (:mod:`flx.resources`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from flx.config import CLIENT_EVAL
from flx.datamodules.partition_file import save_partition
from flx.datamodules.partitioners import REAL_TARGETS, TOKEN_TARGETS, needs_labels
from flx.datamodules.protocol import DataProtocol, load, save_split
from flx.datamodules.store import TensorData
from flx.errors import bad_value
from flx.loop import RoundLoader

if TYPE_CHECKING:
    from flx.resources import ServerResources


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
    """The federation's view of the training data: the store tensors and each client's row indices.

    ``num_train_clients``: the clients that train, the first ones (default: all); the others are evaluation-only
    (held-out few-shot clients, :mod:`flx.datamodules.few_shot`): their rows are what a personalised model adapts on.
    ``client_support``: each client's support rows, a subset of its rows (few-shot tasks), or ``None``.
    """

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        client_indices: list[Tensor],
        num_train_clients: int | None = None,
        client_support: list[Tensor] | None = None,
    ) -> None:
        self.x, self.y, self.client_indices = x, y, client_indices
        self.num_train_clients = len(client_indices) if num_train_clients is None else num_train_clients
        self.client_support = client_support

    def to(self, device: torch.device, dtype: torch.dtype) -> ClientStore:
        """Moves the store to ``device``; float inputs and real-valued targets are cast to ``dtype`` (once, not per
        step), integer token ids and class labels stay int64."""
        x_dtype = dtype if self.x.is_floating_point() else None
        y_dtype = dtype if self.y.is_floating_point() else None
        self.x, self.y = self.x.to(device=device, dtype=x_dtype), self.y.to(device=device, dtype=y_dtype)
        return self


class FederatedDataModule(pl.LightningDataModule):
    """Loads a dataset once, partitions its train split over clients, serves the federated loaders.

    Args:
        dataset: a callable returning :class:`TensorData` (a Hydra partial of a loader in
            :mod:`flx.datamodules.datasets`), or the data itself.
        partitioner: a callable ``(labels, seed) -> ClientSplit`` (see :mod:`flx.datamodules.partitioners`); when
            the data has sample groups (``TensorData.groups_train``) it is called as ``(labels, seed, groups=...)``.
        seed: the run's seed, used by a partitioner without a seed of its own (``partition.seed=null``).
        eval_batch_size: batch size of validation/test loaders.
        client_eval: what each client's accuracy (``*/client_acc_*``) is measured on: ``holdout`` (its own test
            split, ``partition.test_fraction``), ``test_labels`` (the global test rows of the labels it trains on:
            per-class accuracy for one class per client) or ``test_group`` (the global test rows of its sample
            group, e.g. Adult's sex or race; every client must hold one group). On the validation split a client
            is measured on the validation rows of its labels (``holdout``, ``test_labels``) or of its group.
        protocol: the ``data.*`` protocol (validation carve, split file, standardisation); default: no
            validation split, standardised.
        eval_test: also evaluate the test split in every validation loop (``test/*`` curves); never select on it.
    """

    def __init__(
        self,
        dataset: Callable[[], TensorData] | TensorData,
        partitioner: Callable[..., Any],
        seed: int = 0,
        eval_batch_size: int = 1024,
        client_eval: str = "holdout",
        protocol: DataProtocol | None = None,
        eval_test: bool = False,
    ) -> None:
        super().__init__()
        if client_eval not in CLIENT_EVAL:
            raise bad_value("client_eval", client_eval, f"allowed: {', '.join(CLIENT_EVAL)}")
        self.dataset, self.partitioner, self.seed, self.eval_batch_size = dataset, partitioner, seed, eval_batch_size
        self.client_eval, self.protocol, self.eval_test = client_eval, protocol or DataProtocol(), eval_test
        self.data: TensorData | None = None
        self.server_resources: ServerResources | None = None  # set by flx.run.build (flx.resources)

    def setup(self, stage: str | None = None) -> None:
        if self.data is not None:
            return
        self.data = load(self.dataset, self.protocol)
        n = self._client_pool_size()
        groups = {} if self.data.groups_train is None else {"groups": self.data.groups_train[:n].numpy()}
        self.split = self.partitioner(self._partition_labels()[:n], self.seed, **groups)
        self.server_rows = torch.arange(n, len(self.data.y_train))
        self.client_train = [torch.as_tensor(a, dtype=torch.long) for a in self.split.train]
        self.client_test = [torch.as_tensor(a, dtype=torch.long) for a in self.split.test]
        d = self.data
        self._client_rows = {"test": self._client_test_rows(d.y_test, d.groups_test)}
        self._client_rows["val"] = self._global_rows(d.y_val, d.groups_val) if d.num_val else []
        support = None if self.split.support is None else [torch.as_tensor(a) for a in self.split.support]
        self.clients = ClientStore(
            self.data.x_train, self.data.y_train, self.client_train, self.split.num_train_clients, support
        )

    def _client_pool_size(self) -> int:
        """The client-side training rows (the partitioner's input), checked to leave a row for every client."""
        n, clients = self.data.num_client_rows, getattr(self.partitioner, "num_clients", 0)
        if self.data.num_server and n < clients:
            p = self.protocol
            why = f"leaves {n} client-side training rows for {clients} clients (partition.num_clients)"
            if p.split_file:
                raise bad_value("data.split_file", p.split_file, f"its 'server' list {why}; list fewer server rows")
            raise bad_value("data.server_fraction", p.server_fraction, f"{why}; lower it")
        return n

    def _partition_labels(self) -> np.ndarray:
        """The training labels the partitioner splits by. Real-valued and token targets have none: zeros stand in for
        them for a scheme that ignores labels (``uses_labels`` false: iid, quantity_skew, ...); any other stops with one
        line."""
        if self.data.class_labels:
            return self.data.y_train.numpy()
        if getattr(self.partitioner, "uses_labels", True):
            has = TOKEN_TARGETS if self.data.token_targets else REAL_TARGETS
            raise needs_labels(getattr(self.partitioner, "name", type(self.partitioner).__name__), self.data.name, has)
        return np.zeros(len(self.data.y_train), dtype=np.int64)

    def save(self, folder: str) -> None:
        """Writes ``data_split.json`` (pool ids of train / val / test / server, before any imbalance subsample: the
        ``data.split_file`` format) and ``partition.json`` (each client's rows: the ``partition=from_file`` format)."""
        if self.data is not None and self.data.rows is not None:
            save_split(f"{folder}/data_split.json", self.data.rows)
        save_partition(f"{folder}/partition.json", self.split)

    @property
    def num_clients(self) -> int:
        return len(self.client_train)

    def _client_test_rows(self, y: Tensor, groups: Tensor | None) -> list[Tensor]:
        """Per client, its own held-out training rows (``holdout``) or the test rows of its labels / group."""
        return self.client_test if self.client_eval == "holdout" else self._global_rows(y, groups)

    def _global_rows(self, y: Tensor, groups: Tensor | None) -> list[Tensor]:
        """Per client, the rows of a global split (``y``, ``groups``) that share its labels (or its one group).

        Real-valued targets (regression) and token targets (a language model) have no labels to share: no per-client
        rows (``holdout`` on the validation split), and ``client_eval=test_labels`` stops with one line."""
        d = self.data
        if self.client_eval == "test_labels" and not d.class_labels:
            why = "needs class labels; with real-valued or token targets use holdout (and partition.test_fraction > 0)"
            raise bad_value("client_eval", self.client_eval, why)
        if self.client_eval != "test_group" and not d.class_labels:
            return []
        if self.client_eval != "test_group":
            return [torch.isin(y, d.y_train[rows].unique()).nonzero().flatten() for rows in self.client_train]
        if d.groups_train is None or groups is None:
            why = "needs a dataset with sample groups (data=adult, data=shakespeare)"
            raise bad_value("client_eval", self.client_eval, why)
        out = []
        for cid, rows in enumerate(self.client_train):
            held = d.groups_train[rows].unique()
            if len(held) != 1:
                why = f"client {cid} holds {len(held)} groups; every client must hold one (partition=by_group)"
                raise bad_value("client_eval", self.client_eval, why)
            out.append((groups == held[0]).nonzero().flatten())
        return out

    def has_client_rows(self, split: str) -> bool:
        """Whether ``split`` (``val`` or ``test``) has per-client evaluation rows."""
        return sum(len(t) for t in self._client_rows[split]) > 0

    def client_eval_data(self, split: str) -> list[tuple[Tensor, Tensor]]:
        """Each client's evaluation rows of ``split`` (``val`` or ``test``) as ``(x, y)``: the rows its per-client
        metrics use (``client_eval``), e.g. for the personalised evaluation."""
        x, y = self._client_source(split)
        return [(x[rows], y[rows]) for rows in self._client_rows[split]]

    def _client_source(self, split: str) -> tuple[Tensor, Tensor]:
        """The tensors the per-client rows of ``split`` index: the split's, or the training rows for the holdout."""
        d = self.data
        if split == "test" and self.client_eval == "holdout":
            return d.x_train, d.y_train
        return (d.x_val, d.y_val) if split == "val" else (d.x_test, d.y_test)

    def train_dataloader(self) -> RoundLoader:
        return RoundLoader()

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """A training "batch" is a client id: nothing to move (saves Lightning's generic collection walk)."""
        return batch if isinstance(batch, int) else super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _rank_rows(self, n: int) -> Tensor:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return torch.arange(rank, n, world)

    def _split_loaders(self, split: str) -> list[TensorBatches]:
        """The global loader of ``split`` (``val`` or ``test``), then its per-client loader if it has one."""
        d = self.data
        x, y = (d.x_val, d.y_val) if split == "val" else (d.x_test, d.y_test)
        loaders = [TensorBatches((x, y), self.eval_batch_size, self._rank_rows(len(y)))]
        if self.has_client_rows(split):
            per_client = self._client_rows[split]
            rows = torch.cat(per_client)
            owner = torch.cat([torch.full((len(t),), c, dtype=torch.long) for c, t in enumerate(per_client)])
            x, y = self._client_source(split)
            loaders.append(TensorBatches((x[rows], y[rows], owner), self.eval_batch_size, self._rank_rows(len(rows))))
        return loaders

    def eval_plan(self, stage: str) -> list[tuple[str, bool]]:
        """``(split, per_client)`` of each loader of the ``val`` or ``test`` stage, in dataloader-index order."""
        splits = ["test"] if stage == "test" else (["val"] if self.data.num_val else []) + ["test"] * self.eval_test
        return [(split, k == 1) for split in splits for k in range(1 + self.has_client_rows(split))]

    def val_dataloader(self) -> list[TensorBatches]:
        """The validation split's loaders (and the test split's with ``eval_test``); empty: the loop is skipped."""
        loaders = self._split_loaders("val") if self.data.num_val else []
        return loaders + (self._split_loaders("test") if self.eval_test else [])

    def test_dataloader(self) -> list[TensorBatches]:
        return self._split_loaders("test")
