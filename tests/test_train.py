"""End-to-end runs through the real entry points (marked slow: they start Trainers or processes)."""

from __future__ import annotations

import csv
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import DictConfig
from runs import ckpt
from sklearn.metrics import roc_auc_score

from flx.config import precheck
from flx.errors import ConfigError
from flx.hooks import FederatedCallback, RoundRefused
from flx.run import build, train
from flx.state import ClientStateStore

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
QUIET = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]
SMALL = ["model=logreg", "partition.num_clients=6", "algo.clients_per_round=3", "algo.local_steps=3", *QUIET]


def compose(out: Path, *overrides: str) -> DictConfig:
    return precheck([*overrides, f"paths.output_dir={out}"])


class VisitCounter(FederatedCallback):
    """Test part with per-client state: counts how often each client trained. On N processes it also checks
    ``fed.on_server`` each round: the function runs on one rank only and every rank receives rank 0's result."""

    def __init__(self) -> None:
        self.server_checks: list[list[float]] = []  # per round: [ranks that ran it, sum of the received ranks]

    def on_client_end(self, fed, client) -> None:
        client.state["visits"] = client.state.get("visits", torch.zeros(())) + 1

    def on_round_end(self, fed, rnd) -> None:
        if fed.world_size == 1:
            return
        ran: list[int] = []
        got = fed.on_server(lambda: ran.append(fed.rank) or fed.rank)
        sums = fed.reduce_sum(torch.tensor([float(len(ran)), float(got)]))
        self.server_checks.append(sums.tolist())

    def state_dict(self) -> dict:
        return {"server_checks": self.server_checks}

    def load_state_dict(self, state: dict) -> None:
        self.server_checks = state["server_checks"]


COUNTER = "+algo.parts.counter._target_=test_train.VisitCounter"


def _final(out: Path) -> dict:
    return torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """6 rounds == 3 rounds, stop, resume from the round-3 checkpoint to 6 (bitwise, CPU).

    FedAdam server state and a part's per-client state must be restored for this to hold.
    """
    base = [*SMALL, "algo=fedadam", "logger=none", COUNTER]
    train(compose(tmp_path / "a", *base, "algo.rounds=6"))
    train(compose(tmp_path / "b", *base, "algo.rounds=3"))
    ckpt = tmp_path / "b" / "checkpoints" / "last.ckpt"
    train(compose(tmp_path / "c", *base, "algo.rounds=6", f"ckpt_path={ckpt}"))
    a, c = _final(tmp_path / "a"), _final(tmp_path / "c")
    assert a["epoch"] == c["epoch"]
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], c["state_dict"][k]), k
    assert a["flx"]["round"] == c["flx"]["round"] == 6
    for sa, sc in zip(a["flx"]["server_opt"]["m"], c["flx"]["server_opt"]["m"]):
        assert torch.equal(sa, sc)
    visits_a = {cid: s["visits"] for cid, s in a["flx"]["store"]["clients"].items()}
    visits_c = {cid: s["visits"] for cid, s in c["flx"]["store"]["clients"].items()}
    assert visits_a == visits_c and sum(float(v) for v in visits_a.values()) == 6 * 3


def test_checkpoint_schedule_and_best_validation_round(tmp_path: Path) -> None:
    """every_rounds=3 over 5 rounds writes rounds 3 and 5 (the last); a tiny every_seconds makes every round due;
    keep_last=2 keeps the two newest; best.ckpt is the round with the highest logged val/acc (first on ties), and
    test_on=best tests that model."""
    base = [*SMALL, "logger=csv", "algo.rounds=5", "checkpoint.keep_last=null"]
    train(compose(tmp_path / "a", *base, "checkpoint.every_rounds=3"))
    names = sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("round_*"))
    assert names == ["round_00003.ckpt", "round_00005.ckpt"]
    best = ["checkpoint.every_rounds=null", "checkpoint.every_seconds=1e-9", "checkpoint.monitor=val/acc"]
    # client state on disk: the files of the best round stay while best.ckpt refers to them, and test_on=best loads
    # them; the folder holds exactly the files of the kept checkpoints
    disk = [COUNTER, "state_store.backend=disk"]
    metrics = train(compose(tmp_path / "b", *base, *best, *disk, "checkpoint.keep_last=2", "test_on=best"))
    folder = tmp_path / "b" / "checkpoints"
    assert sorted(p.name for p in folder.glob("round_*")) == ["round_00004.ckpt", "round_00005.ckpt"]
    kept = [ckpt(folder / name)["flx"]["store"] for name in ("round_00004.ckpt", "round_00005.ckpt", "best.ckpt")]
    referenced = {os.path.basename(f) for state in kept for f in ClientStateStore.files_of(state)}
    assert {p.name for p in (tmp_path / "b" / "client_state").iterdir()} == referenced
    rows = [r for r in csv.DictReader(open(tmp_path / "b" / "csv" / "metrics.csv")) if r.get("val/acc")]
    accs = [float(r["val/acc"]) for r in rows]
    saved = torch.load(folder / "best.ckpt", map_location="cpu", weights_only=True)
    assert saved["flx"]["round"] == accs.index(max(accs)) + 1
    state = saved["callbacks"][next(k for k in saved["callbacks"] if "RoundCheckpoint" in k)]
    assert state["best_score"] == pytest.approx(max(accs), abs=1e-7)
    dm, module, _ = build(compose(tmp_path / "c", *base))
    module.load_state_dict(saved["state_dict"])
    with torch.no_grad():
        acc = (module.net(dm.data.x_test).argmax(-1) == dm.data.y_test).float().mean()
    assert metrics["test/acc"] == pytest.approx(float(acc), abs=1e-6)


@pytest.mark.parametrize("off", ["checkpoint=null", "trainer.enable_checkpointing=false"])
def test_checkpoints_off_means_no_checkpoint_file_of_any_kind(off: str, tmp_path: Path) -> None:
    """Neither flx's round files nor Lightning's own default checkpoint (``csv/checkpoints/epoch=0-step=1.ckpt``, which
    ``checkpoint=null`` once left): the Trainer has no checkpoint callback and the run folder holds no ``.ckpt``."""
    cfg = compose(tmp_path, *SMALL, "logger=csv", "algo.rounds=1", off)
    _, _, trainer = build(cfg)
    assert trainer.checkpoint_callbacks == []
    train(cfg)
    assert sorted(tmp_path.rglob("*.ckpt")) == [] and (tmp_path / "csv" / "metrics.csv").exists()


def test_resume_from_a_mid_run_round_checkpoint(tmp_path: Path) -> None:
    """Checkpoints are written at every round boundary; resuming from round 3's equals the 6-round run."""
    # client state on disk: the resume, in another run folder, copies round 3's files into its own
    base = [*SMALL, "logger=none", COUNTER, "algo.rounds=6", "checkpoint.keep_last=null", "state_store.backend=disk"]
    train(compose(tmp_path / "a", *base))
    saved = sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("round_*.ckpt"))
    assert saved == [f"round_{r:05d}.ckpt" for r in range(1, 7)]
    round3 = tmp_path / "a" / "checkpoints" / "round_00003.ckpt"
    assert torch.load(round3, map_location="cpu", weights_only=False)["flx"]["round"] == 3
    train(compose(tmp_path / "c", *base, f"ckpt_path={round3}"))
    a, c = _final(tmp_path / "a"), _final(tmp_path / "c")
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], c["state_dict"][k]), k
    sa, sc = (ClientStateStore.from_state_dict(ck["flx"]["store"]) for ck in (a, c))
    assert sa.client_ids() == sc.client_ids() and len(sa) > 0
    assert all(torch.equal(sa.get(cid)["visits"], sc.get(cid)["visits"]) for cid in sa.client_ids())
    assert all(f.startswith(str(tmp_path / "c")) for f in ClientStateStore.files_of(c["flx"]["store"]))


def _cli(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", *args, f"hydra.run.dir={out}", "logger=csv"]
    # this checkout's src first: the child must run the code under test, not another tree's editable install
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _script(name: str, *args: str) -> None:
    """Runs ``scripts/reproduce/<name>`` with ``args``; it must exit 0."""
    cmd = [sys.executable, f"scripts/reproduce/{name}", *args]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _evaluations(out: Path) -> dict[str, list[tuple[float, float]]]:
    """``(round, value)`` of each evaluation key (``val/*``, ``train/client_loss_*``) logged in the run's CSV."""
    rows = list(csv.DictReader(open(out / "csv" / "metrics.csv")))
    keys = [k for k in rows[0] if k.startswith(("val/", "train/client_loss_", "train/personal_objective"))]
    return {k: [(float(r["fl/round"]), float(r[k])) for r in rows if r.get(k)] for k in keys}


def test_one_process_equals_two_processes(tmp_path: Path) -> None:
    """The same run on 1 process and on 2 CPU processes (DDP, gloo) gives the same global model, the same per-client
    state (every rank's store holds every client's state) and the same evaluation: each rank evaluates half the rows
    (and half the clients of the per-client losses and the personalised models) and one all-reduce adds them up, so
    every validated round logs the 1-process values."""
    common = [
        *SMALL,
        "model=mlp",
        "model.dropout=0.2",
        "algo.rounds=3",
        "eval_every=2",  # validated after round 2 only
        "partition.num_clients=8",
        "algo.clients_per_round=5",
        COUNTER,
        "+algo.parts.client_loss._target_=flx.parts.robustness.client_loss.ClientLoss",
        "+algo.parts.personal._target_=flx.parts.personalisation.personal_model.PersonalModel",
        "+algo.parts.personal.model=local",  # clients that trained: their last local model; the others: the global
        "+algo.parts.objective._target_=flx.parts.measures.objective.Objective",  # the personalised objectives, reduced
    ]
    acc_one = _cli(tmp_path / "one", *common).stdout.split("final test_acc=")[1].split()[0]
    # the 2-process run keeps its client state on disk (a folder per rank): the same state, either way
    two = _cli(tmp_path / "two", *common, "trainer=ddp", "trainer.devices=2", "state_store.backend=disk")
    acc_two = two.stdout.split("final test_acc=")[1]
    assert acc_one == acc_two.split()[0]  # each rank evaluates a shard of the test set; the metric syncs them
    evals = [_evaluations(tmp_path / run) for run in ("one", "two")]
    assert evals[0].keys() == evals[1].keys() >= {"val/acc", "val/client_acc_mean", "val/personal_acc_mean"}
    assert {"train/client_loss_max", "train/personal_objective", "val/personal_objective"} <= evals[0].keys()
    for key, points in evals[0].items():
        logged = [2.0, 3.0] if key.startswith("train/personal") else [2.0]  # train/ forms also at the test
        assert [r for r, _ in points] == [r for r, _ in evals[1][key]] == logged, key
        torch.testing.assert_close(evals[1][key], points, rtol=1e-5, atol=1e-6, msg=key)
    one, two = _final(tmp_path / "one"), _final(tmp_path / "two")
    for k in one["state_dict"]:
        torch.testing.assert_close(one["state_dict"][k], two["state_dict"][k], rtol=0, atol=1e-5)
    stores = [ClientStateStore.from_state_dict(ck["flx"]["store"]) for ck in (one, two)]
    visits = [{c: float(s.get(c)["visits"]) for c in s.client_ids()} for s in stores]
    assert visits[0] == visits[1] and sum(visits[0].values()) == 3 * 5
    assert sorted(p.name for p in (tmp_path / "two" / "client_state").iterdir()) == ["rank0", "rank1"]
    # fed.on_server over the real process group: one rank ran it, both received rank 0's result (0 + 0), each round
    checks = next(v for k, v in two["callbacks"].items() if "VisitCounter" in k)["server_checks"]
    assert checks == [[1.0, 0.0]] * 3
    # resumed on 2 processes in its own folder from round 2: each rank reloads the store into its own folder (rank 0
    # adopts its files, rank 1 copies rank 0's; round 3's files of the first run are dropped), and round 3 comes out
    # the same
    round2 = str(tmp_path / "two" / "checkpoints" / "round_00002.ckpt")
    ddp_disk = ["trainer=ddp", "trainer.devices=2", "state_store.backend=disk"]
    _cli(tmp_path / "two", *common, *ddp_disk, f"ckpt_path={round2}")
    again = _final(tmp_path / "two")
    assert all(torch.equal(again["state_dict"][k], two["state_dict"][k]) for k in two["state_dict"])
    store = ClientStateStore.from_state_dict(again["flx"]["store"])
    assert {c: float(store.get(c)["visits"]) for c in store.client_ids()} == visits[1]


def test_per_client_summary_matches_manual_evaluation(tmp_path: Path) -> None:
    """test/client_acc_{mean,worst,std} equal the summary of per-client accuracies on each client's held-out rows
    recomputed by hand, and val/client_acc_* the same on the validation rows of each client's labels."""
    cfg = compose(tmp_path, *SMALL, "partition.test_fraction=0.3", "logger=csv", "algo.rounds=2")
    dm, module, trainer = build(cfg)
    trainer.fit(module, datamodule=dm)
    val_logged = dict(trainer.callback_metrics)
    trainer.test(module, datamodule=dm, verbose=False)
    logged = trainer.callback_metrics
    d = dm.data
    with torch.no_grad():
        accs, val_accs = [], []
        for idx, own in zip(dm.client_test, dm.client_train):
            pred = module.net(d.x_train[idx]).argmax(-1)
            accs.append((pred == d.y_train[idx]).float().mean())
            rows = torch.isin(d.y_val, d.y_train[own].unique())
            val_accs.append((module.net(d.x_val[rows]).argmax(-1) == d.y_val[rows]).float().mean())
    for split, acc, got in (("test", torch.stack(accs), logged), ("val", torch.stack(val_accs), val_logged)):
        torch.testing.assert_close(got[f"{split}/client_acc_mean"], acc.mean(), rtol=0, atol=1e-6)
        torch.testing.assert_close(got[f"{split}/client_acc_worst"], acc.min(), rtol=0, atol=1e-6)
        torch.testing.assert_close(got[f"{split}/client_acc_std"], acc.std(unbiased=False), rtol=0, atol=1e-6)
    header = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0]
    assert "val/client_acc_worst" in header and "val/acc" in header and "fl/round" in header


def test_wandb_offline_and_tensorboard_loggers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for logger in ("wandb", "tensorboard"):
        out = tmp_path / logger
        algo = ["algo=drfa", "algo.rounds=2"] if logger == "wandb" else ["algo.rounds=1"]  # + lambda's W&B table
        metrics = train(compose(out, *SMALL, f"logger={logger}", *algo, "partition.test_fraction=0.2"))
        assert "test/acc" in metrics
    assert json.loads((tmp_path / "wandb" / "lambda.json").read_text())["round_end"][1]
    assert list((tmp_path / "wandb").rglob("*.wandb")), "no offline W&B run written"
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*")), "no TensorBoard events written"


def _write_tiny_cifar10(root: Path, per_batch: int = 12) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, per_batch)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(data, f)


def test_issue_cifar10_command_with_tiny_files(tmp_path: Path) -> None:
    """`algo=fedprox data=cifar10 model=resnet18 partition=dirichlet partition.alpha=0.1` on 200 CIFAR-10 training
    rows over 10 clients: Dirichlet(0.1) leaves clients with one or a few rows, whose minibatches of one row used to
    crash ResNet-18's BatchNorm. They are left out (a pass's last single row; a one-row client is skipped)."""
    _write_tiny_cifar10(tmp_path / "data", per_batch=40)
    args = [
        "algo=fedprox",
        "data=cifar10",
        "model=resnet18",
        "partition=dirichlet",
        "partition.alpha=0.1",
        f"paths.data_dir={tmp_path / 'data'}",
        "partition.num_clients=10",
        "algo.clients_per_round=10",
        "algo.rounds=1",
        "algo.local_steps=2",
        *QUIET,
    ]
    proc = _cli(tmp_path / "run", *args)
    assert "final test_acc=" in proc.stdout
    rows = list(csv.DictReader(open(tmp_path / "run" / "csv" / "metrics.csv")))
    assert [r["fl/dropped_clients"] for r in rows if r.get("fl/dropped_clients")] == ["0.0"]


def test_fast_dev_run_preset(tmp_path: Path) -> None:
    metrics = train(compose(tmp_path, "debug=fdr", *QUIET))
    assert 0.0 <= metrics["test/acc"] <= 1.0


def test_validation_runs_every_eval_every_rounds(tmp_path: Path) -> None:
    """eval_every=2 over 5 rounds: Lightning's validation loop runs after rounds 2 and 4 only."""
    train(compose(tmp_path, *SMALL, "logger=csv", "algo.rounds=5", "eval_every=2"))
    rows = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    epoch, acc = header.index("epoch"), header.index("val/acc")
    logged = {int(r.split(",")[epoch]) + 1: float(r.split(",")[acc]) for r in rows[1:] if r.split(",")[acc]}
    assert sorted(logged) == [2, 4]  # rounds 2 and 4 (Lightning's epochs are 0-based)
    # the curves written at the end hold exactly the logged values, against the round
    curves = json.loads((tmp_path / "curves.json").read_text())
    assert {r: v for r, v in curves["val/acc"]} == pytest.approx(logged, abs=1e-7)
    assert [r for r, _ in curves["train/loss"]] == [1, 2, 3, 4, 5]
    assert (tmp_path / "curves.png").stat().st_size > 0


@pytest.mark.parametrize("precision", ["64-true", "bf16-mixed"])
def test_precision_plugins(tmp_path: Path, precision: str) -> None:
    """Lightning's precision settings reach local training: fp64 trains an fp64 net on fp64 data."""
    dm, module, trainer = build(
        compose(tmp_path, *SMALL, "logger=none", "algo.rounds=2", f"trainer.precision={precision}")
    )
    trainer.fit(module, datamodule=dm)
    expected = torch.float64 if precision == "64-true" else torch.float32
    assert next(module.net.parameters()).dtype == expected and dm.clients.x.dtype == expected
    assert 0.0 <= float(trainer.callback_metrics["val/acc"]) <= 1.0


class RoundEndLog(FederatedCallback):
    """Test part: logs ``part/round`` (the 1-based round) with ``self.log`` at each round's end, as DRFA's lambda
    and WHALE-FL's utility are logged."""

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pl_module.log("part/round", float(trainer.current_epoch + 1), on_epoch=True)


def test_round_scalars_reach_monitors_and_one_csv_row_per_round(tmp_path: Path) -> None:
    """``train/loss`` is in ``trainer.callback_metrics`` as ``self.log(..., on_epoch=True)`` put it: a float32 scalar
    of the federation's mean loss, seen by the monitoring callbacks (``checkpoint.monitor=train/loss``,
    ``mode=min``: best.ckpt is the round with the lowest loss in the CSV). The CSV has one row per round holding
    ``train/loss``, the round's ``fl/*`` counters and what a part logged with ``self.log`` at the round's end."""
    part = f"+algo.parts.tick._target_={__name__}.RoundEndLog"
    monitor = ["checkpoint.monitor=train/loss", "checkpoint.mode=min", "checkpoint.min_seconds=0"]
    dm, module, trainer = build(compose(tmp_path, *SMALL, "logger=csv", "algo.rounds=5", part, *monitor))
    trainer.fit(module, datamodule=dm)
    loss = trainer.callback_metrics["train/loss"]
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert loss == torch.tensor(module.federation.train_loss, dtype=torch.float32)
    rows = [r for r in csv.DictReader(open(tmp_path / "csv" / "metrics.csv")) if r.get("train/loss")]
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [float(r["part/round"]) for r in rows] == [float(r["fl/round"]) for r in rows] == [1, 2, 3, 4, 5]
    assert float(rows[-1]["train/loss"]) == float(loss)
    losses = [float(r["train/loss"]) for r in rows]
    best = ckpt(tmp_path / "checkpoints" / "best.ckpt")["flx"]["round"]
    assert losses[best - 1] == min(losses)


def test_disk_state_store_matches_memory(tmp_path: Path) -> None:
    """state_store.backend=disk checkpoints the same client state as memory, as a table of (client, file) rather than
    the tensors; its folder holds exactly the files the kept checkpoints (rounds 3 and 4, keep_last=2, and best.ckpt,
    here an earlier round) refer to."""
    base = [*SMALL, "logger=none", COUNTER, "algo.rounds=4"]
    train(compose(tmp_path / "mem", *base))
    worst = ["checkpoint.monitor=val/acc", "checkpoint.mode=min"]  # best.ckpt: the lowest val/acc, an early round
    train(compose(tmp_path / "disk", *base, *worst, "state_store.backend=disk"))
    mem, disk = _final(tmp_path / "mem")["flx"]["store"]["clients"], _final(tmp_path / "disk")["flx"]["store"]
    assert "clients" not in disk
    store = ClientStateStore.from_state_dict(disk)
    assert store.client_ids() == sorted(mem)
    for cid, state in mem.items():
        assert torch.equal(state["visits"], store.get(cid)["visits"])
    folder = tmp_path / "disk" / "checkpoints"
    best = ckpt(folder / "best.ckpt")["flx"]
    assert best["round"] < 3 and ClientStateStore.from_state_dict(best["store"]).client_ids()  # its files are there
    kept = [ckpt(folder / f"round_0000{r}.ckpt")["flx"]["store"] for r in (3, 4)] + [best["store"]]
    referenced = {os.path.basename(f) for state in kept for f in ClientStateStore.files_of(state)}
    on_disk = {p.name for p in (tmp_path / "disk" / "client_state").iterdir()}
    assert on_disk == referenced and len(on_disk) > len(mem)  # a client of round 4 also keeps its round-3 file


def test_multirun_sweep(tmp_path: Path) -> None:
    """`-m algo.lr=0.01,0.05` runs one job per value (the pre-run check leaves sweeps to the jobs); each final line says
    which job it is."""
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "algo.lr=0.01,0.05",
        "debug=default",
        "logger=none",
        f"hydra.sweep.dir={tmp_path}",
        *QUIET,
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("final test_acc=") == 2
    # each job's final line names it: its number and its value of the swept key only
    assert re.findall(r"^final test_acc=\d\.\d{4} for (.*)$", proc.stdout, re.M) == [
        "job 0 (algo.lr=0.01)",
        "job 1 (algo.lr=0.05)",
    ]


def test_binary_imbalanced_digits_config(tmp_path: Path) -> None:
    """`data=digits_binary`: 2 classes, positives 1/6 of the training split; test AUROC / pAUC equal sklearn's."""
    dm, module, trainer = build(compose(tmp_path, *SMALL, "logger=none", "algo.rounds=1", "data=digits_binary"))
    assert dm.data.num_classes == 2
    assert abs(float(dm.data.y_train.float().mean()) - 1 / 6) < 1 / len(dm.data.y_train)
    trainer.fit(module, datamodule=dm)
    metrics = trainer.test(module, datamodule=dm, verbose=False)[0]
    with torch.no_grad():
        logits = module.net(dm.data.x_test)
    scores, y = (logits[:, 1] - logits[:, 0]).numpy(), dm.data.y_test.numpy()
    assert metrics["test/auroc"] == pytest.approx(roc_auc_score(y, scores), abs=1e-6)
    assert metrics["test/pauc_0.3"] == pytest.approx(roc_auc_score(y, scores, max_fpr=0.3), abs=1e-6)


def _resume_equals_uninterrupted(tmp_path: Path, *common: str) -> tuple[dict[str, float], dict, dict]:
    """Runs ``common`` for 4 rounds, and for 2 then resumed to 4 from the round-2 checkpoint; asserts the two global
    models are bitwise equal. Returns the uninterrupted run's test metrics and both final checkpoints."""
    full = train(compose(tmp_path / "a", *common, "algo.rounds=4"))
    train(compose(tmp_path / "b", *common, "algo.rounds=2"))
    train(
        compose(tmp_path / "c", *common, "algo.rounds=4", f"ckpt_path={tmp_path / 'b' / 'checkpoints' / 'last.ckpt'}")
    )
    a, c = _final(tmp_path / "a"), _final(tmp_path / "c")
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], c["state_dict"][k]), k
    return full, a, c


FEDXL = ["data=digits_binary", "partition=iid", "partition.num_clients=4", "algo.local_steps=4", *QUIET]


@pytest.mark.parametrize("algo", ["fedxl1", "fedxl2", "codasca"])
def test_fedxl_resume_equals_uninterrupted(tmp_path: Path, algo: str) -> None:
    """FeDXL's pools, server momentum and per-client u tables, and CODASCA's (a, b, alpha), control variates and
    stage reference (a stage starts at round 2: t0 = 8 steps) survive a resume: 4 rounds == 2 + 2 (bitwise)."""
    base = [f"algo={algo}", *FEDXL, "logger=none", *(["algo.t0=8", "algo.lr=1.0"] if algo == "codasca" else [])]
    full, _, _ = _resume_equals_uninterrupted(tmp_path, *base)
    assert full["test/auroc"] > 0.8  # far above chance (0.5) after 4 rounds x 4 steps: the X-risk loss learns


def test_one_logit_fedxl2_learns_and_logs_the_metrics_of_z(tmp_path: Path) -> None:
    """model.binary_head=one_logit: the net outputs one column z; FeDXL2 scores sigmoid(z) and reaches AUROC > 0.8
    in 4 rounds x 4 steps; test AUROC / pAUC equal sklearn's on z, accuracy is that of z > 0."""
    head = ["model=logreg", "model.binary_head=one_logit", "logger=none"]
    dm, module, trainer = build(compose(tmp_path, "algo=fedxl2", *FEDXL, *head, "algo.rounds=4"))
    trainer.fit(module, datamodule=dm)
    metrics = trainer.test(module, datamodule=dm, verbose=False)[0]
    with torch.no_grad():
        z = module.net(dm.data.x_test)
    assert z.shape == (len(dm.data.y_test), 1)
    z, y = z[:, 0].numpy(), dm.data.y_test.numpy()
    assert metrics["test/auroc"] == pytest.approx(roc_auc_score(y, z), abs=1e-6) and metrics["test/auroc"] > 0.8
    assert metrics["test/pauc_0.3"] == pytest.approx(roc_auc_score(y, z, max_fpr=0.3), abs=1e-6)
    assert metrics["test/acc"] == pytest.approx(float(((z > 0) == y).mean()), abs=1e-6)


def test_fedxl_reproduction_script_quick(tmp_path: Path) -> None:
    """scripts/reproduce/fedxl.py --quick writes both tables (every method, with numbers) and the plot."""
    _script("fedxl.py", "--quick", "--rounds", "1", "--out", str(tmp_path))
    table2 = (tmp_path / "table2.md").read_text()
    assert all(m in table2 for m in ("FeDXL2", "Local Pair", "Local SGD (CE)", "Centralized", "CODASCA"))
    rows = "".join(line for line in table2.splitlines() if line.startswith("|"))  # below the header sentence
    assert "not implemented" not in table2 and rows.count("±") == 2 * 5 and "not tuned" in table2.splitlines()[0]
    assert "FeDXL1" in (tmp_path / "table3.md").read_text() and (tmp_path / "convergence.png").stat().st_size > 0


def _one_and_two_processes(tmp_path: Path, *common: str, part: str) -> tuple[dict, dict, dict, dict]:
    """Runs ``common`` on 1 and on 2 CPU processes; asserts equal models; returns both checkpoints and the part's
    state in each."""
    _cli(tmp_path / "one", *common)
    _cli(tmp_path / "two", *common, "trainer=ddp", "trainer.devices=2")
    one, two = _final(tmp_path / "one"), _final(tmp_path / "two")
    for k in one["state_dict"]:
        torch.testing.assert_close(one["state_dict"][k], two["state_dict"][k], rtol=0, atol=1e-5)
    (key,) = [k for k in one["callbacks"] if part in k]
    return one, two, one["callbacks"][key], two["callbacks"][key]


def test_fedxl2_one_process_equals_two_processes(tmp_path: Path) -> None:
    """FeDXL2 on 2 CPU processes: score pools (per-client slots) and the momentum mean ride in the round's one
    all-reduce, so the model, the merged pools and the server momentum equal the 1-process run."""
    _, _, p1, p2 = _one_and_two_processes(tmp_path, "algo=fedxl2", *FEDXL, "algo.rounds=3", part="PassiveBuffer")
    for name in ("pos", "u", "neg"):
        torch.testing.assert_close(p1["pools"][-1][name], p2["pools"][-1][name], rtol=0, atol=1e-5)
    torch.testing.assert_close(p1["gbar"], p2["gbar"], rtol=0, atol=1e-6)


def test_codasca_one_process_equals_two_processes(tmp_path: Path) -> None:
    """CODASCA on 2 CPU processes: (a, b, alpha) and the control-variate deltas go through one all-reduce, the
    clients' c_i through the state all-gather; model, server state and every c_i equal the 1-process run."""
    common = ["algo=codasca", *FEDXL, "algo.rounds=3", "algo.t0=8"]
    one, two, p1, p2 = _one_and_two_processes(tmp_path, *common, part="Codasca")
    for name in ("abz", "c", "ref"):
        torch.testing.assert_close(p1[name], p2[name], rtol=0, atol=1e-5)
    c1, c2 = one["flx"]["store"]["clients"], two["flx"]["store"]["clients"]
    assert c1.keys() == c2.keys() == set(range(4))
    for cid in c1:
        torch.testing.assert_close(c1[cid]["c"], c2[cid]["c"], rtol=0, atol=1e-5)


def test_fedxl_reproduction_script_on_cifar10_files(tmp_path: Path) -> None:
    """--data cifar10 reads the real CIFAR-10 format (tiny files here) and fills both tables (small overrides)."""
    _write_tiny_cifar10(tmp_path / "data", per_batch=40)
    small = ["model=logreg", "partition.num_clients=2", "algo.local_steps=2", f"paths.data_dir={tmp_path / 'data'}"]
    out = ["--out", str(tmp_path / "out"), "--set", *small]
    _script("fedxl.py", "--data", "cifar10", "--quick", "--rounds", "1", *out)
    table2 = (tmp_path / "out" / "table2.md").read_text()
    rows = "".join(line for line in table2.splitlines(keepends=True) if line.startswith("|"))
    assert rows.count("±") == 2 * 5 and "not tuned" in table2.splitlines()[0]  # the header says how values were chosen


DRFA = ["algo=drfa", "data=digits", "model=logreg", "partition=iid", "partition.num_clients=2", *QUIET]
DRFA += ["algo.clients_per_round=2", "algo.local_steps=3", "algo.gamma=0.5", "partition.test_fraction=0.2"]


def _drfa_cohorts(ckpt: dict, rounds: int, n: int = 2, m: int = 2, seed: int = 0) -> list[list[int]]:
    """The cohorts the run drew: m draws from lambda^(r) with replacement, on the federation's (seed, round) stream."""
    from flx.sampling import SAMPLE_TAG, derive_seed

    (key,) = [k for k in ckpt["callbacks"] if "LambdaSampling" in k]
    history = [[1 / n] * n] + ckpt["callbacks"][key]["history"]
    rngs = [np.random.default_rng(derive_seed(seed, r, SAMPLE_TAG)) for r in range(rounds)]
    return [
        rng.choice(n, size=m, replace=True, p=np.array(history[r]) / sum(history[r])).tolist()
        for r, rng in enumerate(rngs)
    ]


def test_drfa_resume_equals_uninterrupted(tmp_path: Path) -> None:
    """lambda, its history and the model survive a resume: 4 rounds == 2 + 2 (bitwise)."""
    _, a, c = _resume_equals_uninterrupted(tmp_path, *DRFA, "logger=none")
    (key,) = [k for k in a["callbacks"] if "LambdaSampling" in k]
    assert torch.equal(a["callbacks"][key]["lam"], c["callbacks"][key]["lam"])
    assert a["callbacks"][key]["history"] == c["callbacks"][key]["history"] and len(a["callbacks"][key]["history"]) == 4


def test_vectorized_drfa_through_the_trainer_equals_the_sequential_run(tmp_path: Path) -> None:
    """``algo.vectorize=true`` end to end (Lightning's loop, the console, checkpoints): DRFA with FedProx's term, the
    model and lambda equal the sequential run's up to fp32 summation order (fp64: tests/test_vectorized.py)."""
    drfa = [o.replace("num_clients=2", "num_clients=6") for o in DRFA]
    base = [*drfa, "logger=none", "algo.rounds=4", "+algo.parts.prox._target_=flx.parts.proximal.prox.Prox"]
    train(compose(tmp_path / "seq", *base))
    train(compose(tmp_path / "vec", *base, "algo.vectorize=true"))
    seq, vec = _final(tmp_path / "seq"), _final(tmp_path / "vec")
    for k in seq["state_dict"]:
        torch.testing.assert_close(vec["state_dict"][k], seq["state_dict"][k], rtol=0, atol=1e-5)
    (key,) = [k for k in seq["callbacks"] if "LambdaSampling" in k]
    torch.testing.assert_close(vec["callbacks"][key]["lam"], seq["callbacks"][key]["lam"], rtol=0, atol=1e-6)
    lam = seq["callbacks"][key]["lam"]
    assert len(lam) == 6 and not torch.allclose(lam, torch.full_like(lam, 1 / 6))


def test_drfa_one_process_equals_two_processes(tmp_path: Path) -> None:
    """DRFA on 2 CPU processes: the snapshot sum rides in the round's all-reduce and every rank evaluates v, so lambda
    and the model equal the 1-process run, including rounds whose cohort (drawn with replacement) holds one distinct
    client and leaves a rank idle."""
    one, _, p1, p2 = _one_and_two_processes(tmp_path, *DRFA, "algo.rounds=4", part="LambdaSampling")
    assert any(len(set(c)) == 1 for c in _drfa_cohorts(one, 4))
    torch.testing.assert_close(p1["lam"], p2["lam"], rtol=0, atol=1e-6)
    # the logged round loss is the mean over all the round's clients, whatever rank trained them (or none)
    losses = [
        [
            float(r["train/loss"])
            for r in csv.DictReader(open(next((tmp_path / run).rglob("metrics.csv"))))
            if r.get("train/loss")
        ]
        for run in ("one", "two")
    ]
    assert len(losses[0]) == 4 and np.allclose(losses[0], losses[1], rtol=0, atol=1e-5)
    lam_json = json.loads((tmp_path / "one" / "lambda.json").read_text())["round_end"]
    assert len(lam_json) == 4 and all(abs(sum(row) - 1) < 1e-9 for row in lam_json)


def test_drfa_repeat_one_process_equals_two_processes(tmp_path: Path) -> None:
    """algo.duplicates=repeat under DDP: a cohort holding one client twice puts one copy on each rank (no idle
    rank); each copy keeps its (seed, round, client, copy) stream wherever it runs, so lambda, the model and the
    logged max_i f_i equal the 1-process run."""
    from flx.run import federation_config

    assert federation_config(compose(tmp_path / "cfg", *DRFA, "algo.duplicates=repeat")).duplicates == "repeat"
    common = [*DRFA, "algo.rounds=4", "algo.duplicates=repeat"]
    one, _, p1, p2 = _one_and_two_processes(tmp_path, *common, part="LambdaSampling")
    assert any(len(set(c)) == 1 for c in _drfa_cohorts(one, 4))
    torch.testing.assert_close(p1["lam"], p2["lam"], rtol=0, atol=1e-6)
    # ClientLoss on 2 ranks: each computes half the clients, one sum; the logged max_i f_i equals the 1-process one
    key = "train/client_loss_max"
    logged = [
        [float(r[key]) for r in csv.DictReader(open(next((tmp_path / run).rglob("metrics.csv")))) if r.get(key)]
        for run in ("one", "two")
    ]
    assert len(logged[0]) == 4 and np.allclose(logged[0], logged[1], rtol=0, atol=1e-5)


def test_drfa_reproduction_script_quick(tmp_path: Path) -> None:
    """scripts/reproduce/drfa.py --quick fills the table for every method and writes both plots."""
    _script("drfa.py", "--quick", "--rounds", "2", "--out", str(tmp_path))
    table = (tmp_path / "table.md").read_text()
    for method in ("DRFA", "AFL", "q-FedAvg", "FedAvg", "tau=5", "tau=15", "authors' code"):
        assert method in table, method
    assert (tmp_path / "worst_acc.png").stat().st_size > 0 and (tmp_path / "lambda.png").stat().st_size > 0


def test_issue_drfa_commands(tmp_path: Path) -> None:
    """`algo=drfa data=fashion_mnist partition=one_class_per_client` composes (Fashion-MNIST is not on this machine,
    so the pre-run check would stop at its files: Hydra's compose alone); DRFA runs on Adult (by race, MLP 14-50-50-2)
    from tiny UCI files, and algo=drfa_prox / drfa_ga / afl / qfedavg run on digits."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from flx.config import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = hydra_compose("train", ["algo=drfa", "data=fashion_mnist", "partition=one_class_per_client"])
    assert cfg.algo.parts.lambda_sampling.gamma == 8e-3 and cfg.partition.num_clients == 10
    for algo in ("drfa_prox", "drfa_ga", "afl", "qfedavg"):
        metrics = train(compose(tmp_path / algo, f"algo={algo}", *SMALL, "algo.rounds=2", "logger=none"))
        assert 0 <= metrics["test/acc"] <= 1
    prox = ["+algo.parts.prox._target_=flx.parts.proximal.prox.Prox", "+algo.parts.prox.mu=0.1"]
    cfg = compose(tmp_path / "prox", "algo=drfa", *prox, *SMALL, "algo.rounds=2", "logger=none")
    assert list(cfg.algo.parts) == ["lambda_sampling", "client_loss", "prox"]
    assert 0 <= train(cfg)["test/acc"] <= 1
    _write_tiny_adult(tmp_path / "data" / "adult")
    adult = [
        "algo=drfa",
        "data=adult",
        "data.loader.split_by=race",
        "partition=by_group",
        "client_eval=test_group",
    ]
    adult += ["model=mlp", "model.hidden=[50,50]", f"paths.data_dir={tmp_path / 'data'}", "algo.rounds=2", *QUIET]
    metrics = train(compose(tmp_path / "adult", *adult, "logger=none"))
    assert 0 <= metrics["test/client_acc_worst"] <= metrics["test/client_acc_mean"] <= 1


def _write_tiny_adult(folder: Path, per_race: int = 8) -> None:
    """UCI adult.data / adult.test rows (15 comma-space separated columns; the test file's comment line and '.')."""
    rng = np.random.default_rng(0)
    races = ["White", "Black", "Asian-Pac-Islander", "Amer-Indian-Eskimo", "Other"]

    def rows(dot: str) -> list[str]:
        out = []
        for race in races:
            for _ in range(per_race):
                age, hours, label = int(rng.integers(18, 70)), int(rng.integers(10, 60)), rng.random() < 0.3
                sex = "Female" if rng.random() < 0.5 else "Male"
                out.append(
                    f"{age}, Private, {int(rng.integers(20000, 300000))}, Bachelors, 13, Never-married, Sales, "
                    f"Not-in-family, {race}, {sex}, 0, 0, {hours}, United-States, {'>50K' if label else '<=50K'}{dot}"
                )
        return out

    folder.mkdir(parents=True)
    (folder / "adult.data").write_text("\n".join(rows("")) + "\n")
    (folder / "adult.test").write_text("|1x3 Cross validator\n" + "\n".join(rows(".")) + "\n")


DP = [*SMALL, "privacy=central", "privacy.noise_multiplier=1.0", "logger=csv"]


def test_issue_privacy_command_spends_at_most_its_target(tmp_path: Path) -> None:
    """The issue's command on the bundled data: the noise is calibrated before round 1 so that the 30 rounds spend
    epsilon 8; ``privacy/epsilon`` grows every round in the CSV and the final line ends with it."""
    proc = _cli(tmp_path, *QUIET, "privacy=central", "privacy.target_epsilon=8")
    final = proc.stdout.strip().splitlines()[-1]
    assert final.startswith("final test_acc=") and "epsilon=" in final
    assert float(final.split("epsilon=")[1].split()[0]) <= 8.0
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("privacy/epsilon")]
    eps = [float(r["privacy/epsilon"]) for r in rows]
    assert len(eps) == 30 and all(a < b for a, b in zip(eps, eps[1:])) and eps[-1] <= 8.0 + 1e-5
    ckpt = _final(tmp_path)
    (state,) = [v for k, v in ckpt["callbacks"].items() if "CentralDP" in k]
    assert state["rounds"] == 30 and 1.0 < state["sigma"] < 4.0 and state["epsilon"] <= 8.0


LOCAL_DP = [*SMALL, "privacy=local", "privacy.noise_multiplier=1.0", "logger=csv"]


@pytest.mark.parametrize(
    "dp, part",
    [
        ([*DP, "algo=fedprox"], "CentralDP"),
        (
            [*DP, "algo=pfedfbe", "algo.lr=0.05", "algo.lam=20", "algo.batch_size=32", "partition.test_fraction=0.2"],
            "CentralDP",
        ),
        (
            [*DP, "algo=fedprox", "privacy.adaptive=true", "privacy.count_noise=2.0", "privacy.sampling=fixed"]
            + ["privacy.accountant=rdp"],
            "CentralDP",
        ),
        ([*LOCAL_DP, "algo=fedprox"], "LocalDP"),
        ([*LOCAL_DP, "algo=drfa"], "LocalDP"),
        ([*LOCAL_DP, "algo.vectorize=true", "privacy.sampling=fixed", "privacy.accountant=rdp"], "LocalDP"),
    ],
    ids=["fedprox", "pfedfbe", "fedprox-adaptive-fixed", "local-fedprox", "local-drfa", "local-vectorized-fixed"],
)
def test_privacy_composes_resume_and_two_processes(tmp_path: Path, dp: list[str], part: str) -> None:
    """DP composes with FedProx and pFedFBE (its personal models stay on the clients), central or local (DP-SGD
    steps, sequential or stacked; with DRFA, whose lambda step's losses are released noised): 4 rounds == 2 + 2
    resumed (bitwise: the noise is a function of (seed, round) or (seed, round, client), the ledger continues), and 2
    processes give the 1-process model (every rank draws the same noise and books the same clients' steps)."""
    _, a, c = _resume_equals_uninterrupted(tmp_path, *dp)
    (key,) = [k for k in a["callbacks"] if part in k]
    assert a["callbacks"][key] == c["callbacks"][key] and a["callbacks"][key]["rounds"] == 4
    _, _, p1, p2 = _one_and_two_processes(tmp_path / "ddp", *dp, "algo.rounds=4", part=part)
    assert p1 == p2


def test_local_privacy_command_spends_at_most_its_target(tmp_path: Path) -> None:
    """``privacy=local privacy.target_epsilon=8`` on the bundled data: sigma is calibrated for a client that would
    join all 30 rounds, so the worst-off row's epsilon stays below 8; the CSV has it every round, the final line ends
    with it, the checkpoint holds every client's steps (10 a round joined)."""
    proc = _cli(tmp_path, *QUIET, "privacy=local", "privacy.target_epsilon=8")
    final = proc.stdout.strip().splitlines()[-1]
    assert final.startswith("final test_acc=") and float(final.split("epsilon=")[1].split()[0]) <= 8.0
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r.get("privacy/epsilon")]
    eps = [float(r["privacy/epsilon"]) for r in rows]
    assert len(eps) == 30 and all(a <= b for a, b in zip(eps, eps[1:])) and 0 < eps[-1] <= 8.0
    (state,) = [v for k, v in _final(tmp_path)["callbacks"].items() if "LocalDP" in k]
    assert state["rounds"] == 30 and sum(state["steps"].values()) == 30 * 10 * 10
    assert state["epsilon"] == pytest.approx(eps[-1], rel=1e-6)


def test_local_privacy_budget_stops_before_a_client_could_exceed_it(tmp_path: Path, capsys) -> None:
    """noise_multiplier 1 with a budget: the run stops before the first round in which a drawn client would pass it,
    with one line (stderr), and ``train`` raises the refusal (exit status 4) once the run is tested."""
    with pytest.raises(RoundRefused):
        train(compose(tmp_path, *LOCAL_DP, "algo.rounds=8", "privacy.target_epsilon=3"))
    err = capsys.readouterr().err
    (state,) = [v for k, v in _final(tmp_path)["callbacks"].items() if "LocalDP" in k]
    assert "flx: privacy budget: round" in err and "> privacy.target_epsilon=3 (delta=1e-05)" in err
    assert 0 < state["rounds"] < 8 and state["epsilon"] <= 3


def test_privacy_budget_stops_before_the_round_that_would_exceed_it(tmp_path: Path, capsys) -> None:
    """noise_multiplier 1 with 6 clients, 3 expected a round, spends epsilon 5.84 after 3 rounds and 6.68 after 4: a
    budget of 6 stops the 6-round run after round 3 with one line, and the run ends as usual (tested, final line)."""
    with pytest.raises(RoundRefused):
        train(compose(tmp_path, *DP, "algo=fedprox", "algo.rounds=6", "privacy.target_epsilon=6"))
    out, err = capsys.readouterr()
    line = "flx: privacy budget: round 4 would spend epsilon=6.6"
    assert (
        line in err and "> privacy.target_epsilon=6 (delta=1e-05): the budget is spent, the run ends with the 3 " in err
    )
    ckpt = _final(tmp_path)
    (state,) = [v for k, v in ckpt["callbacks"].items() if "CentralDP" in k]
    assert ckpt["flx"]["round"] == 3 and state["rounds"] == 3 and state["epsilon"] <= 6
    assert out.strip().splitlines()[-1].endswith(f"epsilon={state['epsilon']:.4f} private=all")


@pytest.mark.parametrize("mode", ["central", "local"])
def test_privacy_reproduction_script_quick(tmp_path: Path, mode: str) -> None:
    """scripts/reproduce/privacy.py writes the table (the spent epsilon within its target) and the plot; local DP
    as a variant (``--set``): its files are named after it and the command in the table repeats it."""
    extra = [] if mode == "central" else ["--set", "privacy.clip_mode=per_layer"]
    _script("privacy.py", "--mode", mode, "--seeds", "1", "--epsilons", "8", *extra, "--out", str(tmp_path))
    name = "digits" if mode == "central" else "digits_local_clip_mode_per_layer"
    text = (tmp_path / f"{name}.md").read_text()
    rows = [r for r in text.splitlines() if r.startswith("| 8 |") or "| none |" in r]
    assert len(rows) == 2 and float(rows[0].split("|")[2]) <= 8.0
    assert " ".join(["--epsilons 8", *extra]) + "`" in text
    assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_privacy_accounts_for_the_clients_that_train(tmp_path: Path) -> None:
    """A few-shot partition keeps evaluation-only clients apart: the cohort is drawn from the training clients, so
    the accountant's population (its q = m / N) is theirs, not all clients'."""
    dm, _, trainer = build(compose(tmp_path, "algo=per_fedavg", "privacy=central", "privacy.noise_multiplier=1.0"))
    (dp,) = [cb for cb in trainer.callbacks if type(cb).__name__ == "CentralDP"]
    assert dm.clients.num_train_clients < dm.num_clients
    assert dp.mechanism.num_clients == dm.clients.num_train_clients


UPLOADS = {  # every algorithm whose clients send more than their model update, and the channel named
    "fedxl1": (["data=digits_binary"], "PassiveBuffer sends the prediction scores of its rows"),
    "codasca": (["data=digits_binary"], "Codasca sends its control variates and AUC statistics"),
    "qfedavg": ([], "QFFL sends its loss (q-FFL's h_i weights)"),
    "whale": ([], "Subnetwork sends its Fisher values"),
    "augfl": ([], "MetaUpdate sends its ADMM dual and query-set gradients"),
    "drfa_ga": ([], "LambdaSampling sends its full local loss"),
    "drfa": ([], "LambdaSampling sends its losses at the snapshot model"),
}


@pytest.mark.parametrize("mode", ["central", "local"])
@pytest.mark.parametrize("algo", sorted(UPLOADS))
def test_privacy_refuses_a_channel_it_does_not_cover(tmp_path: Path, algo: str, mode: str) -> None:
    """An algorithm whose clients send more than their model update stops before anything is written, with one line
    naming the channel, except DRFA under privacy=local, whose losses are released noised and accounted (composed
    end to end in test_privacy_composes_resume_and_two_processes)."""
    out = tmp_path / "run"
    extra, channel = UPLOADS[algo]
    cfg = compose(out, f"algo={algo}", *extra, *QUIET, f"privacy={mode}", "privacy.noise_multiplier=1.0")
    if (algo, mode) == ("drfa", "local"):
        build(cfg)
        return
    with pytest.raises(ConfigError, match=re.escape(channel)):
        build(cfg)
    assert not (out / "checkpoints").exists() and not (out / ".hydra").exists()
