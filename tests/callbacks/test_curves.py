"""The learning-curve recorder: its checkpoint state (one tensor of points, an exact round trip, older lists read) and
when it records a round (the round's own checkpoint holds it, once)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flx.callbacks.curves import RoundCurves


def _recorder() -> RoundCurves:
    curves = RoundCurves()
    curves.history["train/loss"] = [(r, 1 / (r + 3)) for r in range(1, 301)]  # values with no short binary form
    curves.history["val/acc"] = [(5, 0.25), (10, 0.5)]
    curves.history["sim/clock"] = []
    return curves


def test_the_state_is_one_float64_tensor_per_key_and_round_trips_exactly() -> None:
    """The checkpoint gets the keys with points and one float64 (n, 3) tensor of (key, round, value) rows (one object
    to pickle, not three per point), and loading it gives back the same (int round, float value) points, bit for
    bit."""
    state = _recorder().state_dict()
    assert state["keys"] == ["train/loss", "val/acc"]  # the empty one is left out
    assert state["points"].dtype == torch.float64 and state["points"].shape == (302, 3)
    restored = RoundCurves()
    restored.load_state_dict(state)
    assert dict(restored.history) == {k: v for k, v in _recorder().history.items() if v}
    assert all(isinstance(r, int) for r, _ in restored.history["train/loss"])


def test_checkpoints_of_older_versions_load() -> None:
    """Older checkpoints hold lists of (round, value) pairs (lists after a load): they load to the same history."""
    legacy = {k: [list(p) for p in v] for k, v in _recorder().history.items()}
    restored = RoundCurves()
    restored.load_state_dict(legacy)
    assert dict(restored.history) == dict(_recorder().history)


def test_an_empty_recorder_round_trips() -> None:
    restored = RoundCurves()
    restored.load_state_dict(RoundCurves().state_dict())
    assert not restored.history


def _trainer(epoch: int, processed: int, metrics: dict[str, float], every: int = 1) -> SimpleNamespace:
    """What the recorder reads of a trainer: the round counters and the metrics logged so far."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed, completed=epoch))
    return SimpleNamespace(
        current_epoch=epoch,
        check_val_every_n_epoch=every,
        callback_metrics={k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()},
        fit_loop=SimpleNamespace(epoch_progress=progress),
    )


def test_the_round_checkpoint_holds_its_round_once() -> None:
    """Round 3's checkpoint is written in round 3's epoch-end hooks (processed 3, completed 2), before the next
    round's start records round 3: the state written holds round 3 (the file's entry is replaced); the next round's
    start and the end of training add it no second time. A checkpoint written during round 4's validation (processed
    = completed) records nothing: round 4's loss is not logged yet. Round 5 is not validated (eval every 2): its
    stale val/acc is left out."""
    curves = RoundCurves()
    curves.history["train/loss"] = [(1, 0.9), (2, 0.8)]
    checkpoint = {"callbacks": {curves.state_key: curves.state_dict()}}
    curves.on_save_checkpoint(_trainer(2, 3, {"train/loss": 0.7, "val/acc": 0.5}), None, checkpoint)
    restored = RoundCurves()
    restored.load_state_dict(checkpoint["callbacks"][curves.state_key])
    assert dict(restored.history) == {"train/loss": [(1, 0.9), (2, 0.8), (3, 0.7)], "val/acc": [(3, 0.5)]}

    curves.on_train_epoch_start(_trainer(3, 3, {"train/loss": 0.7, "val/acc": 0.5}), None)
    during_validation = {"callbacks": {curves.state_key: curves.state_dict()}}
    curves.on_save_checkpoint(_trainer(3, 3, {"train/loss": 0.7, "val/acc": 0.6}), None, during_validation)
    assert {k: v for k, v in curves.history.items() if v} == dict(restored.history)
    curves.on_train_end(_trainer(5, 5, {"train/loss": 0.5, "val/acc": 0.6}, every=2), None)
    assert curves.history["train/loss"][-1] == (5, 0.5) and curves.history["val/acc"] == [(3, 0.5)]
    assert [r for r, _ in curves.history["train/loss"]] == [1, 2, 3, 5]
