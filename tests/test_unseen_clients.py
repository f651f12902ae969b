"""Clients never trained on (``partition.unseen_clients``; Yuan, Morningstar, Ning, Singhal, "What Do We Mean by
Generalization in Federated Learning?", ICLR 2022, arXiv:2110.14216).

The unseen set ``U`` is the first ``k`` of a permutation drawn from the partition seed's own stream; its clients move
to the end of the client list (the split's held-out clients, few_shot's mechanism), so the clients that train are
``0..T-1`` in their partition order. Invariants: the clients' rows are those of the partition without unseen clients;
no round samples ``U`` and none of its rows reaches a local step, so FedAvg with ``unseen_clients`` equals FedAvg on
``P \\ U`` bit for bit; ``unseen/acc`` is the final global model's accuracy on ``U``'s rows; the final line's
``participation_gap`` is ``participating/acc - unseen/acc``; a resumed run keeps ``U``.
"""

from __future__ import annotations

import copy
import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import runs
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, run_rounds
from runs import assert_same_model, ckpt

from flx.config import precheck
from flx.datamodules.datamodule import ClientStore
from flx.datamodules.few_shot import FewShot
from flx.datamodules.partition_base import UNSEEN_STREAM, unseen_ids
from flx.datamodules.partition_file import save_partition
from flx.datamodules.partitioners import IID, Dirichlet, FromFile
from flx.errors import ConfigError
from flx.hooks import FederatedCallback
from flx.run import build

LABELS = np.random.default_rng(1).integers(0, 3, 300)


# ------------------------------------------------------------------ the partition
def test_unseen_set_is_a_prefix_of_the_partition_seeds_permutation() -> None:
    """``U_k`` = sorted first ``k`` of ``default_rng([seed, UNSEEN_STREAM]).permutation(C)``: so ``U_2 ⊂ U_5``."""
    perm = np.random.default_rng([7, UNSEEN_STREAM]).permutation(20)
    assert np.array_equal(unseen_ids(20, 5, 7), np.sort(perm[:5]))
    assert set(unseen_ids(20, 2, 7)) <= set(unseen_ids(20, 5, 7))
    assert not np.array_equal(unseen_ids(20, 5, 7), unseen_ids(20, 5, 8))  # the partition seed decides


@pytest.mark.parametrize("scheme", [IID, Dirichlet])
def test_unseen_clients_move_last_with_their_rows_unchanged(scheme: type) -> None:
    """Client ``i`` of the split with unseen clients holds the rows of client ``order[i]`` of the split without,
    ``order`` = the clients that train in partition order, then ``U``; ``num_heldout = |U|``."""
    plain = scheme(10, test_fraction=0.2, seed=3)(LABELS, 0)
    held = scheme(10, test_fraction=0.2, seed=3, unseen_clients=3)(LABELS, 0)
    u = unseen_ids(10, 3, 3)
    order = [c for c in range(10) if c not in u] + list(u)
    assert held.num_heldout == 3 and held.num_train_clients == 7
    for i, c in enumerate(order):
        assert np.array_equal(held.train[i], plain.train[c]) and np.array_equal(held.test[i], plain.test[c])


def test_a_fraction_is_the_rounded_count() -> None:
    """``unseen_clients=0.25`` of 10 clients is ``floor(2.5 + 0.5) = 3`` clients: the same split as ``3``."""
    by_fraction, by_count = IID(10, unseen_clients=0.25)(LABELS, 0), IID(10, unseen_clients=3)(LABELS, 0)
    assert by_fraction.num_heldout == 3
    assert np.array_equal(by_fraction.train.values, by_count.train.values)
    assert np.array_equal(by_fraction.train.offsets, by_count.train.offsets)
    assert IID(10, unseen_clients=0).num_unseen == IID(10, unseen_clients=None).num_unseen == 0


CFG = ["logger=none", "model=logreg", "partition.num_clients=8", "algo.clients_per_round=3"]


@pytest.mark.parametrize(
    ("value", "expect"),
    [
        ("-1", ">= 0"),
        ("8", "none would train"),
        ("1.5", "(0, 1)"),
        ("true", "(0, 1)"),
        ("0.01", "is 0 of the 8 clients"),
        ("6", "fewer than algo.clients_per_round=3"),
    ],
)
def test_bad_values_stop_with_one_line_naming_the_key(value: str, expect: str, tmp_path: Path) -> None:
    """The pre-run checks (:func:`flx.config.precheck`: nothing is written yet) stop with one line."""
    with pytest.raises(ConfigError) as err:
        precheck([*CFG, f"partition.unseen_clients={value}", f"paths.output_dir={tmp_path}"])
    line = str(err.value)
    assert "\n" not in line and line.startswith("partition.unseen_clients=") and expect in line, line


def test_few_shot_held_out_clients_are_its_unseen_ones() -> None:
    """few_shot keeps its mechanism: the ``heldout_fraction`` clients are the unseen ones."""
    shot = FewShot(10, samples_min=5, heldout_fraction=0.2, seed=0)
    assert shot.num_unseen == 2 and shot.num_train_clients == 8


# ------------------------------------------------------------------ training never reaches them
class Cohorts(FederatedCallback):
    """Records every round's cohort and every client that ran."""

    def __init__(self) -> None:
        self.cohorts: list[tuple[int, ...]] = []
        self.ran: set[int] = set()

    def on_round_start(self, fed, rnd) -> None:
        self.cohorts.append(tuple(rnd.cohort))

    def on_client_end(self, fed, client) -> None:
        self.ran.add(client.cid)


def test_fedavg_with_unseen_clients_is_fedavg_on_the_partition_without_them() -> None:
    """40 rounds of 3 of the 7 training clients: no cohort holds an unseen client, none runs, and the global model is
    bitwise that of FedAvg on ``P \\ U`` (the same 7 clients, ids ``0..6``, same seeds). The unseen clients' rows are
    NaN: one of them in a local step would make the model NaN."""
    split = IID(10, test_fraction=0.2, seed=0, unseen_clients=3)(LABELS, 0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(len(LABELS), 5, generator=g), torch.from_numpy(LABELS)
    unseen_rows = np.concatenate([split.train[c] for c in range(7, 10)])
    x[torch.from_numpy(unseen_rows)] = float("nan")
    rows = split.train.torch()
    spy = Cohorts()
    cfg = {"clients_per_round": 3, "local_steps": 2, "batch_size": 8, "lr": 0.1, "seed": 5}
    with_unseen = make_fed(linear(), ClientStore(x, y, rows, split.num_train_clients), [spy], F.cross_entropy, **cfg)
    without = make_fed(linear(), ClientStore(x, y, [rows[c] for c in range(7)]), [], F.cross_entropy, **cfg)
    run_rounds(with_unseen, 40)
    run_rounds(without, 40)
    assert len(spy.cohorts) == 40 and max(max(c) for c in spy.cohorts) < 7 and spy.ran <= set(range(7))
    for a, b in zip(with_unseen.params, without.params):
        assert torch.isfinite(a).all() and torch.equal(a, b)


# ------------------------------------------------------------------ runs: unseen/*, the gap, resume
SMALL = [  # FedAvg, adapted at evaluation only (algo=fedavg_ft: one SGD step of size 0.03 on a client's train rows)
    "algo=fedavg_ft",
    "partition=iid",
    "algo.adapt_also_steps=[]",
    "logger=csv",
    "model=logreg",
    "partition.num_clients=8",
    "partition.test_fraction=0.25",
    "partition.unseen_clients=2",
    "algo.clients_per_round=3",
    "algo.local_steps=3",
    "trainer.accelerator=cpu",
]


def _run(out: Path, *args: str) -> tuple[dict[str, float], str]:
    """``train.py`` (a subprocess: it writes the run folder's files): the test's metrics and the final line."""
    done = runs.run(out, *SMALL, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "csv" / "metrics.csv", newline="") as f:
        row = [r for r in csv.DictReader(f) if r.get("unseen/acc")][-1]
    metrics = {k: float(v) for k, v in row.items() if v}
    return metrics, next(line for line in done.stdout.splitlines() if line.startswith("final "))


def _global_net(out: Path, *args: str) -> tuple[torch.nn.Module, object]:
    """The run's net with the final checkpoint's weights, and its datamodule (the same data and split)."""
    dm, module, _ = build(precheck([*SMALL, *args, f"paths.output_dir={out}"]))
    state = ckpt(out / "checkpoints" / "last.ckpt")["state_dict"]
    module.net.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("net.")})
    return module.net.eval(), dm


def _acc(net: torch.nn.Module, dm: object, rows: np.ndarray) -> float:
    r = torch.from_numpy(np.sort(rows))
    with torch.no_grad():
        return float((net(dm.data.x_train[r]).argmax(1) == dm.data.y_train[r]).double().mean())


@pytest.fixture(scope="module")
def fedavg(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float], str]:
    out = tmp_path_factory.mktemp("unseen") / "run"
    metrics, line = _run(out, "algo.rounds=2")
    return out, metrics, line


@pytest.mark.slow
def test_unseen_acc_is_the_global_model_on_every_row_of_the_unseen_clients(fedavg) -> None:
    """``unseen/acc``: the final model on the unseen clients' train and test rows; ``participating/acc``: on the
    training clients' test rows."""
    out, metrics, _ = fedavg
    net, dm = _global_net(out)
    split, t = dm.split, dm.split.num_train_clients
    assert t == 6 and split.num_heldout == 2
    unseen = np.concatenate([*(split.train[c] for c in (6, 7)), *(split.test[c] for c in (6, 7))])
    participating = np.concatenate([split.test[c] for c in range(t)])
    assert metrics["unseen/acc"] == pytest.approx(_acc(net, dm, unseen), abs=1e-6)
    assert metrics["participating/acc"] == pytest.approx(_acc(net, dm, participating), abs=1e-6)
    assert "unseen/loss" in metrics and "participating/loss" in metrics


@pytest.mark.slow
def test_final_line_gives_the_participation_gap(fedavg) -> None:
    """``participation_gap = participating/acc - unseen/acc``, the two logged values, 4 decimals."""
    _, metrics, line = fedavg
    gap = float(re.search(r"participation_gap=(\S+)", line).group(1))
    assert gap == pytest.approx(metrics["participating/acc"] - metrics["unseen/acc"], abs=5.1e-5)
    assert float(re.search(r"unseen_acc=(\S+)", line).group(1)) == pytest.approx(metrics["unseen/acc"], abs=5.1e-5)


@pytest.mark.slow
def test_partition_json_names_the_unseen_clients_and_a_resumed_run_keeps_them(fedavg, tmp_path: Path) -> None:
    """``partition.json`` lists ``"unseen": [6, 7]``; 1 round, then resumed to 2, gives the same file and the same
    model bit for bit as the uninterrupted run (a different unseen set would train other clients)."""
    out, _, _ = fedavg
    whole = json.loads((out / ".hydra" / "partition.json").read_text())
    assert whole["unseen"] == [6, 7] and len(whole["clients"]) == 8
    resumed = tmp_path / "run"
    _run(resumed, "algo.rounds=1")
    _run(resumed, "algo.rounds=2", "ckpt_path=auto")
    assert json.loads((resumed / ".hydra" / "partition.json").read_text()) == whole
    assert_same_model(ckpt(resumed / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))


@pytest.mark.slow
def test_fine_tuning_adapts_an_unseen_client_on_its_own_rows(fedavg) -> None:
    """``algo=fedavg_ft``: an unseen client's personalised model is one full-batch SGD step of size ``adapt_lr`` from
    the global model on its train rows, measured on its test rows; ``unseen/personal_acc_mean`` is the mean over the
    2 unseen clients."""
    out, metrics, _ = fedavg
    net, dm = _global_net(out)
    accs = []
    for c in (6, 7):
        tuned = copy.deepcopy(net).train()
        rows = torch.from_numpy(dm.split.train[c])
        loss = F.cross_entropy(tuned(dm.data.x_train[rows]), dm.data.y_train[rows])
        grads = torch.autograd.grad(loss, list(tuned.parameters()))
        with torch.no_grad():
            for p, g in zip(tuned.parameters(), grads):
                p -= 0.03 * g  # algo.adapt_lr
        accs.append(_acc(tuned.eval(), dm, dm.split.test[c]))
    assert metrics["unseen/personal_acc_mean"] == pytest.approx(sum(accs) / 2, abs=1e-6)


@pytest.mark.slow
def test_regression_logs_the_mse_of_the_unseen_clients(tmp_path: Path) -> None:
    """``task=regression``: ``unseen/mse`` is the mean squared error of the (untrained) global model over every row of
    the unseen clients, ``participating/mse`` over the training clients' test rows."""
    args = [
        "task=regression",
        "data=diabetes",
        "partition=iid",
        "partition.num_clients=6",
        "partition.unseen_clients=2",
    ]
    args += [
        "partition.test_fraction=0.25",
        "model=linear",
        "algo.clients_per_round=2",
        "logger=none",
        "checkpoint=null",
    ]
    dm, module, trainer = build(precheck([*args, "trainer.enable_progress_bar=false", f"paths.output_dir={tmp_path}"]))
    metrics = trainer.test(module, datamodule=dm, verbose=False)[0]
    split, x, y = dm.split, dm.data.x_train, dm.data.y_train
    rows = {
        "unseen": np.concatenate(
            [split.train.values[split.train.offsets[4] :], split.test.values[split.test.offsets[4] :]]
        ),
        "participating": split.test.values[: split.test.offsets[4]],
    }
    for name, r in rows.items():
        r = torch.from_numpy(np.sort(r))
        with torch.no_grad():
            mse = float(((module.net(x[r]).reshape(y[r].shape) - y[r]) ** 2).double().mean())
        assert metrics[f"{name}/mse"] == pytest.approx(mse, rel=1e-5), name


def test_a_runs_partition_file_gives_its_unseen_clients_back(tmp_path: Path) -> None:
    """``partition=from_file`` on a saved split with unseen clients: the same clients, rows and unseen set; a file
    with ``unseen`` and ``partition.unseen_clients`` set stops with one line."""
    split = IID(10, test_fraction=0.2, seed=0, unseen_clients=3)(LABELS, 0)
    save_partition(tmp_path / "p.json", split)
    assert json.loads((tmp_path / "p.json").read_text())["unseen"] == [7, 8, 9]
    back = FromFile(str(tmp_path / "p.json"))(LABELS, 0)
    assert back.num_heldout == 3 and FromFile(str(tmp_path / "p.json")).num_train_clients == 7
    for a, b in zip([*split.train, *split.test], [*back.train, *back.test]):
        assert np.array_equal(a, b)
    with pytest.raises(ConfigError, match=r"^partition.unseen_clients=2: .* leave partition.unseen_clients null$"):
        FromFile(str(tmp_path / "p.json"), unseen_clients=2)
