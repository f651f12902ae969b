"""``num_threads: auto`` against the plain loop with torch's default threads, on an idle and on a busy machine.

Per workload (``make train``'s MLP and workload a's CNN) and per load (``idle``: nothing started by this script;
``busy``: ``--busy`` processes that spin on the CPU, ``python -c 'while 1: pass'``, started here and stopped after
the block), alternating runs of whole processes (``process.py``), each run's per-round time from its round marks:

* ``plain``: ``plain_process.py`` with torch's default threads and OpenMP's default wait policy: the baseline;
* ``plain passive``: the same with ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps at once);
* ``plain short``: the same with the short wait ``train.py`` sets (``flx.threads.short_wait``: libgomp spins ~10 us,
  then sleeps): what the wait alone does;
* ``flx``: ``python train.py`` with its defaults (``num_threads: auto``, the short wait ``train.py`` sets);
* ``flx 1``: ``num_threads=1``, the default before ``auto``.

The order of the variants rotates from one repeat to the next; ratios are taken within a repeat (each variant against
that repeat's ``plain`` run) and their median reported, with the medians of the per-round times. Targets: idle,
``flx / plain <= 1.05``; busy, no collapse: ``flx / plain <= 1.0`` (torch's default threads are what collapses) and
flx's busy / idle slowdown under 5x. ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` of this process's environment are
left out of every run (``train.py`` sets them itself; ``plain passive`` and ``plain short`` get theirs here).

Usage: ``python scripts/bench/run.py --sections threads`` (or this script: ``--quick``, ``--loads idle``, ``--busy 4``);
:func:`threads_report` returns a dict and :func:`table` prints it.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import process
from workloads import MAKE_TRAIN, WORKLOADS, Workload

from flx.threads import short_wait

CASES = {"mlp": MAKE_TRAIN, "cnn": WORKLOADS["a"]}
# rounds per run: a few seconds of rounds on this 2-core machine when idle; busy, a third of the MLP's (the plain
# loop's collapse makes its runs ~30x longer). The CNN's 2 (workload a's own): flx's first round also measures the
# divergence rule's initial loss (a forward of the cohort's first 512 rows), which one round alone would overweight
ROUNDS = {"idle": {"mlp": 100, "cnn": 2}, "busy": {"mlp": 33, "cnn": 2}}
VARIANTS = ("plain", "plain passive", "plain short", "flx", "flx 1")
IDLE_TARGET, BUSY_TARGET, COLLAPSE = 1.05, 1.0, 5.0
WAITS = {"plain passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "plain short": {}}
short_wait(WAITS["plain short"])


@contextmanager
def _wait(values: dict[str, str]) -> Iterator[None]:
    """``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT`` of the processes started inside the block: ``values``, else unset."""
    keys = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    os.environ.update(values)
    try:
        yield
    finally:
        for k in keys:
            os.environ.pop(k, None)
        os.environ.update(saved)


def _command(variant: str, w: Workload, rounds: int, tmp: str, marks: str) -> list:
    """The command line of one run of ``variant``."""
    if variant.startswith("plain"):
        return process.plain_command(w, rounds, marks, threads=0)  # 0: torch's default threads
    cmd = process.flx_command(w, rounds, os.path.join(tmp, os.path.basename(marks) + ".run"), marks)
    threads = "num_threads=1" if variant == "flx 1" else None  # flx: the default (auto)
    return [a for a in cmd if not a.startswith("num_threads=")] + ([threads] if threads else [])


def _run(variant: str, w: Workload, rounds: int, tmp: str, tag: str) -> float:
    """Seconds per round of one run of ``variant``."""
    marks = os.path.join(tmp, f"{tag}.json")
    with _wait(WAITS.get(variant, {})):
        split = process.timed_process(_command(variant, w, rounds, tmp, marks), marks)
    return split["rounds"] / rounds


@contextmanager
def spinning(count: int) -> Iterator[None]:
    """``count`` processes that keep a core each busy, for the block's duration (stopped by their ids)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def measure(key: str, rounds: int, repeats: int, load: str) -> dict[str, Any]:
    """``repeats`` rounds of runs of every variant on workload ``key``, the order rotating; per-round seconds."""
    w = CASES[key]
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="flx-bench-threads-") as tmp:
        for i in range(repeats):
            order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
            for v in order:
                runs[v].append(_run(v, w, rounds, tmp, f"{key}-{load}-{i}-{v.replace(' ', '_')}"))
            shown = "  ".join(f"{v} {runs[v][-1] * 1e3:.1f}" for v in VARIANTS)
            print(f"  [{key} {load}] {i + 1}/{repeats} ms/round: {shown}  (load {os.getloadavg()[0]:.2f})", flush=True)
    med = {v: statistics.median(s) for v, s in runs.items()}
    paired = {v: statistics.median(a / b for a, b in zip(runs[v], runs["plain"])) for v in VARIANTS}
    return {"rounds": rounds, "repeats": repeats, "runs": runs, "median": med, "paired": paired}


def threads_report(
    quick: bool = False, loads: tuple[str, ...] = ("idle", "busy"), busy: int | None = None
) -> dict[str, Any]:
    """Every workload under every load; ``busy``: spinning processes (default: one per core of this machine)."""
    busy = busy or os.cpu_count() or 1
    repeats = 1 if quick else 3
    report: dict[str, Any] = {"busy_processes": busy, "cpus": os.cpu_count(), "loads": {}}
    for load in loads:
        before = os.getloadavg()
        with spinning(busy if load == "busy" else 0):
            rounds = {k: max(2, n // 3) if quick else n for k, n in ROUNDS[load].items()}
            cases = {k: measure(k, rounds[k], repeats, load) for k in CASES}
        report["loads"][load] = {"load_before": before, "load_after": os.getloadavg(), "cases": cases}
    _targets(report)
    return report


def _targets(report: dict[str, Any]) -> None:
    """Adds each target's verdict to ``report``."""
    loads = report["loads"]
    for key in CASES:
        checks = {}
        if "idle" in loads:
            checks["idle flx/plain"] = (loads["idle"]["cases"][key]["paired"]["flx"], IDLE_TARGET)
        if "busy" in loads:
            checks["busy flx/plain"] = (loads["busy"]["cases"][key]["paired"]["flx"], BUSY_TARGET)
        if {"idle", "busy"} <= loads.keys():
            slow = loads["busy"]["cases"][key]["median"]["flx"] / loads["idle"]["cases"][key]["median"]["flx"]
            checks["flx busy/idle"] = (slow, COLLAPSE)
        report.setdefault("targets", {})[key] = {
            name: {"value": value, "target": bound, "passed": value <= bound} for name, (value, bound) in checks.items()
        }


def table(report: dict[str, Any]) -> str:
    """Per load and workload: each variant's median ms per round and its paired ratio to ``plain``; the targets."""
    head = f"{'load':6s}{'workload':9s}" + "".join(f"{v:>22s}" for v in VARIANTS)
    lines = [head, "-" * len(head)]
    for load, block in report["loads"].items():
        for key, r in block["cases"].items():
            cells = "".join(f"{r['median'][v] * 1e3:12.1f} ms ({r['paired'][v]:.2f})" for v in VARIANTS)
            lines.append(f"{load:6s}{key:9s}{cells}")
        avg = " -> ".join(" ".join(f"{x:.2f}" for x in block[k]) for k in ("load_before", "load_after"))
        spin = f"; {report['busy_processes']} processes spinning" if load == "busy" else ""
        lines.append(f"        load average {avg}{spin}")
    for key, checks in report.get("targets", {}).items():
        for name, c in checks.items():
            ok = "yes" if c["passed"] else "NO"
            lines.append(f"{key:5s} {name:16s}{c['value']:6.2f}  target <= {c['target']:<5} {ok}")
    lines.append("ms per round, medians; (x): median of the per-repeat ratios to plain (torch's default threads)")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, a third of the rounds")
    parser.add_argument("--loads", default="idle,busy", help="comma-separated: idle, busy")
    parser.add_argument("--busy", type=int, default=None, help="spinning processes for busy (default: one per core)")
    a = parser.parse_args()
    print(table(threads_report(a.quick, tuple(x for x in a.loads.split(",") if x), a.busy)))
