"""The few-shot partition (``partition=few_shot``, AugFL §VI-A): client sizes, classes, support/query sets, held-out
clients, and how the datamodule, the federation and ``algo.clients_per_round=all`` use them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import linear, make_fed, raises_one_line

from flx.config import precheck
from flx.datamodules.datamodule import ClientStore, FederatedDataModule
from flx.datamodules.few_shot import FewShot
from flx.datamodules.store import TensorData
from flx.errors import ConfigError
from flx.run import federation_config

LABELS = np.repeat(np.arange(10), 200)  # 10 classes x 200 rows


def _split(**kw):
    kw = {"num_clients": 40, "classes_per_client": 2, "samples_min": 20} | kw
    return FewShot(**kw)(LABELS, seed=3)


def test_clients_hold_k_classes_and_u_m_2m_rows_and_no_row_twice() -> None:
    split = _split()
    rows = [np.union1d(tr, te) for tr, te in zip(split.train, split.test)]
    flat = np.concatenate(rows)
    assert len(flat) == len(np.unique(flat))  # no row in two clients
    for part in rows:
        assert 20 <= len(part) <= 40
        classes, counts = np.unique(LABELS[part], return_counts=True)
        assert len(classes) == 2 and counts.max() - counts.min() <= 1  # D_i split about evenly over its k classes
    sizes = [len(p) for p in rows]
    assert min(sizes) < 25 and max(sizes) > 35  # uniform over [M, 2M], not a constant


def test_support_and_query_and_heldout_clients() -> None:
    """The last round(0.2 N) clients are held out: train = support, test = query; a training client trains on both
    (train = its rows, no test rows); support is round(0.5 D_i) of the client's rows in both cases."""
    split = _split(support_fraction=0.5, heldout_fraction=0.2)
    assert split.num_heldout == 8 and split.num_train_clients == 32
    for cid in range(40):
        rows = np.union1d(split.train[cid], split.test[cid])
        support = split.support[cid]
        assert len(support) == math.floor(0.5 * len(rows) + 0.5) and np.isin(support, rows).all()
        if cid < 32:
            np.testing.assert_array_equal(split.train[cid], rows)
            assert len(split.test[cid]) == 0
        else:
            np.testing.assert_array_equal(split.train[cid], support)
            np.testing.assert_array_equal(split.test[cid], np.setdiff1d(rows, support))


def test_same_seed_same_clients_and_no_heldout_option() -> None:
    a, b = _split(), _split()
    assert all(np.array_equal(x, y) for x, y in zip(a.train + a.support, b.train + b.support))
    assert _split(heldout_fraction=0.0).num_heldout == 0


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"test_fraction": 0.2}, "partition.test_fraction"),
        ({"support_fraction": 1.0}, "partition.support_fraction"),
        ({"heldout_fraction": 0.99}, "partition.heldout_fraction"),
        ({"classes_per_client": 11}, "partition.classes_per_client"),
        ({"num_clients": 200}, "partition.num_clients"),  # 200 x ~30 rows > 2000
        ({"samples_min": 1}, "partition.samples_min"),
    ],
)
def test_bad_values_stop_with_one_line(kw: dict, key: str) -> None:
    raises_one_line(_split, match=key, **kw)


def _datamodule() -> FederatedDataModule:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2000, 3, generator=g), torch.as_tensor(LABELS)
    data = TensorData(x_train=x, y_train=y, x_test=x[:10], y_test=y[:10], num_classes=10, name="toy")
    dm = FederatedDataModule(data, FewShot(num_clients=10, samples_min=10, heldout_fraction=0.3))
    dm.setup()
    return dm


def test_the_federation_trains_only_the_training_clients_and_splits_support_and_query() -> None:
    dm = _datamodule()
    store: ClientStore = dm.clients
    assert store.num_train_clients == 7 and len(store.client_indices) == 10
    fed = make_fed(linear(3, 10), store, clients_per_round=7, local_steps=1, batch_size=4)
    assert fed.num_clients == 7
    seen = []
    for r in range(3):
        rnd = fed.begin_round(r)
        seen += list(rnd.cohort)
        for cid in rnd.shard:
            fed.train_client(cid)
        fed.end_round()
    assert sorted(set(seen)) == list(range(7))
    for cid in range(10):
        rows, s, q = store.client_indices[cid], fed.data.support_rows(cid), fed.data.query_rows(cid)
        if cid < 7:  # a training client: support and query split its rows
            assert sorted(torch.cat([s, q]).tolist()) == sorted(rows.tolist()) and len(s) and len(q)
        else:  # held out: its rows are its support set; the query set is its per-client test split
            assert torch.equal(s, rows) and len(q) == 0 and len(dm.client_test[cid])
    assert dm.has_client_rows("test") and all(len(dm.client_test[c]) == 0 for c in range(7))


def test_clients_per_round_all_is_every_training_client(tmp_path) -> None:
    base = ["partition=few_shot", "partition.num_clients=20", f"paths.output_dir={tmp_path}"]
    cfg = precheck([*base, "algo.clients_per_round=all"])
    assert federation_config(cfg, 16).clients_per_round == 16
    with pytest.raises(
        ConfigError, match=r"algo.clients_per_round=17: must be <= the number of training clients \(16\)"
    ):
        precheck([*base, "algo.clients_per_round=17"])


def test_a_store_without_a_support_split_supports_on_all_rows() -> None:
    """Without ``client_support`` a client's support rows are all its rows and its query rows none; with one, the
    support rows are the given subset and the query rows the rest, in the client's order."""
    rows = [torch.tensor([4, 0, 2]), torch.tensor([1, 3])]
    x, y = torch.zeros(5, 2), torch.zeros(5, dtype=torch.long)
    plain = ClientStore(x, y, rows)
    assert torch.equal(plain.support_rows(0), rows[0]) and len(plain.query_rows(0)) == 0
    split = ClientStore(x, y, rows, client_support=[torch.tensor([2]), torch.tensor([3])])
    assert split.support_rows(0).tolist() == [2] and split.query_rows(0).tolist() == [4, 0]
    assert split.query_rows(1).tolist() == [1]
