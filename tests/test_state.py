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
