"""Server-side resources: the server split (``data.server_fraction``) and the frozen models (``server.models``).

Properties checked exactly: the server rows are disjoint from every client's rows and from the validation and test
rows; every training row of the loader is in exactly one of (clients, server, validation); class ``c`` gives
``floor(f n_c + 1/2)`` of the ``n_c`` rows it has left after the validation carve; the server rows are neither
subsampled nor flipped; a written split read back gives the same server rows; ``server_fraction=0`` leaves the data
and the partition as flx wrote them before the server split existed, byte for byte.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import raises_one_line

from flx.datamodules.binary import binarize
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.datasets import digits
from flx.datamodules.partitioners import Dirichlet, FromFile
from flx.datamodules.protocol import DataProtocol
from flx.resources import ServerResources, build_server_resources

ROOT = Path(__file__).resolve().parents[1]
NOISY = functools.partial(binarize, digits, positive=[3, 5], imratio=0.2, flip_rate=0.1, seed=2)


def _dm(server: float = 0.2, val: float = 0.1, partitioner=None, dataset=digits, **kwargs) -> FederatedDataModule:
    protocol = DataProtocol(val_fraction=val, server_fraction=server, **kwargs)
    partitioner = partitioner or Dirichlet(num_clients=8, alpha=0.5, test_fraction=0.2)
    dm = FederatedDataModule(dataset, partitioner, protocol=protocol)
    dm.setup("fit")
    return dm


def _store_pool_ids(dm: FederatedDataModule) -> np.ndarray:
    """The pool id of every row of the training store: the client-side rows, then the server rows (no subsample)."""
    return np.concatenate([dm.data.rows["train"], dm.data.rows["server"]])


def _client_rows(dm: FederatedDataModule) -> np.ndarray:
    """Every store row some client holds (its training rows and its own held-out rows)."""
    return torch.cat([*dm.client_train, *dm.client_test]).numpy()


# ------------------------------------------------------------------------------------------------ the server split
def test_server_rows_are_disjoint_from_every_client_and_from_validation_and_test() -> None:
    dm = _dm(standardize=False)
    pool, rows = _store_pool_ids(dm), dm.data.rows
    server = pool[dm.server_rows.numpy()]
    assert len(server) > 0 and dm.server_rows.dtype == torch.long
    for other in (rows["val"], rows["test"], pool[_client_rows(dm)]):
        assert len(np.intersect1d(server, other)) == 0
    for client in dm.client_train:  # as store rows, too: no client index reaches the server rows
        assert len(np.intersect1d(client.numpy(), dm.server_rows.numpy())) == 0
    raw = digits(standardize=False)
    x, y = torch.cat([raw.x_train, raw.x_test]), torch.cat([raw.y_train, raw.y_test])
    assert torch.equal(dm.data.x_train[dm.server_rows], x[server])
    assert torch.equal(dm.data.y_train[dm.server_rows], y[server])


def test_server_rows_index_the_store_the_clients_index_without_a_copy() -> None:
    dm = _dm()
    assert dm.clients.x is dm.data.x_train and dm.clients.y is dm.data.y_train
    n = dm.data.num_client_rows
    assert torch.equal(dm.server_rows, torch.arange(n, len(dm.data.y_train)))  # the tail of the store
    assert int(torch.cat(list(dm.client_train)).max()) < n


def test_every_training_row_is_in_exactly_one_of_clients_server_and_validation() -> None:
    dm = _dm()
    pool = _store_pool_ids(dm)
    every = np.concatenate([pool[_client_rows(dm)], pool[dm.server_rows.numpy()], dm.data.rows["val"]])
    np.testing.assert_array_equal(np.sort(every), np.arange(len(digits().y_train)))


@pytest.mark.parametrize(("val", "server"), [(0.1, 0.1), (0.1, 0.25), (0.0, 0.5), (0.2, 0.37)])
def test_server_fraction_is_honoured_in_every_class(val: float, server: float) -> None:
    """Class c has n_c training rows; the validation carve takes v_c = floor(f_val n_c + 1/2) of them, then the server
    carve s_c = floor(f_server (n_c - v_c) + 1/2) of the rest (the rounding rule of the validation carve)."""
    dm = _dm(server, val)
    n_c = torch.bincount(digits().y_train, minlength=10)
    v_c = torch.tensor([math.floor(val * int(n) + 0.5) for n in n_c])
    s_c = torch.tensor([math.floor(server * int(n) + 0.5) for n in n_c - v_c])
    assert torch.equal(torch.bincount(dm.data.y_train[dm.server_rows], minlength=10), s_c)
    assert torch.equal(torch.bincount(dm.data.y_train[: dm.data.num_client_rows], minlength=10), n_c - v_c - s_c)


def test_the_server_carve_leaves_the_validation_rows_alone() -> None:
    np.testing.assert_array_equal(_dm(0.3).data.rows["val"], _dm(0.0).data.rows["val"])


def test_server_rows_are_neither_subsampled_nor_flipped() -> None:
    """binarize with imratio and flips: the server rows keep the natural ratio and the clean binary labels of their
    digits (as the validation rows); only the client-side rows are subsampled and flipped."""
    dm, clean = _dm(0.3, dataset=NOISY), _dm(0.3, dataset=functools.partial(binarize, digits, positive=[3, 5]))
    np.testing.assert_array_equal(dm.data.rows["server"], clean.data.rows["server"])
    raw = digits(standardize=False)
    y = torch.cat([raw.y_train, raw.y_test])[dm.data.rows["server"]]
    assert torch.equal(dm.data.y_train[dm.server_rows], torch.isin(y, torch.tensor([3, 5])).long())
    client_y, clean_y = (d.data.y_train[: d.data.num_client_rows] for d in (dm, clean))
    n_neg = int((clean_y == 0).sum())
    n_pos = round(0.2 / 0.8 * n_neg)  # imratio 0.2, then 10% of each class flipped
    assert len(client_y) == n_neg + n_pos
    assert int(client_y.sum()) == n_pos - round(0.1 * n_pos) + round(0.1 * n_neg)


def test_standardised_with_the_client_rows_statistics() -> None:
    """The client-side rows have mean 0 and std 1; the server rows are (raw - mean_clients) / std_clients."""
    raw, z = _dm(0.3, standardize=False).data, _dm(0.3).data
    n = z.num_client_rows
    mean, std = raw.x_train[:n].double().mean(), raw.x_train[:n].double().std(correction=0)  # digits: one channel
    assert abs(float(z.x_train[:n].double().mean())) < 1e-6
    assert float(z.x_train[:n].double().std(correction=0)) == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(z.x_train[n:].double(), (raw.x_train[n:].double() - mean) / std, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dataset", [digits, NOISY], ids=["digits", "imbalanced_noisy"])
def test_server_rows_are_the_same_after_the_split_is_written_and_read_back(tmp_path: Path, dataset) -> None:
    first = _dm(0.25, 0.15, Dirichlet(num_clients=6, alpha=0.3, test_fraction=0.2, seed=5), dataset)
    first.save(str(tmp_path))
    assert len(json.loads((tmp_path / "data_split.json").read_text())["server"]) == len(first.server_rows)
    again = _dm(
        0.0, 0.0, FromFile(str(tmp_path / "partition.json")), dataset, split_file=str(tmp_path / "data_split.json")
    )
    assert torch.equal(first.server_rows, again.server_rows)
    for key in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        assert torch.equal(getattr(first.data, key), getattr(again.data, key)), key
    assert all(torch.equal(p, q) for p, q in zip(first.client_train, again.client_train, strict=True))


# Written by flx at commit 72d4ea6, before the server split existed: sha256 of partition.json + data_split.json + the
# training labels, for digits (val 0.1, Dirichlet(8, 0.5), test_fraction 0.2) and its imbalanced noisy binary version
BEFORE = [(digits, "c27bbb4557241b5c"), (NOISY, "8da8027b048a1c71")]


@pytest.mark.parametrize(("dataset", "before"), BEFORE, ids=["digits", "imbalanced_noisy"])
def test_zero_server_fraction_gives_no_rows_and_the_data_and_partition_of_before(
    tmp_path: Path, dataset, before: str
) -> None:
    dm = _dm(0.0, dataset=dataset)
    assert dm.server_rows.dtype == torch.long and len(dm.server_rows) == 0 and dm.data.num_server == 0
    dm.save(str(tmp_path))
    text = (tmp_path / "partition.json").read_text() + (tmp_path / "data_split.json").read_text()
    digest = hashlib.sha256((text + json.dumps(dm.data.y_train.tolist())).encode()).hexdigest()[:16]
    assert digest == before
    assert "server" not in json.loads((tmp_path / "data_split.json").read_text())


@pytest.mark.parametrize("value", [-0.1, 1.0, 1.5, True, "half"])
def test_bad_server_fraction_is_one_line(value) -> None:
    message = raises_one_line(
        DataProtocol, server_fraction=value, match="must be a number in [0, 1) (0: no server split)"
    )
    assert message.startswith(f"data.server_fraction={value!r}")


def test_a_server_fraction_that_leaves_too_few_client_rows_is_one_line() -> None:
    """digits has ~129 training rows per class after validation: 0.999 takes them all, 0.99 leaves 1 per class."""
    raises_one_line(_dm, 0.999, match="data.server_fraction=0.999: leaves no client-side training rows")
    match = "data.server_fraction=0.99: leaves 10 client-side training rows for 20 clients (partition.num_clients)"
    raises_one_line(_dm, 0.99, partitioner=Dirichlet(num_clients=20, alpha=0.5), match=match)


@pytest.mark.slow
def test_precheck_rejects_a_bad_server_fraction_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "train.py", "data.server_fraction=1.0", f"hydra.run.dir={run_dir}", "logger=none"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == "flx: error: data.server_fraction=1.0: must be in [0, 1) (0: no server split)"
    assert not run_dir.exists() and not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------ the resources
def _cfg(tmp_path: Path, *overrides: str):
    from flx.config import precheck

    return precheck(["model=mlp", "model.hidden=[16]", f"paths.output_dir={tmp_path}", *overrides])


@pytest.mark.slow
def test_build_puts_the_server_rows_and_the_frozen_models_on_the_datamodule(tmp_path: Path) -> None:
    """``flx.run.build`` sets ``dm.server_resources``: the server rows and the saved net, frozen, equal tensor for
    tensor; without ``server.models`` there are no models."""
    from flx.models.build import net_from_config
    from flx.run import build

    quiet = ["logger=none", "callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "checkpoint=null"]
    cfg = _cfg(tmp_path, "data.server_fraction=0.2", *quiet)
    net = net_from_config(cfg.model, (1, 8, 8), 10)
    torch.save(net.state_dict(), tmp_path / "pm.pt")
    entry = f"+server.models.pm={{model: ${{model}}, checkpoint: {tmp_path}/pm.pt}}"
    dm, _, _ = build(_cfg(tmp_path, "data.server_fraction=0.2", entry, *quiet))
    res = dm.server_resources
    assert isinstance(res, ServerResources) and res.rows is dm.server_rows and len(res.rows) > 0
    assert list(res.models) == ["pm"] and not res.models["pm"].training
    for name, tensor in net.state_dict().items():
        assert torch.equal(res.models["pm"].state_dict()[name], tensor), name
    assert build_server_resources(_cfg(tmp_path), dm).models == {}


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (
            "{model: ${model}, checkpoint: /nonexistent/pm.pt}",
            "server.models.pm.checkpoint='/nonexistent/pm.pt': no such file",
        ),
        ("{checkpoint: /x.pt}", "server.models.pm={'checkpoint': '/x.pt'}: must be {model: <a model config"),
        ("{model: 3, checkpoint: /x.pt}", "server.models.pm.model=3: must be a model config with a _target_"),
        ("{model: ${model}, checkpoint: /x.pt, lr: 1}", "server.models.pm={"),
    ],
)
def test_bad_server_models_are_one_line_before_the_run(tmp_path: Path, entry: str, match: str) -> None:
    raises_one_line(_cfg, tmp_path, f"+server.models.pm={entry}", match=match)
