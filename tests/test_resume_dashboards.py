"""Dashboards across kills and resumes, through the real entry point: one default run (30 rounds, ``logger=[csv,wandb]``
offline) SIGKILLed in rounds 5, 10 and 13 (once rounds 4, 9 and 12 are checkpointed) and resumed with
``ckpt_path=auto`` each time, four processes in all.

* the checkpoint each kill leaves holds the learning-curve history up to its own round (the round the next process
  resumes from included: it used to be recorded only at the next round's start, after the checkpoint);
* ``curves.json`` and the last checkpoint's history hold rounds 1..30 exactly once, equal to ``metrics.csv``;
* the four processes log ONE W&B run (the id stored in the checkpoints), whose rows are the rounds: steps 1..30
  exactly once across the four run files (the resumed processes continue the steps, never lower), then the test.

Subprocesses (marked slow); the four runs are shared by the tests.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from runs import ckpt, run

from flx.callbacks.curves import RoundCurves
from flx.wandb_files import load_run, read_records

pytestmark = pytest.mark.slow
ROUNDS, KILLS = 30, (4, 9, 12)
ARGS = ["logger=[csv,wandb]", f"algo.rounds={ROUNDS}"]
KEYS = ("train/loss", "val/acc", "val/loss", "val/client_acc_mean")


def kill_after(rounds: int) -> list[str]:
    """SIGKILL in round ``rounds + 1`` once round ``rounds``'s checkpoint is on disk, 1.5 s later than that (W&B
    writes its file every second: flx.wandb_logging.FLUSH_SECONDS)."""
    kill = "+callbacks.kill"
    return [f"{kill}._target_=helpers.KillMidRound", f"{kill}.round={rounds}", f"{kill}.delay=1.5"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict]]:
    """The run folder after the four processes, and each kill's ``last.ckpt`` (read before the next resume)."""
    out = tmp_path_factory.mktemp("resumed") / "run"
    left: dict[int, dict] = {}
    for i, rounds in enumerate(KILLS):
        proc = run(out, *ARGS, *kill_after(rounds), *(["ckpt_path=auto"] if i else []))
        assert proc.returncode == -9, proc.stderr[-3000:]
        left[rounds] = ckpt(out / "checkpoints" / "last.ckpt")
    proc = run(out, *ARGS, "ckpt_path=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, left


def csv_values(out: Path, key: str) -> dict[int, float]:
    """``{round: value}`` of ``key`` in ``metrics.csv``; every round once."""
    with open(out / "csv" / "metrics.csv", newline="") as f:
        points = [(int(float(r["fl/round"])), float(r[key])) for r in csv.DictReader(f) if r.get(key)]
    assert len(points) == len(dict(points)), f"{key}: a round twice in metrics.csv"
    return dict(points)


def history_of(checkpoint: dict) -> dict[str, list[tuple[int, float]]]:
    curves = RoundCurves()
    curves.load_state_dict(checkpoint["callbacks"]["RoundCurves"])
    return dict(curves.history)


def test_each_kill_leaves_the_history_up_to_its_checkpoint(resumed) -> None:
    _, left = resumed
    for rounds, checkpoint in left.items():
        assert checkpoint["flx"]["round"] == rounds
        history = history_of(checkpoint)
        for key in KEYS:
            assert [r for r, _ in history[key]] == list(range(1, rounds + 1)), (rounds, key)


def test_curves_and_the_checkpointed_history_hold_every_round_once(resumed) -> None:
    out, _ = resumed
    curves = json.loads((out / "curves.json").read_text())
    history = history_of(ckpt(out / "checkpoints" / "last.ckpt"))
    assert (out / "curves.png").stat().st_size > 0
    assert {k: [list(p) for p in v] for k, v in history.items()} == {k: v for k, v in curves.items() if v}
    for key in KEYS:
        assert [r for r, _ in curves[key]] == list(range(1, ROUNDS + 1)), key
        assert dict(curves[key]) == pytest.approx(csv_values(out, key), rel=1e-6), key


def test_one_wandb_run_with_every_round_once(resumed) -> None:
    """Four run files (one a process) of the same run id; their rows are steps 1..30, each once, each the round
    ``fl/round`` with the values of metrics.csv; the last file ends with the test (step 31) and an exit record, the
    killed ones have none."""
    out, left = resumed
    folders = sorted((out / "wandb").glob("offline-run-*"))
    assert len(folders) == 4
    ids = {f.name.rsplit("-", 1)[1] for f in folders}
    assert len(ids) == 1 and all(c["wandb"]["run_ids"] == list(ids) for c in left.values())
    rows, exits = [], []
    for folder in folders:
        (path,) = folder.glob("run-*.wandb")
        records = read_records(path)
        assert {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"} == ids
        exits.append(sum(r.WhichOneof("record_type") == "exit" for r in records))
        rows += load_run(folder).history
    assert exits == [0, 0, 0, 1]
    assert [row["_step"] for row in rows] == list(range(1, ROUNDS + 2))
    assert [row["fl/round"] for row in rows] == [*range(1, ROUNDS + 1), ROUNDS]
    assert "test/acc" in rows[-1]
    for key in KEYS:
        assert {row["_step"]: row[key] for row in rows if key in row} == pytest.approx(csv_values(out, key), rel=1e-6)


def test_a_requeue_finishes_the_wandb_run_with_its_last_round_then_the_job_continues_it(tmp_path: Path) -> None:
    """The requeue signal in round 5 (``checkpoint.requeue=true``; no SLURM here, so no ``scontrol``): the first
    process's W&B file holds rounds 1..5, round 5 whole (its training row, logged by Lightning after the checkpoint,
    is written before the requeue), marked preempting, with an exit record; the requeued job continues the same run
    from step 6."""
    out, args = tmp_path / "run", [*ARGS, "algo.rounds=8", "checkpoint.requeue=true"]
    signal = [*kill_after(4)[:2], "+callbacks.kill.signal=SIGUSR1"]
    first = run(out, *args, *signal)
    assert first.returncode == 138 and "requeued after round 5" in first.stderr, first.stderr[-3000:]  # 128+SIGUSR1
    second = run(out, *args, "ckpt_path=auto")
    assert second.returncode == 0, second.stderr[-3000:]
    folders = sorted((out / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and len({f.name.rsplit("-", 1)[1] for f in folders}) == 1
    kinds = [r.WhichOneof("record_type") for r in read_records(next(folders[0].glob("run-*.wandb")))]
    assert kinds.count("exit") == 1 and "preempting" in kinds
    before, after = (load_run(f).history for f in folders)
    assert [row["_step"] for row in before] == [1, 2, 3, 4, 5] and [row["_step"] for row in after] == [6, 7, 8, 9]
    for key in KEYS:
        logged = {row["_step"]: row[key] for row in before + after if key in row}
        assert logged == pytest.approx(csv_values(out, key), rel=1e-6) and sorted(logged) == list(range(1, 9)), key
