"""Client state store: round trips in memory and on disk; checkpoint state equals live state."""

from __future__ import annotations

import pytest
import torch

from flx.state import ClientStateStore


@pytest.mark.parametrize("backend", ["memory", "disk"])
def test_store_roundtrip_and_isolation(backend: str, tmp_path) -> None:
    store = ClientStateStore(backend, str(tmp_path / "s"))
    y = torch.arange(3.0)
    store.put(4, {"y": y})
    y += 100  # the store holds a copy
    got = store.get(4)
    assert torch.equal(got["y"], torch.arange(3.0)) and 4 in store and 5 not in store
    got["y"] += 1  # and hands out copies
    assert torch.equal(store.get(4)["y"], torch.arange(3.0))
    assert store.get(5) == {}

    other = ClientStateStore()
    other.load_state_dict(store.state_dict())
    assert other.client_ids() == [4] and torch.equal(other.get(4)["y"], torch.arange(3.0))


def test_bad_backend() -> None:
    with pytest.raises(ValueError, match="backend"):
        ClientStateStore("redis")


def _mixed_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g).t(),  # not contiguous
        "t": torch.tensor(seed, dtype=torch.int64),
        "b": torch.randn(5, generator=g, dtype=torch.float64),
        "c": torch.randn(2, 2, generator=g),
        "none": torch.empty(0),
    }


@pytest.mark.parametrize("backend", ["memory", "disk"])
def test_mixed_dtypes_and_shapes_round_trip_in_order(backend: str, tmp_path) -> None:
    """Packed one buffer per dtype in memory: every tensor comes back with its name, shape, dtype and values, the
    names in the order they were put."""
    store = ClientStateStore(backend, str(tmp_path / "s"))
    for cid in range(3):
        store.put(cid, _mixed_state(cid))
    store.put(7, {})
    assert store.client_ids() == [0, 1, 2, 7] and store.get(7) == {} and 7 in store
    for cid in range(3):
        want, got = _mixed_state(cid), store.get(cid)
        assert list(got) == list(want)
        for k in want:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
            assert torch.equal(got[k], want[k])
    got = store.get(1)
    got["c"].add_(1.0)  # a copy: neither the store nor the other tensors of the client change
    assert torch.equal(store.get(1)["c"], _mixed_state(1)["c"]) and torch.equal(got["w"], _mixed_state(1)["w"])


def test_memory_store_holds_the_payload_and_checkpoint_views_never_change() -> None:
    """In memory the store holds exactly the tensors' bytes; ``state_dict`` hands out the stored values without a
    copy, and a later ``put`` replaces the client's buffers rather than writing into them."""
    store = ClientStateStore()
    for cid in range(4):
        store.put(cid, _mixed_state(cid))
    payload = sum(t.nbytes for t in _mixed_state(0).values())
    assert store.nbytes() == 4 * payload
    saved = store.state_dict()
    store.put(2, {k: v + 1 for k, v in _mixed_state(2).items()})
    for k, v in _mixed_state(2).items():
        assert torch.equal(saved["clients"][2][k], v)
        assert torch.equal(store.get(2)[k], v + 1)
    other = ClientStateStore()
    other.load_state_dict(saved)
    assert all(torch.equal(other.get(1)[k], v) for k, v in _mixed_state(1).items())


def test_disk_store_counts_its_files(tmp_path) -> None:
    store = ClientStateStore("disk", str(tmp_path / "s"))
    for cid in range(3):
        store.put(cid, _mixed_state(cid))
    files = sorted((tmp_path / "s").iterdir())
    assert len(files) == 3 and store.nbytes() == sum(f.stat().st_size for f in files)
