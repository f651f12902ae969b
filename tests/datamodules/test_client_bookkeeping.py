"""The bookkeeping of a client that no round samples costs a few bytes: a stateless run's datamodule, federation and
module for 1,000,000 clients hold no object per client, only flat per-client arrays (offsets, counters).

Measured deterministically, not timed: the memory that stays allocated after building (and running a round) with 100
clients and with 1,000,000 clients on the same data, as Python and numpy allocations (``tracemalloc``) plus the
storage of every live torch tensor (torch's CPU allocator is not traced); the difference over the extra clients is the
per-client cost. Each client's rows are one int64 offset per split (train, test); the held-out evaluation's cells
three more. One numpy array per client was ~100 bytes, one tensor ~400, a list of both per split ~1.8 KB.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from helpers import linear, make_fed, run_rounds

from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.partitioners import IID
from flx.datamodules.store import TensorData
from flx.module import FederatedModule

ROWS = 1_000_000
MANY = 1_000_000
BUDGET = 64
"""Bytes per client allowed (measured: 40, the offsets of train and test rows and the evaluation cells)."""


def _data(rows: int = ROWS) -> TensorData:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(rows + 10, 2, generator=g), torch.randint(0, 2, (rows + 10,), generator=g)
    return TensorData(x[:rows], y[:rows], x[rows:], y[rows:], num_classes=2, name="toy")


def _torch_bytes() -> int:
    """Bytes of the storages of the live torch tensors (each storage once)."""
    storages = {}
    for obj in gc.get_objects():
        if (
            issubclass(type(obj), torch.Tensor) and not obj.is_meta
        ):  # type(): no __class__ lookup (deprecated objects warn)
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _retained(build: Callable[[], Any]) -> int:
    """Bytes allocated by ``build`` and still held while its result is alive."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] + _torch_bytes()
    kept = build()
    gc.collect()
    after = tracemalloc.get_traced_memory()[0] + _torch_bytes()
    tracemalloc.stop()
    del kept
    return after - before


def _stateless_run(data: TensorData, num_clients: int) -> tuple[Any, ...]:
    """The datamodule (IID split, no test fraction), a federation that trains one round of 4 clients, the module."""
    dm = FederatedDataModule(data, IID(num_clients))
    dm.setup("fit")
    fed = make_fed(linear(2, 2), dm.clients, loss_fn=F.cross_entropy, clients_per_round=4, local_steps=1)
    run_rounds(fed, 1)
    module = FederatedModule(fed.net, fed.spec, 2, dm.metric_clients())
    return dm, fed, module


def test_an_unsampled_client_costs_a_few_bytes() -> None:
    data = _data()
    few = _retained(lambda: _stateless_run(data, 100))
    many = _retained(lambda: _stateless_run(data, MANY))
    per_client = (many - few) / (MANY - 100)
    assert per_client < BUDGET, f"{per_client:.1f} bytes per client"


def test_per_client_metrics_only_where_a_split_has_per_client_rows() -> None:
    data = _data(5000)
    dm = FederatedDataModule(data, IID(1000))
    dm.setup("fit")
    assert dm.metric_clients() == {"val": 0, "test": 0}
    held = FederatedDataModule(data, IID(1000, test_fraction=0.5))
    held.setup("fit")
    assert held.metric_clients() == {"val": 0, "test": 1000}
    module = FederatedModule(linear(2, 2), make_fed(linear(2, 2), held.clients).spec, 2, held.metric_clients())
    assert module.metrics["test"].client.correct.numel() == 1000 and module.metrics["val"].client.correct.numel() == 0
