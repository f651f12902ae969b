"""The round checkpoint's schedule (:class:`flx.callbacks.checkpoint.RoundCheckpoint`): ``every_rounds``,
``every_seconds`` and the wall-time floor ``min_seconds``, on a fake clock; the round files' lifecycle
(:class:`flx.checkpoint_io.RoundFiles`); the shipped default on a real run.

The rule: a round is written when ``every_rounds`` divides it, or ``every_seconds`` have passed since the last
checkpoint, and at least ``min_seconds`` have passed since the last checkpoint (or since training started); the last
round and a round after which the run stops are always written. With rounds of ``d`` seconds, ``every_rounds=1`` and
``min_seconds = s``, the written rounds are every ``ceil(s / d)``-th, then the last.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

import flx.callbacks.checkpoint as checkpoint
from flx.callbacks.checkpoint import RoundCheckpoint
from flx.checkpoint_io import RoundFiles
from flx.config import precheck
from flx.run import train


class FakeClock:
    """``time.monotonic`` of the checkpoint module, advanced by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class NoCollective:
    """A strategy of a 2-rank run whose collectives fail the test: the schedule must come from the loop's clock."""

    def broadcast(self, obj: object, src: int = 0) -> object:
        raise AssertionError("RoundCheckpoint made a collective of its own")


def written(
    monkeypatch: pytest.MonkeyPatch,
    rounds: int,
    seconds: float,
    stop_after: int | None = None,
    agreed: bool = False,
    **kw: object,
) -> list[int]:
    """The rounds a :class:`RoundCheckpoint` writes over ``rounds`` rounds of ``seconds`` each (fake clock, one
    process; the save itself is recorded, not performed). ``agreed``: rank 1 of 2 ranks, whose own clock is
    meaningless (it stands still), given rank 0's clock at each boundary by the fit loop, as
    :class:`flx.loop.FederatedFitLoop` does with the signal."""
    clock = FakeClock()
    loop = SimpleNamespace(signal=0, clock=clock.now) if agreed else SimpleNamespace(signal=0)
    if not agreed:
        monkeypatch.setattr(checkpoint.time, "monotonic", clock)
    cb = RoundCheckpoint("unused", **kw)  # type: ignore[arg-type]
    saved: list[int] = []
    monkeypatch.setattr(
        cb, "_save_round", lambda trainer, r: saved.append(r) or setattr(cb, "_last_time", cb._now(trainer))
    )
    trainer = SimpleNamespace(
        fast_dev_run=False, sanity_checking=False, max_epochs=rounds, should_stop=False, world_size=2 if agreed else 1,
        fit_loop=loop, is_global_zero=not agreed, current_epoch=0, lightning_module=None, strategy=NoCollective(),
    )  # fmt: skip
    cb.on_train_start(trainer, None)  # type: ignore[arg-type]
    for epoch in range(rounds):
        clock.now += seconds
        loop.clock = clock.now if agreed else None
        trainer.current_epoch = epoch
        trainer.should_stop = stop_after is not None and epoch + 1 >= stop_after
        cb.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
        if trainer.should_stop:
            break
    return saved


def test_every_rank_follows_rank_0_s_clock_from_the_loop_without_a_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DDP the schedule's clock is rank 0's, received with the round's signal: a rank whose own clock says
    otherwise writes the rounds rank 0 writes, and makes no broadcast of its own (one collective a round boundary)."""
    for kw in ({"min_seconds": 5}, {"every_rounds": 3, "min_seconds": 5}, {"every_rounds": None, "every_seconds": 4}):
        assert written(monkeypatch, 13, 1.5, agreed=True, **kw) == written(monkeypatch, 13, 1.5, **kw), kw


def test_floor_writes_every_ceil_s_over_d_th_round_and_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rounds of d = 1.5 s, min_seconds s = 5: every ceil(5 / 1.5) = 4th round (6 s after the last), then the last."""
    k = math.ceil(5 / 1.5)
    assert written(monkeypatch, 13, 1.5, min_seconds=5) == [*range(k, 13, k), 13]


def test_floor_zero_or_long_rounds_write_every_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """min_seconds=0 (or null) is the plain every_rounds schedule; rounds longer than the floor are all written."""
    assert written(monkeypatch, 6, 0.01, min_seconds=0) == [1, 2, 3, 4, 5, 6]
    assert written(monkeypatch, 6, 0.01, min_seconds=None) == [1, 2, 3, 4, 5, 6]
    assert written(monkeypatch, 6, 5.0, min_seconds=5) == [1, 2, 3, 4, 5, 6]


def test_floor_defers_every_rounds_to_its_next_multiple(monkeypatch: pytest.MonkeyPatch) -> None:
    """every_rounds=3 with rounds of 1.5 s, min_seconds=5: round 3 (4.5 s) is too soon, round 6 (9 s) is written;
    round 9 is 4.5 s after it (skipped), round 12 (9 s) written; 13 is the last."""
    assert written(monkeypatch, 13, 1.5, every_rounds=3, min_seconds=5) == [6, 12, 13]


def test_every_seconds_below_the_floor_waits_for_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Time-only checkpoints (every_rounds=null, every_seconds=4) under min_seconds=5: the first round end >= 5 s
    after the last one, as with every_rounds=1."""
    assert written(monkeypatch, 13, 1.5, every_rounds=None, every_seconds=4, min_seconds=5) == [4, 8, 12, 13]
    assert written(monkeypatch, 13, 1.5, every_rounds=None, every_seconds=4) == [3, 6, 9, 12, 13]


def test_a_stop_is_written_whatever_the_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A round after which the run stops (early stopping sets trainer.should_stop) is written at once."""
    assert written(monkeypatch, 13, 1.5, stop_after=3, min_seconds=5) == [3]


def test_shipped_default_is_five_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """configs/train.yaml: min_seconds 5 unless FLX_CHECKPOINT_MIN_SECONDS says otherwise (the suite sets 0)."""
    monkeypatch.delenv("FLX_CHECKPOINT_MIN_SECONDS", raising=False)
    assert OmegaConf.to_container(precheck(["paths.output_dir=unused"]).checkpoint, resolve=True)["min_seconds"] == 5
    monkeypatch.setenv("FLX_CHECKPOINT_MIN_SECONDS", "0.5")
    assert precheck(["paths.output_dir=unused"]).checkpoint.min_seconds == 0.5


@pytest.mark.slow
def test_short_rounds_under_the_default_floor_write_the_last_round_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A 6-round run of ~10 ms rounds, well within the 5 s floor: round 6 alone is written (last.ckpt links it)."""
    monkeypatch.delenv("FLX_CHECKPOINT_MIN_SECONDS", raising=False)
    small = ["model=logreg", "partition.num_clients=6", "algo.clients_per_round=3", "algo.local_steps=3"]
    quiet = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "logger=none"]
    train(precheck([*small, *quiet, "algo.rounds=6", f"paths.output_dir={tmp_path}"]))
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "round_00006.ckpt"]
    assert (folder / "last.ckpt").samefile(folder / "round_00006.ckpt")


def test_round_files_keep_the_newest_of_this_folder_and_publish_behind_the_write(tmp_path) -> None:
    """The file lifecycle alone: ``keep_last`` counts this folder's files only (a resumed run's list may name another
    folder's, never removed), ``last.ckpt`` names the newest once it is written, and a kill's temporary files go."""
    folder, other = tmp_path / "run", tmp_path / "old_run"
    folder.mkdir()
    files = RoundFiles(str(folder), keep_last=2)
    files.saved = [str(other / "round_00003.ckpt")]  # from the checkpoint of the run this one resumed
    for rounds in (4, 5, 6):
        path = files.add(rounds)
        (folder / os.path.basename(path)).write_bytes(str(rounds).encode())
        old = files.prune()
        files.publish(path, old)
    assert files.saved == [
        str(other / "round_00003.ckpt"),
        str(folder / "round_00005.ckpt"),
        str(folder / "round_00006.ckpt"),
    ]
    assert files.rounds() == {3, 5, 6}
    assert sorted(os.listdir(folder)) == ["last.ckpt", "round_00005.ckpt", "round_00006.ckpt"]
    assert (folder / "last.ckpt").read_bytes() == b"6"
    assert files.add(6) == str(folder / "round_00006.ckpt") and len(files.saved) == 3  # a round written again

    (folder / ".round_00007.ckpt.tmp-4242").write_bytes(b"half")
    (folder / "notes.tmp").write_bytes(b"not ours")
    assert files.remove_partial_writes() == [".round_00007.ckpt.tmp-4242"]
    assert sorted(os.listdir(folder)) == ["last.ckpt", "notes.tmp", "round_00005.ckpt", "round_00006.ckpt"]
    assert RoundFiles(str(tmp_path / "missing"), None).remove_partial_writes() == []
    assert RoundFiles(str(folder), None).prune() == []  # keep_last=None keeps every file
