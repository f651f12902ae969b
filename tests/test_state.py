"""Client state store: round trips in memory and on disk; checkpoint state equals live state."""

from __future__ import annotations

import os

import pytest
import torch

from flx.state import ClientStateStore, GlobalModel


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


def _names(paths: list[str]) -> list[str]:
    return sorted(os.path.basename(p) for p in paths)


def _one(v: float) -> dict[str, torch.Tensor]:
    return {"v": torch.tensor([v])}


def test_disk_snapshots_hold_a_table_and_keep_their_files_until_released(tmp_path) -> None:
    """A disk snapshot is the (client, file) table, not the tensors. A put after a snapshot writes a new file; the
    snapshot's file stays until ``retain`` no longer keeps a snapshot that refers to it (hand-computed below)."""
    store = ClientStateStore("disk", str(tmp_path / "s"))
    store.put(0, _one(0.0))
    store.put(1, _one(10.0))
    store.put(0, _one(0.5))  # no snapshot since: the same file, rewritten
    a = store.state_dict(round=1)  # snapshot 0: client 0 -> tag 0, client 1 -> tag 0
    assert "clients" not in a and a["disk"]["cids"].tolist() == [0, 1] and a["disk"]["tags"].tolist() == [0, 0]
    store.put(0, _one(1.0))  # tag 1
    b = store.state_dict(round=2)  # snapshot 1
    store.put(0, _one(2.0))  # tag 2
    store.put(2, _one(20.0))  # tag 2
    c = store.state_dict(round=3)  # snapshot 2
    assert _names(os.listdir(tmp_path / "s")) == ["client_0.0.pt", "client_0.1.pt", "client_0.2.pt"] + [
        "client_1.0.pt",
        "client_2.2.pt",
    ]
    assert c["disk"]["old"].tolist() == [[0, 0, 1], [0, 1, 2]]  # (client, tag, superseded at tag)

    def values(snapshot: dict) -> dict[int, float]:
        s = ClientStateStore.from_state_dict(snapshot)
        return {cid: float(s.get(cid)["v"]) for cid in s.client_ids()}

    assert values(a) == {0: 0.5, 1: 10.0} and values(b) == {0: 1.0, 1: 10.0}
    assert values(c) == {0: 2.0, 1: 10.0, 2: 20.0}
    # keeping the checkpoints of rounds 2 and 3: snapshot 0 (round 1) goes, and client 0's tag-0 file with it
    assert _names(store.retain({2, 3})) == ["client_0.0.pt"]
    assert store.retain({2, 3}) == []
    assert _names(store.retain({3})) == ["client_0.1.pt"]
    assert store.retain(set()) == []  # the current files are always kept
    os.remove(tmp_path / "s" / "client_0.0.pt")
    with pytest.raises(FileNotFoundError, match="1 client state file"):
        ClientStateStore.from_state_dict(a)


def test_disk_resume_drops_what_a_killed_run_wrote_after_its_checkpoint(tmp_path) -> None:
    """Loading a snapshot in its own folder: files written after it (a killed run's) are released at the next retain,
    never overwritten before (new tags start above them); the state is the snapshot's."""
    first = ClientStateStore("disk", str(tmp_path / "s"))
    first.put(0, _one(0.0))
    first.put(1, _one(1.0))
    snap = first.state_dict(round=4)  # snapshot 0
    first.put(0, _one(-1.0))  # tag 1: round 5 of the killed run, in no checkpoint
    (tmp_path / "s" / "client_1.1.pt").write_bytes(b"cut short")  # a write the kill cut short

    resumed = ClientStateStore("disk", str(tmp_path / "s"))
    resumed.load_state_dict(snap)
    assert resumed.client_ids() == [0, 1] and float(resumed.get(0)["v"]) == 0.0
    resumed.put(0, _one(5.0))  # tag 2: above every tag on disk
    assert float(torch.load(tmp_path / "s" / "client_0.1.pt")["v"]) == -1.0  # the killed run's file is untouched
    resumed.state_dict(round=5)
    doomed = resumed.retain({4, 5})
    assert _names(doomed) == ["client_0.1.pt", "client_1.1.pt"]
    for path in doomed:
        os.remove(path)
    # kept: the round-4 snapshot's files (client 0 at tag 0, client 1) and the current one
    assert _names(os.listdir(tmp_path / "s")) == ["client_0.0.pt", "client_0.2.pt", "client_1.0.pt"]


def test_disk_snapshot_loaded_in_another_folder_is_copied(tmp_path) -> None:
    """Another run's (or rank 0's) snapshot: its current files are copied into this store's folder, the source is
    left alone; a legacy snapshot with the tensors inside loads into a disk store too."""
    src = ClientStateStore("disk", str(tmp_path / "a"))
    src.put(3, _mixed_state(3))
    src.put(3, _mixed_state(4))
    snap = src.state_dict(round=1)
    dst = ClientStateStore("disk", str(tmp_path / "b"))
    dst.load_state_dict(snap)
    assert _names(os.listdir(tmp_path / "b")) == ["client_3.1.pt"] and (tmp_path / "a" / "client_3.0.pt").exists()
    assert all(torch.equal(dst.get(3)[k], v) for k, v in _mixed_state(4).items())
    legacy = ClientStateStore("disk", str(tmp_path / "c"))
    legacy.load_state_dict({"clients": {5: _one(7.0)}})
    assert float(legacy.get(5)["v"]) == 7.0 and legacy.retain({1}) == []


def test_global_model_snapshot_load_and_commit() -> None:
    """The global model's three moves on a net with every kind of tensor: a frozen parameter (not uploaded), float
    buffers (averaged) and an integer counter (kept from the global model)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    net[2].bias.requires_grad_(False)
    model = GlobalModel(net)
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    assert names == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight"]
    assert [t is b for t, b in zip(model.local_state[5:], [net[1].running_mean, net[1].running_var])] == [True] * 2
    assert len(model.local_state) == 7 and len(model.global_state) == 7 and len(model.global_params) == 5

    net(torch.randn(8, 3))  # a training step's side effects: new running statistics, the counter at 1
    model.snapshot()
    start = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():  # a client trains: every tensor moves
        torch._foreach_add_(model.local_state, 1.0)
        net[1].num_batches_tracked.add_(5)
    model.load()
    assert all(torch.equal(v, start[k]) for k, v in net.state_dict().items())

    with torch.no_grad():
        torch._foreach_sub_(model.global_params, 0.5)  # what the server optimizer does
    means = [torch.full((4,), 2.0, dtype=torch.float64), torch.full((4,), 3.0, dtype=torch.float64)]
    net[1].num_batches_tracked.add_(5)
    model.commit(means)
    assert all(torch.equal(p, start[n] - 0.5) for n, p in zip(names, model.params))
    assert torch.equal(net[1].running_mean, torch.full((4,), 2.0)) and net[1].running_mean.dtype == torch.float32
    assert torch.equal(net[1].running_var, torch.full((4,), 3.0))
    assert int(net[1].num_batches_tracked) == 1  # the global model's counter, not the client's
    assert torch.equal(net[2].bias, start["2.bias"])  # frozen: neither uploaded nor stepped
