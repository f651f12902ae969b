"""Per-client evaluation sets: each client's own holdout, or the global test rows of its labels / its group."""

from __future__ import annotations

import pytest
import torch
from helpers import raises_one_line

from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.datasets import digits
from flx.datamodules.partitioners import IID, ByGroup, OneClass
from flx.datamodules.store import TensorData


def _eval_rows(dm: FederatedDataModule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y, owner) of the per-client loader of the test split, all batches concatenated."""
    batches = list(dm.test_dataloader()[1])
    return tuple(torch.cat([b[i] for b in batches]) for i in range(3))


def test_test_labels_is_per_class_accuracy_for_one_class_per_client() -> None:
    """One class per client: client c is evaluated on exactly the global test rows of class c."""
    dm = FederatedDataModule(digits, OneClass(num_clients=10), client_eval="test_labels", eval_batch_size=64)
    dm.setup("fit")
    x, y, owner = _eval_rows(dm)
    assert torch.equal(y, owner)
    for c in range(10):
        expected = dm.data.x_test[dm.data.y_test == c]
        assert torch.equal(x[owner == c], expected)
    assert len(y) == len(dm.data.y_test)


def _grouped(n_train: int = 40, n_test: int = 12) -> TensorData:
    g = torch.Generator().manual_seed(0)
    return TensorData(
        torch.randn(n_train, 3, generator=g),
        torch.randint(0, 2, (n_train,), generator=g),
        torch.randn(n_test, 3, generator=g),
        torch.randint(0, 2, (n_test,), generator=g),
        num_classes=2,
        groups_train=torch.arange(n_train) % 2,
        groups_test=torch.arange(n_test) % 2,
        group_names=("a", "b"),
    )


def test_test_group_gives_each_client_its_groups_test_rows() -> None:
    """by_group with 2 clients per group: both clients of group g are evaluated on all test rows of group g."""
    data = _grouped()
    dm = FederatedDataModule(data, ByGroup(num_clients=4), client_eval="test_group")
    dm.setup("fit")
    x, y, owner = _eval_rows(dm)
    for c in range(4):
        group = int(data.groups_train[dm.client_train[c]][0])
        assert torch.equal(x[owner == c], data.x_test[data.groups_test == group])
        assert torch.equal(y[owner == c], data.y_test[data.groups_test == group])


@pytest.mark.parametrize(
    ("data", "partitioner", "match"),
    [
        (digits, OneClass(num_clients=10), "client_eval='test_group': needs a dataset with sample groups"),
        (_grouped(), IID(num_clients=2), "client 0 holds 2 groups"),
    ],
)
def test_test_group_errors_are_one_line(data, partitioner, match: str) -> None:
    dm = FederatedDataModule(data, partitioner, client_eval="test_group")
    raises_one_line(dm.setup, "fit", match=match)


def test_unknown_mode_is_one_line() -> None:
    raises_one_line(FederatedDataModule, digits, IID(num_clients=2), client_eval="train", match="client_eval='train'")
