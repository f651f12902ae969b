"""Per-client evaluation sets: each client's own holdout, or the global test rows of its labels / its group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import linear, raises_one_line

from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.datasets import digits
from flx.datamodules.partitioners import IID, ByGroup, OneClass
from flx.datamodules.protocol import DataProtocol
from flx.datamodules.store import TensorData
from flx.tasks import Classification


def test_test_labels_is_per_class_accuracy_for_one_class_per_client() -> None:
    """One class per client: client c is evaluated on exactly the global test rows of class c; the test loader is one
    pass over the test split whose rows carry their cell (their label)."""
    dm = FederatedDataModule(digits, OneClass(num_clients=10), client_eval="test_labels", eval_batch_size=64)
    dm.setup("fit")
    assert dm.eval_plan("test") == [("test", True, True)]
    y, cell = (torch.cat([b[i] for b in dm.test_dataloader()[0]]) for i in (1, 2))
    assert torch.equal(y, dm.data.y_test) and torch.equal(cell, y)
    for c, (x, yc) in enumerate(dm.client_eval_data("test")):
        assert torch.equal(x, dm.data.x_test[dm.data.y_test == c]) and bool((yc == c).all())


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
    for c, (x, y) in enumerate(dm.client_eval_data("test")):
        group = int(data.groups_train[dm.client_train[c]][0])
        assert torch.equal(x, data.x_test[data.groups_test == group])
        assert torch.equal(y, data.y_test[data.groups_test == group])
    assert torch.equal(torch.cat([b[2] for b in dm.test_dataloader()[0]]), data.groups_test)  # each row's cell


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


def _rank_loaders(dm: FederatedDataModule, rank: int, world: int) -> list:
    dm.trainer = SimpleNamespace(global_rank=rank, world_size=world)
    return dm.val_dataloader() + dm.test_dataloader()


def test_two_ranks_evaluate_disjoint_halves_whose_sums_are_the_one_rank_metrics() -> None:
    """Rank r of 2 takes rows r, r + 2, ... of every evaluation loader (the validation split with its per-client cells,
    the test split, the clients' held-out rows): disjoint, together every row once. The metrics' states summed over
    the two ranks (what the all-reduce does) equal the one-rank states, per client too."""
    dm = FederatedDataModule(
        digits, IID(num_clients=5, test_fraction=0.2), protocol=DataProtocol(0.2), eval_batch_size=64
    )
    dm.setup("fit")
    assert [tuple(p) for p in dm.eval_plan("val") + dm.eval_plan("test")] == [
        ("val", True, True),
        ("test", True, False),
        ("test", False, True),
    ]
    one, halves = _rank_loaders(dm, 0, 1), [_rank_loaders(dm, r, 2) for r in (0, 1)]
    for k, loader in enumerate(one):
        a, b = (h[k].rows for h in halves)
        assert not set(a.tolist()) & set(b.tolist()) and sorted(a.tolist() + b.tolist()) == loader.rows.tolist()
    net = torch.nn.Sequential(torch.nn.Flatten(), linear(64, 10))  # digits rows are (1, 8, 8) images
    states = [_states(dm, net, loaders) for loaders in (one, *halves)]
    for key, value in states[0].items():  # counts exactly, float32 loss sums to their rounding
        tol = 0 if key.endswith(("correct", "total")) else 1e-6
        torch.testing.assert_close(states[1][key] + states[2][key], value, rtol=tol, atol=0)


def _states(dm: FederatedDataModule, net: torch.nn.Module, loaders: list) -> dict[str, torch.Tensor]:
    """The sum states of the val and test metrics after feeding ``loaders`` as the module's evaluation step does."""
    metrics = {s: Classification().metrics(10, dm.num_clients) for s in ("val", "test")}
    plan = dm.eval_plan("val") + dm.eval_plan("test")
    with torch.no_grad():
        for (split, overall, per_client), loader in zip(plan, loaders):
            for batch in loader:
                out = net(batch[0])
                if overall:
                    metrics[split].update(out, batch[1])
                if per_client:
                    metrics[split].update_clients(out, batch[1], batch[-1], dm.client_cells(split))
    out = {}
    for s, m in metrics.items():
        out |= {f"{s}/correct": m.client.correct, f"{s}/total": m.client.total}
        out |= {f"{s}/loss_sum": m.loss.mean_value.double(), f"{s}/weight": m.loss.weight.double()}
    return out
