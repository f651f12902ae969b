"""The data protocol: the validation carve, split and partition files, standardisation, seeds fixed apart from `seed`.

Properties checked exactly: validation rows are disjoint from training, test and every client's rows; the carve takes
``floor(f n_c + 1/2)`` rows of every class; it happens before the imbalance subsample and the flips (validation labels
are the clean binary labels of the carved rows); a written split / partition read back gives the same data and
clients; every training row is in exactly one client; standardised inputs are ``(raw - mean) / std`` with the
training rows' statistics.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import raises_one_line

from flx.datamodules.binary import binarize
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.datasets import diabetes, digits
from flx.datamodules.partitioners import IID, Dirichlet, FromFile
from flx.datamodules.protocol import DataProtocol, load, save_split

ROOT = Path(__file__).resolve().parents[2]


def _dm(val_fraction: float = 0.1, partitioner=None, dataset=digits, **kwargs) -> FederatedDataModule:
    protocol = DataProtocol(val_fraction=val_fraction, **kwargs)
    dm = FederatedDataModule(dataset, partitioner or Dirichlet(num_clients=8, alpha=0.5), protocol=protocol)
    dm.setup("fit")
    return dm


def _pool() -> tuple[torch.Tensor, torch.Tensor]:
    """digits' raw pool: train rows then test rows (pixels / 16), labels."""
    raw = digits(standardize=False)
    return torch.cat([raw.x_train, raw.x_test]), torch.cat([raw.y_train, raw.y_test])


def test_validation_rows_are_disjoint_from_train_test_and_every_client() -> None:
    dm = _dm(standardize=False)
    rows = dm.data.rows
    x, y = _pool()
    assert len(np.intersect1d(rows["val"], rows["train"])) == 0 and len(np.intersect1d(rows["val"], rows["test"])) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate(list(rows.values()))), np.arange(len(y)))
    assert torch.equal(dm.data.x_val, x[rows["val"]]) and torch.equal(dm.data.y_val, y[rows["val"]])
    assert torch.equal(dm.data.x_train, x[rows["train"]]) and torch.equal(dm.data.x_test, x[rows["test"]])
    for client in dm.client_train:  # client rows index the training split: their pool ids never meet the val rows
        assert len(np.intersect1d(rows["train"][client.numpy()], rows["val"])) == 0


@pytest.mark.parametrize("fraction", [0.1, 0.25])
def test_validation_carve_is_stratified(fraction: float) -> None:
    """Class c gives exactly floor(f n_c + 1/2) of its n_c training rows to the validation split."""
    dm = _dm(fraction)
    raw = digits()
    n_c = torch.bincount(raw.y_train, minlength=10)
    expected = torch.tensor([math.floor(fraction * int(n) + 0.5) for n in n_c])
    assert torch.equal(torch.bincount(dm.data.y_val, minlength=10), expected)
    assert torch.equal(torch.bincount(dm.data.y_train, minlength=10), n_c - expected)


def test_validation_is_carved_before_imbalance_and_flips() -> None:
    """binarize with imratio and flips: the validation rows are the same rows as without them, with the clean binary
    labels of their digits and the natural ratio; the training rows alone are subsampled (to imratio) and flipped."""
    source, pos = functools.partial(digits), [0, 1]
    protocol = DataProtocol(0.2, standardize=False)
    plain = load(functools.partial(binarize, source, positive=pos), protocol)
    noisy = load(functools.partial(binarize, source, positive=pos, imratio=0.1, flip_rate=0.3, seed=4), protocol)
    x, y = _pool()
    np.testing.assert_array_equal(noisy.rows["val"], plain.rows["val"])
    assert torch.equal(noisy.x_val, x[noisy.rows["val"]])
    assert torch.equal(noisy.y_val, torch.isin(y[noisy.rows["val"]], torch.tensor(pos)).long())  # nothing flipped
    # the training rows: exactly round(0.1 / 0.9 * #neg) positives kept, then 30% of each class flipped
    n_neg = int((plain.y_train == 0).sum())
    n_pos = round(0.1 / 0.9 * n_neg)
    assert len(noisy.y_train) == n_neg + n_pos
    assert int(noisy.y_train.sum()) == n_pos - round(0.3 * n_pos) + round(0.3 * n_neg)


def test_standardised_with_the_training_rows_statistics() -> None:
    """Per channel: x_train has mean 0 and std 1; every split is (raw - mean_train) / std_train (1e-6)."""
    raw, z = _dm(0.1, standardize=False).data, _dm(0.1, standardize=True).data
    mean, std = raw.x_train.double().mean(), raw.x_train.double().std(correction=0)  # digits: one channel
    torch.testing.assert_close(z.x_train.double().mean(), torch.tensor(0.0, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        z.x_train.double().std(correction=0), torch.tensor(1.0, dtype=torch.float64), atol=1e-6, rtol=0
    )
    for a, b in ((raw.x_train, z.x_train), (raw.x_val, z.x_val), (raw.x_test, z.x_test)):
        torch.testing.assert_close(b.double(), (a.double() - mean) / std, atol=1e-6, rtol=0)
    assert raw.x_train.min() == 0 and raw.x_train.max() == 1  # the raw scaling: pixels / 16


def test_per_feature_statistics_for_tables() -> None:
    from flx.datamodules.datasets import breast_cancer

    data = load(breast_cancer, DataProtocol(0.1)).x_train.double()
    torch.testing.assert_close(data.mean(0), torch.zeros(30, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(data.std(0, correction=0), torch.ones(30, dtype=torch.float64), atol=1e-6, rtol=0)


def test_no_validation_split_skips_the_validation_loop_and_eval_test_adds_the_test_split() -> None:
    dm = _dm(0.0, partitioner=IID(num_clients=4, test_fraction=0.2))
    assert dm.data.num_val == 0 and dm.val_dataloader() == [] and dm.eval_plan("val") == []
    dm.eval_test = True
    # (split, overall, per_client): the test split, then each client's held-out training rows in a loader of their own
    assert dm.eval_plan("val") == [("test", True, False), ("test", False, True)] == dm.eval_plan("test")
    assert torch.equal(dm.val_dataloader()[0].tensors[1], dm.data.y_test)
    carved = _dm(0.1, partitioner=IID(num_clients=4, test_fraction=0.2))
    assert carved.eval_plan("val") == [("val", True, True)]  # the clients' validation rows are the split's own
    assert torch.equal(carved.val_dataloader()[0].tensors[1], carved.data.y_val)


def test_client_rows_on_the_validation_split_are_its_labels_validation_rows() -> None:
    """One class per client: client c's validation rows are those of label c, and one pass over the split serves every
    client (each row carries its cell, its label)."""
    from flx.datamodules.partitioners import OneClass

    dm = _dm(0.2, partitioner=OneClass(num_clients=10), standardize=False)
    (loader,) = dm.val_dataloader()
    x, y, cell = (torch.cat([b[i] for b in loader]) for i in range(3))
    assert torch.equal(x, dm.data.x_val) and torch.equal(cell, y)
    for c, (xc, yc) in enumerate(dm.client_eval_data("val")):
        assert torch.equal(xc, dm.data.x_val[dm.data.y_val == c]) and bool((yc == c).all())


# ------------------------------------------------------------------------------------------------ seeds and files
def test_split_and_partition_do_not_follow_the_run_seed(tmp_path: Path) -> None:
    """seed=0 and seed=3 hold the same data and clients (split_seed, partition.seed fixed); ${seed} still reachable."""
    from hydra.utils import instantiate

    from flx.config import precheck
    from flx.datamodules.protocol import data_protocol

    def data(*overrides: str) -> FederatedDataModule:
        cfg = precheck(["data=digits_binary", "partition=dirichlet", f"paths.output_dir={tmp_path}", *overrides])
        dm = FederatedDataModule(
            instantiate(cfg.data.loader), instantiate(cfg.partition), cfg.seed, protocol=data_protocol(cfg)
        )
        dm.setup("fit")
        return dm

    a, b = data("seed=0"), data("seed=3")
    for key in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        assert torch.equal(getattr(a.data, key), getattr(b.data, key)), key
    assert all(torch.equal(p, q) for p, q in zip(a.client_train, b.client_train))
    c = data("seed=3", "data.split_seed=${seed}", "partition.seed=${seed}")
    assert not torch.equal(a.data.y_val, c.data.y_val) or not torch.equal(a.data.x_val, c.data.x_val)
    assert not all(torch.equal(p, q) for p, q in zip(a.client_train, c.client_train))


@pytest.mark.parametrize("binary", [False, True])
def test_written_split_and_partition_read_back_give_the_same_data_and_clients(tmp_path: Path, binary: bool) -> None:
    loader = functools.partial(binarize, digits, positive=[3, 5], imratio=0.2, flip_rate=0.1) if binary else digits
    first = _dm(0.15, Dirichlet(num_clients=6, alpha=0.3, test_fraction=0.2, seed=5), loader)
    first.save(str(tmp_path))
    again = _dm(0.0, FromFile(str(tmp_path / "partition.json")), loader, split_file=str(tmp_path / "data_split.json"))
    for key in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        assert torch.equal(getattr(first.data, key), getattr(again.data, key)), key
    for mine, theirs in ((first.client_train, again.client_train), (first.client_test, again.client_test)):
        assert all(torch.equal(p, q) for p, q in zip(mine, theirs, strict=True))


def test_from_file_puts_every_sample_in_exactly_one_client(tmp_path: Path) -> None:
    labels = np.arange(50) % 3
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"clients": [{"train": list(range(0, 50, 2))}, {"train": list(range(1, 50, 2))}]}))
    split = FromFile(str(path), test_fraction=0.2, seed=1)(labels, seed=0)
    everything = np.sort(np.concatenate(split.train + split.test))
    np.testing.assert_array_equal(everything, np.arange(50))
    assert [len(t) for t in split.test] == [5, 5]


@pytest.mark.parametrize(
    ("clients", "match"),
    [
        ([{"train": [0, 1, 2]}, {"train": [3, 9]}], "client 1 train has index 9, out of range (there are 5 rows)"),
        ([{"train": [0, 1, 2]}, {"train": [2, 3, 4]}], "row 2 is listed in client 0 train and client 1 train"),
        ([{"train": [0, 1], "test": [1]}, {"train": [2, 3, 4]}], "row 1 is listed in client 0 train and client 0 test"),
        ([{"train": [0, 1]}, {"train": [2, 3]}], "1 of the 5 training rows (e.g. row 4) are in no client"),
        ([{"train": [0, -1]}], "client 0 'train' must be a list of non-negative integers"),
        ([{"train": []}], "client 0 has no training rows"),
        ([{"train": [0, True]}], "client 0 'train' must be a list of non-negative integers"),
        ([{"train": [0, 1.5]}], "client 0 'train' must be a list of non-negative integers"),
        ([{"train": [0, 1, 2, 3, 4], "test": 5}], "client 0 'test' must be a list of non-negative integers"),
        ([{"train": [0]}, {"train": [1], "rows": []}], "client 1 must be an object with 'train' and optional 'test'"),
        ([{"train": [0]}, [1]], "client 1 must be an object with 'train' and optional 'test'"),
        ([{"test": [0]}], "client 0 must be an object with 'train' and optional 'test'"),
    ],
)
def test_bad_partition_files_are_one_line(tmp_path: Path, clients: list, match: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"clients": clients}))

    def run() -> None:
        FromFile(str(path))(np.zeros(5, dtype=np.int64), seed=0)

    assert raises_one_line(run, match=match).startswith(f"partition.path='{path}'")


def test_missing_partition_file_and_wrong_client_count(tmp_path: Path) -> None:
    raises_one_line(FromFile, str(tmp_path / "nope.json"), match="partition.path=")
    (tmp_path / "bad.json").write_text("{not json")
    raises_one_line(FromFile, str(tmp_path / "bad.json"), match="not a readable JSON file")
    (tmp_path / "p.json").write_text(json.dumps({"clients": [{"train": [0]}, {"train": [1]}]}))
    raises_one_line(FromFile, str(tmp_path / "p.json"), num_clients=3, match="partition.num_clients=3: ")


@pytest.mark.parametrize(
    ("split", "match"),
    [
        ({"train": [0, 1], "val": [1, 2]}, "row 1 is listed in train and val"),
        ({"train": [0, 1], "val": [99999]}, "val has index 99999, out of range (there are 1797 rows)"),
        ({"train": [0, 1], "val": [1500]}, "row 1500 is listed in val and test"),  # 1500 is a loader test row
        ({"val": [1]}, "must hold a JSON object with 'train'"),
        ({"train": [0], "extra": [1]}, "must hold a JSON object with 'train'"),
        ({"train": [0], "test": []}, "no test rows"),
    ],
)
def test_bad_split_files_are_one_line(tmp_path: Path, split: dict, match: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(split))
    assert raises_one_line(_dm, 0.0, split_file=str(path), match=match).startswith("data.split_file=")


def test_split_file_over_the_whole_dataset_in_its_own_order(tmp_path: Path) -> None:
    """data.test_fraction=null: the pool is digits in scikit-learn's order, and the file says which rows are test."""
    from sklearn.datasets import load_digits

    y = torch.as_tensor(load_digits().target)
    save_split(
        tmp_path / "s.json", {"train": np.arange(0, 1000), "val": np.arange(1000, 1200), "test": np.arange(1200, 1797)}
    )
    dm = _dm(0.0, IID(num_clients=4), functools.partial(digits, test_size=None), split_file=str(tmp_path / "s.json"))
    assert torch.equal(dm.data.y_train, y[:1000]) and torch.equal(dm.data.y_val, y[1000:1200])
    assert torch.equal(dm.data.y_test, y[1200:])
    raises_one_line(
        _dm, 0.0, IID(num_clients=4), functools.partial(digits, test_size=None), match="data.test_fraction=None"
    )


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("data.val_fraction=1.0", "data.val_fraction=1.0: must be in [0, 1)"),
        ("data.split_seed=-1", "data.split_seed=-1: must be an integer >= 0"),
        ("partition.seed=1.5", "partition.seed=1.5: must be an integer >= 0"),
        ("data.standardize=maybe", "data.standardize='maybe': must be true or false"),
        ("data.split_file=/nonexistent/s.json", "data.split_file='/nonexistent/s.json': file not found"),
        ("partition=from_file", "partition.path"),
    ],
)
def test_protocol_keys_are_checked_before_the_run(override: str, match: str) -> None:
    from flx.config import precheck

    raises_one_line(precheck, [override], match=match)


def test_every_data_config_has_the_protocol_keys() -> None:
    import yaml

    for path in (ROOT / "configs" / "data").glob("*.yaml"):
        node = yaml.safe_load(path.read_text())
        if path.stem == "cifar100_binary":
            continue  # inherits them from cifar10_binary
        assert {"val_fraction", "split_seed", "split_file", "standardize"} <= set(node), path.name
        # generated clients of fixed size (pFedFBE's 30 x 128 rows, FCUBE's 4 parties, FedProx's 30 devices): a
        # validation carve would take rows from them; WikiText-2 validates on its official wiki.valid.tokens
        generated = ("lasso_synthetic", "matrix_completion", "fcube", "fedprox_synthetic")
        val_fraction = 0.0 if path.stem in (*generated, "wikitext2") else 0.1
        assert node["val_fraction"] == val_fraction and node["split_seed"] == 0, path.name
    for path in (ROOT / "configs" / "partition").glob("*.yaml"):
        assert yaml.safe_load(path.read_text())["seed"] == 0, path.name


@pytest.mark.slow
def test_val_metrics_are_on_the_validation_rows_and_test_metrics_on_the_test_split(tmp_path: Path) -> None:
    """After fit, val/acc, val/loss, val/auroc are those of the final model on x_val; trainer.test gives test/* on
    x_test (recomputed by hand; sklearn's roc_auc_score for AUROC)."""
    import torch.nn.functional as F
    from sklearn.metrics import roc_auc_score

    from flx.config import precheck
    from flx.run import build

    quiet = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]
    cfg = precheck(
        [
            "data=digits_binary",
            "model=logreg",
            "partition.num_clients=4",
            "algo.clients_per_round=2",
            "algo.rounds=2",
            "algo.local_steps=3",
            "logger=none",
            *quiet,
            f"paths.output_dir={tmp_path}",
        ]
    )
    dm, module, trainer = build(cfg)
    trainer.fit(module, datamodule=dm)
    val = dict(trainer.callback_metrics)
    trainer.test(module, datamodule=dm, verbose=False)
    test = trainer.callback_metrics
    assert "test/acc" not in val  # eval_test is off: the validation loop saw only the validation rows
    with torch.no_grad():
        for split, x, y, got in (
            ("val", dm.data.x_val, dm.data.y_val, val),
            ("test", dm.data.x_test, dm.data.y_test, test),
        ):
            logits = module.net(x)
            torch.testing.assert_close(got[f"{split}/acc"], (logits.argmax(-1) == y).float().mean(), rtol=0, atol=1e-6)
            torch.testing.assert_close(got[f"{split}/loss"], F.cross_entropy(logits, y), rtol=0, atol=1e-5)
            auc = roc_auc_score(y.numpy(), (logits[:, 1] - logits[:, 0]).numpy())
            assert float(got[f"{split}/auroc"]) == pytest.approx(auc, abs=1e-6)


def test_real_targets_carve_a_random_share_and_standardise_the_target() -> None:
    """Real-valued targets have no classes to stratify by: floor(f n + 1/2) random training rows are held out; with
    standardize_target every split's targets are (y - mean) / std with the final training rows' mean and population
    std; without, the targets as given."""
    raw = diabetes(standardize=False)
    pool = torch.cat([raw.y_train, raw.y_test]).double()
    data = load(diabetes, DataProtocol(val_fraction=0.1, split_seed=3, standardize_target=True))
    assert data.num_val == math.floor(0.1 * 353 + 0.5) and len(data.y_train) == 353 - data.num_val
    ids = {k: torch.as_tensor(v) for k, v in data.rows.items()}
    mean, std = pool[ids["train"]].mean(), pool[ids["train"]].std(unbiased=False)
    for split, y in (("train", data.y_train), ("val", data.y_val), ("test", data.y_test)):
        torch.testing.assert_close(y.double(), (pool[ids[split]] - mean) / std, rtol=0, atol=1e-6)
    plain = load(diabetes, DataProtocol(val_fraction=0.1, split_seed=3))
    assert torch.equal(plain.y_val, pool[ids["val"]].float())


def test_real_targets_partition_without_labels_and_cast_to_the_net_dtype() -> None:
    """iid and quantity_skew split real-valued targets (as for any labels of that length); a partition by class label
    and per-label client evaluation stop with one line; the store casts the targets to the net's dtype once."""
    dm = _dm(dataset=diabetes, partitioner=IID(num_clients=5, seed=1), standardize_target=True)
    expected = IID(num_clients=5, seed=1)(np.zeros(len(dm.data.y_train), dtype=np.int64), 0).train
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(dm.client_train, expected))
    assert dm.has_client_rows("val") is False  # no labels to share: no per-client validation rows
    assert dm.clients.to(torch.device("cpu"), torch.float64).y.dtype == torch.float64
    raises_one_line(_dm, dataset=diabetes, match="partition='dirichlet': splits by class label and data=diabetes")
    bad = FederatedDataModule(diabetes, IID(num_clients=4), client_eval="test_labels")
    raises_one_line(bad.setup, "fit", match="client_eval='test_labels': needs class labels")
    assert _dm(partitioner=IID(num_clients=4)).clients.to(torch.device("cpu"), torch.float64).y.dtype == torch.int64
