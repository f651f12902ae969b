"""Bytes per client of a stateful algorithm's client-state store (issue 14, must-have 3), in memory and on disk.

The state is Ditto's (``algo=ditto``): one personal model per client, a copy of every parameter of the net, stored by
``flx.state.ClientStateStore`` under ``ditto/v/<k>``. For each model (the default ``model=mlp`` and ``model=logreg``
on digits) a fresh process puts that state for ``N`` clients into an in-memory store and reports the resident bytes
it added per client (RSS after minus before, over ``N``) next to the tensors' own bytes, then puts it for fewer
clients into a disk store and reports the bytes on disk per client, the process's RSS growth for them, and what a
checkpoint of that store costs (its serialised bytes per client and the seconds to take and serialise it: a table of
files, not the tensors).

Usage: part of ``python scripts/bench/run.py --sections memory [--quick]``, or ``python scripts/bench/state_memory.py``;
:func:`state_report` returns a dict.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODELS = ("mlp", "logreg")  # the nets of digits (64 inputs, 10 classes) as configs/model/*.yaml build them


def _rss() -> int:
    """This process's resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _child(model: str, clients: int, disk_clients: int) -> dict[str, Any]:
    """Runs in a fresh process: fills a memory store, then a disk store, with Ditto's state of ``model``."""
    import torch

    from flx.models.nets import MLP, LogisticRegression
    from flx.state import ClientStateStore

    net = (MLP if model == "mlp" else LogisticRegression)(input_shape=(64,), num_classes=10)
    state = {f"ditto/v/{k}": p.detach().clone() for k, p in enumerate(net.parameters())}
    payload = sum(t.nbytes for t in state.values())
    out: dict[str, Any] = {"model": model, "params": sum(p.numel() for p in net.parameters()), "payload": payload}
    store = ClientStateStore()
    gc.collect()
    before = _rss()
    for cid in range(clients):
        store.put(cid, {k: v + cid for k, v in state.items()})  # what a client's end puts: new tensors
    gc.collect()
    out["memory"] = {"clients": clients, "rss_per_client": (_rss() - before) / clients, "nbytes": store.nbytes()}
    with tempfile.TemporaryDirectory() as d:
        disk = ClientStateStore("disk", d)
        gc.collect()
        before = _rss()
        for cid in range(disk_clients):
            disk.put(cid, state)
        gc.collect()
        rss = (_rss() - before) / disk_clients
        start = time.perf_counter()
        saved = io.BytesIO()
        torch.save(disk.state_dict(round=1), saved)  # what a round checkpoint adds for the store
        out["disk"] = {
            "clients": disk_clients,
            "bytes_per_client": disk.nbytes() / disk_clients,
            "rss_per_client": rss,
            "checkpoint_bytes_per_client": saved.getbuffer().nbytes / disk_clients,
            "checkpoint_s": time.perf_counter() - start,
        }
    return out


def measure(model: str, quick: bool) -> dict[str, Any]:
    clients, disk_clients = (2000, 200) if quick else (20000, 2000)
    code = (
        f"import sys, json; sys.path[:0] = [{str(ROOT / 'src')!r}, {str(Path(__file__).parent)!r}];"
        f"import state_memory; print(json.dumps(state_memory._child({model!r}, {clients}, {disk_clients})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=900)
    return json.loads(done.stdout.strip().splitlines()[-1])


def state_report(quick: bool = False) -> dict[str, Any]:
    return {model: measure(model, quick) for model in MODELS}


def table(report: dict[str, Any]) -> str:
    head = (
        "model    params  tensors B/client | memory: clients  resident B/client  overhead | disk: B/client  resident"
        "  ckpt B/client  ckpt s"
    )
    lines = [head, "-" * len(head)]
    for key, r in report.items():
        m, d = r["memory"], r["disk"]
        lines.append(
            f"{key:8s}{r['params']:8d}{r['payload']:18d} |{m['clients']:16d}{m['rss_per_client']:19.0f}"
            f"{m['rss_per_client'] - r['payload']:10.0f} |{d['bytes_per_client']:15.0f}{d['rss_per_client']:10.0f}"
            f"{d['checkpoint_bytes_per_client']:15.1f}{d['checkpoint_s']:8.3f}"
        )
    lines.append("(resident: RSS growth over the clients; overhead: resident minus the tensors' bytes)")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(table(state_report(parser.parse_args().quick)))
