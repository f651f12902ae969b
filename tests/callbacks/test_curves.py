"""The learning-curve recorder's checkpoint state: one tensor of points, an exact round trip, older lists read."""

from __future__ import annotations

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
