"""``scripts/bench/memory.py``: the report's arithmetic and keys with the runs stubbed, one real ``python train.py``
measured through ``os.wait4``, and the stateful part (``state_memory.py``) on a few clients."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # memory.py imports state_memory as the bench runs it
import state_memory  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "scripts" / "bench" / "memory.py")
memory = sys.modules["bench_memory"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(memory)


def test_report_gives_ratio_and_bytes_per_extra_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peaks p_few, p_many: ratio = p_many / p_few, bytes per extra client = (p_many - p_few) / (n_many - n_few)."""
    peaks = {100: 1000 * 2**20, 200_000: 1100 * 2**20}
    monkeypatch.setattr(memory, "peak_rss", lambda args, folder: {"maxrss_bytes": peaks[_clients(args)], "wall_s": 1.0})
    state = {"logreg": {"params": 650, "payload": 2600, "memory": {"clients": 10, "rss_per_client": 3000.0},
                        "disk": {"bytes_per_client": 4400.0, "rss_per_client": 200.0,
                                 "checkpoint_bytes_per_client": 27.25, "checkpoint_s": 0.0125}}}  # fmt: skip
    monkeypatch.setattr(state_memory, "state_report", lambda quick: state)
    report = memory.memory_report(quick=True)
    assert [r["clients"] for r in report["runs"]] == [100, 200_000]
    assert report["ratio"] == pytest.approx(1.1) and report["passed"] and report["target"] == 1.2
    assert report["bytes_per_extra_client"] == pytest.approx(100 * 2**20 / 199_900)
    assert report["state"] is state
    text = memory.table(report)
    assert "ratio 1.10 (target <= 1.2: yes)" in text and "partition.num_clients=N" in text
    assert "logreg" in text and "400" in text  # the state table: 3000 resident - 2600 tensor bytes
    assert "27.2" in text and "0.013" in text  # and a disk checkpoint's bytes per client and seconds


def _clients(args: list[str]) -> int:
    return int(next(a for a in args if a.startswith("partition.num_clients=")).split("=")[1])


@pytest.mark.slow
def test_peak_rss_of_a_real_run(tmp_path: Path) -> None:
    tiny = ["model=logreg", "partition.num_clients=4", "algo.clients_per_round=2", "algo.local_steps=1"]
    run = memory.peak_rss([*tiny, "algo.rounds=1"], tmp_path / "run")
    assert 50 * 2**20 < run["maxrss_bytes"] < 8 * 2**30 and run["wall_s"] > 0
    assert (tmp_path / "run" / "checkpoints").is_dir()  # the defaults as shipped: round checkpoints written


def test_state_store_bytes_per_client_hold_the_tensors(tmp_path: Path) -> None:
    """Ditto's state of logreg on digits is its 650 parameters (2,600 bytes): the memory store holds exactly that per
    client, a disk file at least that."""
    got = state_memory._child("logreg", clients=50, disk_clients=50)
    assert got["params"] == 650 and got["payload"] == 2600
    assert got["memory"]["nbytes"] == 50 * 2600
    assert got["disk"]["bytes_per_client"] >= 2600
    assert got["disk"]["checkpoint_bytes_per_client"] < 2600 / 10  # a disk checkpoint holds a table, not the tensors
