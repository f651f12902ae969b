"""`python train.py algo=augfl` end to end on the embedded digits, with the shipped defaults (few-shot clients, a PM
trained on the server rows at the start, CRD, held-out clients adapted by one step): it learns, and a run SIGKILLed
in the middle of round 5 resumes from disk to the same model, bitwise (duals in the client store, the CRD heads and
memory banks in the part's state, the PM read back from the run folder). Subprocesses: marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_crash_safety import KILL, assert_same_model, ckpt, metric_rows, run

pytestmark = pytest.mark.slow
AUGFL = ["algo=augfl", "algo.rounds=9", "eval_every=3", "logger=csv"]


@pytest.fixture(scope="module")
def augfl_run(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("augfl")
    proc = run(out, *AUGFL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_default_augfl_learns(augfl_run) -> None:
    """The held-out clients' one-step-adapted accuracy (on their query sets) rises by more than 0.1 from round 3 to
    round 9 (0.46 -> 0.61 when written); the PM was trained once and kept in the run folder. Whether the PM helps is a
    results question: docs/augfl.md (scripts/reproduce/augfl.py)."""
    out, proc = augfl_run
    assert (out / "pm.pt").exists() and proc.stderr.count("pretrain_pm") > 0
    curve = [float(r["val/personal_acc_mean"]) for r in metric_rows(out) if "val/personal_acc_mean" in r]
    assert len(curve) == 3 and curve[-1] > curve[0] + 0.1, curve


def test_sigkill_mid_round_then_resume_equals_uninterrupted(augfl_run, tmp_path: Path) -> None:
    out = tmp_path / "run"
    killed = run(out, *AUGFL, *KILL)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert ckpt(out / "checkpoints" / "last.ckpt")["flx"]["round"] == 4
    resumed = run(out, *AUGFL, "ckpt_path=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_model(ckpt(augfl_run[0] / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))
    assert "pretrain_pm" not in resumed.stderr  # the PM came back from the run folder


def _write_cifar10(root: Path, per_class: int = 60) -> None:
    """CIFAR-10 in its real on-disk format (python pickles of uint8 rows and labels): 5 train batches, 1 test."""
    import pickle

    import numpy as np

    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    labels = np.repeat(np.arange(10), per_class)
    rng.shuffle(labels)
    for i, part in enumerate(np.array_split(labels, 5), start=1):
        # class-dependent mean colour, so the task is learnable
        data = (rng.integers(0, 60, (len(part), 3072)) + 19 * part[:, None]).astype(np.uint8)
        batch = {b"batch_label": b"training batch", b"data": data, b"labels": part.tolist()}
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(batch, protocol=2))
    test = np.arange(50) % 10
    data = (rng.integers(0, 60, (50, 3072)) + 19 * test[:, None]).astype(np.uint8)
    (folder / "test_batch").write_bytes(pickle.dumps({b"data": data, b"labels": test.tolist()}, protocol=2))


def test_the_headline_command_on_a_real_format_cifar10_folder(tmp_path: Path) -> None:
    """`python train.py algo=augfl data=cifar10 model=resnet8x4` on a CIFAR-10 folder in the real format (tiny: 600
    training images, so 10 clients of M = 10), with the PM trained in the run: it runs to the end with the
    paper's nets and a finite held-out accuracy."""
    _write_cifar10(tmp_path / "data")
    size = ["partition.num_clients=10", "partition.samples_min=10", "algo.pm_pretrain.epochs=2"]
    proc = run(
        tmp_path / "run",
        "algo=augfl",
        "data=cifar10",
        "model=resnet8x4",
        f"paths.data_dir={tmp_path / 'data'}",
        *size,
        "algo.rounds=2",
        "eval_every=2",
        "logger=csv",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = [r for r in metric_rows(tmp_path / "run") if "test/personal_acc_mean" in r][-1]
    assert 0 <= float(final["test/personal_acc_mean"]) <= 1 and (tmp_path / "run" / "pm.pt").exists()
