"""``FederatedDataModule``: one in-memory tensor store, clients as index views into it.

The train "dataloader" is the round loader of :mod:`flx.loop` (it yields client ids); local minibatches
are drawn by the federation straight from the store, so a client costs no copy and no DataLoader.
Validation iterates the VALIDATION split (``data.val_fraction`` of the training rows, carved before any
imbalance, label noise or partitioning: :mod:`flx.datamodules.protocol`) and test the global test split, in batches of
``eval_batch_size`` rows indexed from the in-memory tensors, each sharded over ranks without padding (rank ``r`` of
``N`` takes rows ``r, r + N, ...``; the metrics sum over ranks, so they are exact). Per-client metrics (``client_eval``)
ride in the same pass when each client's rows are cells of the split (its labels' or its group's rows:
:mod:`flx.datamodules.client_eval`, every row evaluated once), else in a second loader (each client's own held-out
rows).
With no validation split (``data.val_fraction=0``) the validation loop is skipped, unless ``eval_test`` adds the
test loaders to it (test curves per round, logged as ``test/*``).
The server split (``data.server_fraction``, carved after the validation split) is ``server_rows``: rows of the same
training store the clients index, held by no client; ``server_resources`` carries it to the server with its frozen
models (:mod:`flx.resources`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from flx.choices import CLIENT_EVAL
from flx.context import ClientData
from flx.datamodules.client_eval import ClientRows, EvalRows, by_cell, held_cells, holdout
from flx.datamodules.niid_bench import with_feature_noise
from flx.datamodules.partition_file import save_partition
from flx.datamodules.partitioners import REAL_TARGETS, TOKEN_TARGETS, needs_labels
from flx.datamodules.placement import HostRows, fits_on, index_bytes, rows_on
from flx.datamodules.protocol import DataProtocol, load, save_split
from flx.datamodules.ragged import Ragged
from flx.datamodules.round_loader import RoundLoader
from flx.datamodules.store import TensorData
from flx.errors import bad_value
from flx.metrics.client_summary import ClientCells

if TYPE_CHECKING:
    from flx.resources import ServerResources

UNSEEN, PARTICIPATING = "unseen", "participating"
SIDE_SPLITS = (PARTICIPATING, UNSEEN)
"""The splits of a run with unseen clients (``partition.unseen_clients``), evaluated with the test split: the
global model on the participating clients' held-out rows and on the unseen clients' rows (``participating/*``,
``unseen/*``; the participation gap of Yuan et al., ICLR 2022, is the difference)."""


class EvalLoader(NamedTuple):
    """One evaluation loader: its ``split`` (``val`` / ``test``), whether its rows feed the split's metrics
    (``overall``: batches ``(x, y, ...)``) and the per-client ones (``per_client``: the batch's last tensor is each
    row's cell, :meth:`FederatedDataModule.client_cells`)."""

    split: str
    overall: bool
    per_client: bool


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


class ClientStore(ClientData):
    """The federation's view of the training data: the store tensors and each client's row indices.

    ``num_train_clients``: the clients that train, the first ones (default: all); the others are evaluation-only
    (held-out few-shot clients, :mod:`flx.datamodules.few_shot`): their rows are what a personalised model adapts on.
    ``client_support``: each client's support rows, a subset of its rows (few-shot tasks), or ``None``.
    """

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        client_indices: Sequence[Tensor],
        num_train_clients: int | None = None,
        client_support: Sequence[Tensor] | None = None,
    ) -> None:
        self.x, self.y, self.client_indices = x, y, client_indices
        self.num_train_clients = len(client_indices) if num_train_clients is None else num_train_clients
        self.client_support = client_support

    def to(self, device: torch.device, dtype: torch.dtype, on_device: bool | None = None) -> ClientStore:
        """Places the store for a net on ``device`` (docs/loop.md, "Devices"; :mod:`flx.datamodules.placement`).

        Float inputs and real-valued targets are cast to ``dtype`` (once, not per step), integer token ids and class
        labels stay int64. On the device (``on_device``; None: when the store fits,
        :func:`~flx.datamodules.placement.fits_on`): the inputs, the targets and every client's row indices and
        support rows, moved once, so a minibatch is a gather on the device. Otherwise the inputs and targets stay in
        pinned host memory (:class:`~flx.datamodules.placement.HostRows`) with the row indices. On the CPU the row
        indices are kept as they are.
        """
        x = self.x.to(dtype=dtype if self.x.is_floating_point() else None)
        y = self.y.to(dtype=dtype if self.y.is_floating_point() else None)
        device = torch.device(device)
        if on_device is None:  # the sizes are summed only where they decide (a GPU)
            on_device = device.type != "cuda" or fits_on(device, x.nbytes + y.nbytes + index_bytes(self.client_indices))
        if not on_device:
            self.x, self.y = HostRows(x.cpu(), device), HostRows(y.cpu(), device)
            return self
        self.x, self.y = x.to(device), y.to(device)
        if device.type != "cpu":
            self.client_indices = rows_on(self.client_indices, device)
            if self.client_support is not None:
                self.client_support = rows_on(self.client_support, device)
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
        loaded: ``load(dataset, protocol)`` computed already (:mod:`flx.datamodules.prefetch`), used by ``setup``
            instead of loading again; None: ``setup`` loads.
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
        loaded: TensorData | None = None,
    ) -> None:
        super().__init__()
        if client_eval not in CLIENT_EVAL:
            raise bad_value("client_eval", client_eval, f"allowed: {', '.join(CLIENT_EVAL)}")
        self.dataset, self.partitioner, self.seed, self.eval_batch_size = dataset, partitioner, seed, eval_batch_size
        self.client_eval, self.protocol, self.eval_test = client_eval, protocol or DataProtocol(), eval_test
        self.data: TensorData | None = None
        self._loaded = loaded
        self.server_resources: ServerResources | None = None  # set by flx.run.build (flx.resources)

    def setup(self, stage: str | None = None) -> None:
        if self.data is not None:
            return
        self.data = self._loaded if self._loaded is not None else load(self.dataset, self.protocol)
        self._loaded = None
        n = self._client_pool_size()
        groups = {} if self.data.groups_train is None else {"groups": self.data.groups_train[:n].numpy()}
        self.split = self.partitioner(self._partition_labels()[:n], self.seed, **groups)
        if self.split.noise is not None:  # NIID-Bench's noise-based feature skew: each client's rows, noised once
            self.data = dataclasses.replace(self.data, x_train=with_feature_noise(self.data.x_train, self.split))
        self.server_rows = torch.arange(n, len(self.data.y_train))
        # each client's rows as int64 tensors: views into one flat tensor (the split's memory), made when asked for
        self.client_train, self.client_test = self.split.train.torch(), self.split.test.torch()
        d = self.data
        self._eval_rows = {"test": self._split_rows("test"), "val": self._split_rows("val") if d.num_val else None}
        self._has_rows = {s: r is not None and bool(r.counts().sum() > 0) for s, r in self._eval_rows.items()}
        support = None if self.split.support is None else self.split.support.torch()
        self.clients = ClientStore(
            self.data.x_train, self.data.y_train, self.client_train, self.split.num_train_clients, support
        )
        self._side = self._side_rows()

    def _side_rows(self) -> dict[str, Tensor]:
        """With unseen clients (the split's held-out ones, the last), the rows of :data:`SIDE_SPLITS` that have any:
        ``participating``, the clients that train's own held-out rows (their ``test`` rows); ``unseen``, every row of
        the unseen clients (``train`` and ``test``: none was trained on). Ascending row indices into the store."""
        split, t = self.split, self.split.num_train_clients
        if not split.num_heldout:
            return {}
        train, test = split.train, split.test
        unseen = np.concatenate([train.values[train.offsets[t] :], test.values[test.offsets[t] :]])
        rows = {PARTICIPATING: test.values[: test.offsets[t]], UNSEEN: unseen}
        return {k: torch.from_numpy(np.sort(v)) for k, v in rows.items() if len(v)}

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

    def _split_rows(self, split: str) -> EvalRows | None:
        """The per-client evaluation rows of ``split``: each client's own held-out training rows (``holdout`` on the
        test split), else the split's rows of the labels it trains on (or of its one group: ``test_group``); None:
        the split has none for anyone.

        Real-valued targets (regression) and token targets (a language model) have no labels to share: no per-client
        rows (``holdout`` on the validation split), and ``client_eval=test_labels`` stops with one line."""
        d = self.data
        if split == "test" and self.client_eval == "holdout":
            return holdout(d.x_train, d.y_train, self.client_test)
        x, y, groups = (d.x_val, d.y_val, d.groups_val) if split == "val" else (d.x_test, d.y_test, d.groups_test)
        if self.client_eval == "test_labels" and not d.class_labels:
            why = "needs class labels; with real-valued or token targets use holdout (and partition.test_fraction > 0)"
            raise bad_value("client_eval", self.client_eval, why)
        if self.client_eval != "test_group" and not d.class_labels:
            return None
        if self.client_eval != "test_group":
            return by_cell(x, y, y, held_cells(self.client_train, d.y_train))
        if d.groups_train is None or groups is None:
            why = "needs a dataset with sample groups (data=adult, data=shakespeare)"
            raise bad_value("client_eval", self.client_eval, why)
        held = held_cells(self.client_train, d.groups_train)
        counts = held.sizes()
        if (counts != 1).any():
            cid = int(np.flatnonzero(counts != 1)[0])
            why = f"client {cid} holds {counts[cid]} groups; every client must hold one (partition=by_group)"
            raise bad_value("client_eval", self.client_eval, why)
        return by_cell(x, y, groups, held)

    def has_client_rows(self, split: str) -> bool:
        """Whether ``split`` (``val`` or ``test``) has per-client evaluation rows (the side splits have none)."""
        return self._has_rows.get(split, False)

    def has_personal_rows(self, split: str) -> bool:
        """Whether ``split`` has rows to measure personalised models on: the per-client rows of ``val`` / ``test``;
        for ``unseen``, an unseen client's own held-out (``test``) rows (it adapts on its other rows)."""
        if split == UNSEEN:
            return bool(self.split.num_heldout) and len(self._unseen_query()[0]) > 0
        return self.has_client_rows(split)

    def _unseen_query(self) -> tuple[Tensor, Ragged[Tensor]]:
        """The unseen clients' ``test`` rows (store indices) and each client's positions among them, empty for the
        clients that train: what an unseen client's personalised model is measured on (few_shot: its query set)."""
        test, t = self.split.test, self.split.num_train_clients
        rows = torch.from_numpy(test.values[test.offsets[t] :])
        sizes = np.concatenate([np.zeros(t, np.int64), test.sizes()[t:]])
        return rows, Ragged.from_sizes(torch.arange(len(rows)), sizes)

    def metric_clients(self) -> dict[str, int]:
        """Per split (``val``, ``test``), how many clients its per-client metrics count: every client where the split
        has per-client rows, else 0 (no ``C``-sized counters that nothing updates: O(1) memory per client)."""
        sizes = {split: self.num_clients if self.has_client_rows(split) else 0 for split in ("val", "test")}
        return sizes | dict.fromkeys(self._side, 0)

    def client_cells(self, split: str) -> ClientCells:
        """Which cells of ``split``'s per-client rows each client holds (the loaders carry each row's cell)."""
        return self._eval_rows[split].cells

    def client_eval_data(self, split: str) -> ClientRows:
        """Each client's evaluation rows of ``split`` (``val`` or ``test``) as ``(x, y)``: the rows its per-client
        metrics use (``client_eval``), e.g. for the personalised evaluation; for ``unseen``, the unseen clients' own
        held-out rows (:meth:`has_personal_rows`)."""
        if split == UNSEEN:
            rows, per_client = self._unseen_query()
            return ClientRows(self.data.x_train[rows], self.data.y_train[rows], per_client)
        rows = self._eval_rows[split]
        if rows is None:
            x, y = (self.data.x_val, self.data.y_val) if split == "val" else (self.data.x_test, self.data.y_test)
            return ClientRows(x[:0], y[:0], [])
        return rows.clients()

    def train_dataloader(self) -> RoundLoader:
        return RoundLoader()

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """A training "batch" is the round's tuple of client ids (:class:`~flx.datamodules.round_loader.RoundLoader`):
        nothing to move (saves Lightning's generic collection walk); evaluation batches (tensors) move as Lightning
        moves them."""
        if isinstance(batch, tuple) and all(isinstance(c, int) for c in batch):
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _rank_rows(self, n: int) -> Tensor:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return torch.arange(rank, n, world)

    def _split_loaders(self, split: str) -> list[TensorBatches]:
        """The loaders of ``split`` (``val`` or ``test``) in :meth:`eval_plan` order: ``(x, y)`` of the split, with
        each row's cell when the per-client rows are the split's own, else followed by ``(x, y, cell)`` of them."""
        d, rows, size = self.data, self._eval_rows[split], self.eval_batch_size
        x, y = (d.x_val, d.y_val) if split == "val" else (d.x_test, d.y_test)
        if not self.has_client_rows(split):
            return [TensorBatches((x, y), size, self._rank_rows(len(y)))]
        if rows.shared:
            return [TensorBatches((x, y, rows.cell), size, self._rank_rows(len(y)))]
        per_client = TensorBatches((rows.x, rows.y, rows.cell), size, self._rank_rows(len(rows.y)))
        return [TensorBatches((x, y), size, self._rank_rows(len(y))), per_client]

    def eval_plan(self, stage: str) -> list[EvalLoader]:
        """What each loader of the ``val`` or ``test`` stage feeds, in dataloader-index order."""
        splits = ["test"] if stage == "test" else (["val"] if self.data.num_val else []) + ["test"] * self.eval_test
        plan = []
        for split in splits:
            if not self.has_client_rows(split):
                plan.append(EvalLoader(split, True, False))
            elif self._eval_rows[split].shared:
                plan.append(EvalLoader(split, True, True))
            else:
                plan += [EvalLoader(split, True, False), EvalLoader(split, False, True)]
        if "test" in splits:  # the unseen clients are measured wherever the test split is
            plan += [EvalLoader(side, True, False) for side in self._side]
        return plan

    def val_dataloader(self) -> list[TensorBatches]:
        """The validation split's loaders (and the test split's with ``eval_test``); empty: the loop is skipped."""
        loaders = self._split_loaders("val") if self.data.num_val else []
        return loaders + (self.test_dataloader() if self.eval_test else [])

    def test_dataloader(self) -> list[TensorBatches]:
        """The test split's loaders, then the side splits' (:meth:`_side_rows`): rows of the training store."""
        d, size = self.data, self.eval_batch_size
        side = [TensorBatches((d.x_train, d.y_train), size, r[self._rank_rows(len(r))]) for r in self._side.values()]
        return self._split_loaders("test") + side
