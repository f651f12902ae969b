"""Memory per client: peak RSS of one stateless run with 100 clients against the same run with 1,000,000.

The run is ``python train.py`` with flx's defaults (console, CSV logger, round checkpoints, the default callbacks) on
1,100,000 synthetic rows of 16 features, IID clients, logistic regression, 3 rounds of 20 clients and 5 local steps,
each in its own process (outputs in a temporary folder, removed at the end). A process's peak RSS comes from
``os.wait4`` (the kernel's ``ru_maxrss`` of that child alone), taken by a small launcher process (:data:`LAUNCH`).
The target (issue 14, must-have 3): the 1,000,000-client run within 1.2x the 100-client run's peak; ``bytes per
extra client`` is the difference of the peaks over the extra clients. ``--quick``: 220,000 rows, 100 against 200,000
clients, 1 round (a smoke run; the ratio is not the target's).

``state``: a stateful algorithm's bytes per client in the client state store, in memory and on disk
(``state_memory.py``: Ditto's personal models).

Usage: ``python scripts/bench/memory.py [--quick]``; :func:`memory_report` returns the same as a dict (``make bench
ARGS="--sections memory"``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import state_memory

ROOT = Path(__file__).resolve().parents[2]
TARGET = 1.2
"""Peak RSS of the many-client run over the few-client run's, at most."""

FULL = {"rows": 1_100_000, "clients": (100, 1_000_000), "rounds": 3}
QUICK = {"rows": 220_000, "clients": (100, 200_000), "rounds": 1}


def overrides(rows: int, clients: int | str, rounds: int) -> list[str]:
    """The stateless run of ``clients`` clients on ``rows`` synthetic rows (every other setting as shipped)."""
    return [
        "data=synthetic",
        f"data.loader.num_samples={rows}",
        "data.loader.input_shape=[16]",
        "data.loader.test_samples=1000",
        "data.val_fraction=0",
        "partition=iid",
        f"partition.num_clients={clients}",
        "model=logreg",
        f"algo.rounds={rounds}",
        "algo.clients_per_round=20",
        "algo.local_steps=5",
    ]


# forks and execs the command, waits for it and writes its ru_maxrss (KiB) to argv[1]; exits with its status. A child
# forked straight from the bench inherits the bench's peak (Linux keeps the forked memory's high-water mark through
# exec): forked from this small process instead, the command's peak is its own
LAUNCH = """import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def peak_rss(args: list[str], folder: Path) -> dict[str, Any]:
    """Runs ``python train.py *args`` with its outputs in ``folder``; its peak RSS (bytes) and wall-clock (s)."""
    cmd = [sys.executable, "train.py", *args, f"hydra.run.dir={folder}"]
    rss = folder.with_suffix(".maxrss")
    with open(folder.with_suffix(".log"), "w") as log:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", LAUNCH, str(rss), *cmd], cwd=ROOT, stdout=log, stderr=log)
        wall = time.perf_counter() - start
    if done.returncode:
        tail = folder.with_suffix(".log").read_text()[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{tail}")
    return {"maxrss_bytes": int(rss.read_text()) * 1024, "wall_s": wall}  # Linux: ru_maxrss in KiB


def memory_report(quick: bool = False) -> dict[str, Any]:
    """Peak RSS of the stateless run per client count, their ratio against :data:`TARGET` and the bytes per extra
    client; ``state``: :func:`state_report`; ``load``: the 1-, 5- and 15-minute load averages before and after."""
    setting = QUICK if quick else FULL
    load_before, runs = os.getloadavg(), []
    with tempfile.TemporaryDirectory(prefix="flx-memory-") as out:
        for n in setting["clients"]:
            args = overrides(setting["rows"], n, setting["rounds"])
            runs.append({"clients": n, **peak_rss(args, Path(out) / f"clients_{n}")})
            print(f"  {n:>9,} clients: peak RSS {runs[-1]['maxrss_bytes'] / 2**20:8.1f} MiB, "
                  f"{runs[-1]['wall_s']:.1f} s", flush=True)  # fmt: skip
    few, many = runs
    ratio = many["maxrss_bytes"] / few["maxrss_bytes"]
    extra = (many["maxrss_bytes"] - few["maxrss_bytes"]) / (many["clients"] - few["clients"])
    return {
        "runs": runs,
        "ratio": ratio,
        "target": TARGET,
        "passed": ratio <= TARGET,
        "bytes_per_extra_client": extra,
        "command": "python train.py " + " ".join(overrides(setting["rows"], "N", setting["rounds"])),
        "state": state_memory.state_report(quick),
        "load": {"before": load_before, "after": os.getloadavg()},
        "cpus": os.cpu_count(),
        "quick": quick,
    }


def table(report: dict[str, Any]) -> str:
    lines = [f"{'clients':>10}{'peak RSS MiB':>14}{'wall s':>8}"]
    lines += [f"{r['clients']:>10,}{r['maxrss_bytes'] / 2**20:>14.1f}{r['wall_s']:>8.1f}" for r in report["runs"]]
    verdict = "yes" if report["passed"] else "NO"
    lines.append(
        f"ratio {report['ratio']:.2f} (target <= {report['target']}: {verdict}); "
        f"{report['bytes_per_extra_client']:.0f} bytes per extra client"
    )
    lines += ["stateful (Ditto's personal models in the client state store):", state_memory.table(report["state"])]
    before, after = report["load"]["before"], report["load"]["after"]
    lines.append(f"load average before {before[0]:.2f}, after {after[0]:.2f} on {report['cpus']} cores")
    lines.append(report["command"])
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="220,000 rows, 100 vs 200,000 clients, 1 round")
    print(table(memory_report(parser.parse_args().quick)))
