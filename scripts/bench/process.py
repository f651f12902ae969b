"""Whole-process and scale-out measurements: ``python train.py`` and ``python plain_process.py`` as a user runs them.

Each run is a fresh Python process started by this one; its wall-clock time is split, with the marks the process
writes (``marks.Marks`` for flx, ``plain_process.py`` itself), into

* ``startup``: process start to the first round (interpreter, imports, config, data, model, Trainer),
* ``rounds``: the rounds (``trainer.fit``'s rounds; the plain loop),
* ``after``: the last round to the process's exit (flx: the test evaluation, plots, files; plain: its test accuracy),

so ``total = startup + rounds + after``. flx runs with its defaults (console, CSV logger, round checkpoints, the
default callbacks) and validation off, as the in-process measurement (``run.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from workloads import Workload

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def flx_command(w: Workload, rounds: int, out: str, marks: str, threads: int = 1, extra: tuple[str, ...] = ()) -> list:
    """``python train.py`` of workload ``w`` with flx's defaults, validation off, and the round marks."""
    return [
        sys.executable, "train.py", *w.overrides, f"algo.rounds={rounds}", f"eval_every={rounds}",
        "++trainer.limit_val_batches=0", f"num_threads={threads}", f"hydra.run.dir={out}",
        "+callbacks.bench_marks._target_=marks.Marks", f"+callbacks.bench_marks.out={marks}", *extra,
    ]  # fmt: skip


def plain_command(w: Workload, rounds: int, marks: str, threads: int = 1) -> list:
    return [
        sys.executable, str(HERE / "plain_process.py"), "--workload", w.key, "--rounds", str(rounds),
        "--threads", str(threads), "--out", marks,
    ]  # fmt: skip


def timed_processes(commands: list[list], marks: list[str]) -> list[dict[str, float]]:
    """Starts ``commands`` together (each writes its round marks to its ``marks`` file), waits for all, and splits
    each one's wall-clock time from the common start; raises with a process's stderr when it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "src")]), "PYTHONWARNINGS": "ignore"}
    start = time.time()
    procs = [
        subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    out = []
    for command, proc, m in zip(commands, procs, marks):
        _, err = proc.communicate(timeout=1800)
        end = time.time()
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:3])} ... failed ({proc.returncode}): {err[-2000:]}")
        marked = json.loads(Path(m).read_text())
        out.append(
            {
                "total": end - start,
                "startup": marked["train_start"] - start,
                "rounds": marked["train_end"] - marked["train_start"],
                "after": end - marked["train_end"],
            }
        )
    return out


def timed_process(command: list, marks: str) -> dict[str, float]:
    """Runs ``command``, which writes its round marks to ``marks``, and splits its wall-clock time."""
    return timed_processes([command], [marks])[0]


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def whole_process(w: Workload, rounds: int, repeats: int) -> dict[str, Any]:
    """Alternating flx / plain processes (``repeats`` each); medians of each part and the paired total ratio."""
    runs: dict[str, list[dict[str, float]]] = {"flx": [], "plain": []}
    with tempfile.TemporaryDirectory(prefix="flx-bench-proc-") as tmp:
        for i in range(repeats):
            order = ("flx", "plain") if i % 2 == 0 else ("plain", "flx")
            for side in order:
                marks = os.path.join(tmp, f"{side}{i}.json")
                cmd = (
                    flx_command(w, rounds, os.path.join(tmp, f"run{i}"), marks)
                    if side == "flx"
                    else plain_command(w, rounds, marks)
                )
                runs[side].append(timed_process(cmd, marks))
            f, p = runs["flx"][-1], runs["plain"][-1]
            print(
                f"  [{w.key}] process {i + 1}/{repeats}: flx {f['total']:.2f}s (start-up {f['startup']:.2f}s) "
                f"plain {p['total']:.2f}s (start-up {p['startup']:.2f}s)  ratio {f['total'] / p['total']:.2f}",
                flush=True,
            )
    flx, plain = _median(runs["flx"]), _median(runs["plain"])
    paired = statistics.median(f["total"] / p["total"] for f, p in zip(runs["flx"], runs["plain"]))
    return {"flx": flx, "plain": plain, "ratio_total": flx["total"] / plain["total"], "paired_total": paired,
            "ratio_rounds": flx["rounds"] / plain["rounds"], "runs": runs}  # fmt: skip


SCALE_OUT = {  # name: (flx overrides, torch threads per process)
    "1 process x 1 thread": ((), 1),
    "1 process x 2 threads": ((), 2),
    "2 processes x 1 thread": (("trainer=ddp", "trainer.devices=2"), 1),
}


# the machine's own ceiling for 2 workers: the plain loop alone, and two copies of it started together (each does the
# whole work; with no shared resource each would take as long as one alone: 2 x alone / side by side = 2.0)
MACHINE = {"plain 1 process alone": 1, "plain 2 side by side": 2}


def scale_out(w: Workload, rounds: int, repeats: int) -> dict[str, Any]:
    """The same flx run on 1 process with 1 and with 2 threads and on 2 processes (DDP, gloo) of 1 thread each,
    interleaved ``repeats`` times with the plain loop alone and two plain loops side by side (``MACHINE``): medians of
    the round time and of the whole process, and the speed-up two workers can have on this machine at most."""
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in [*SCALE_OUT, *MACHINE]}
    with tempfile.TemporaryDirectory(prefix="flx-bench-scale-") as tmp:
        for i in range(repeats):
            for name, (extra, threads) in SCALE_OUT.items():
                marks, out = (
                    os.path.join(tmp, f"m{i}-{len(runs[name])}-{threads}.json"),
                    os.path.join(tmp, f"r{i}{name}"),
                )
                runs[name].append(timed_process(flx_command(w, rounds, out, marks, threads, extra), marks))
                r = runs[name][-1]
                print(f"  [{w.key}] {name}: rounds {r['rounds']:.2f}s  total {r['total']:.2f}s", flush=True)
            for name, copies in MACHINE.items():
                marks = [os.path.join(tmp, f"p{i}-{name[:5]}-{c}.json") for c in range(copies)]
                both = timed_processes([plain_command(w, rounds, m) for m in marks], marks)
                runs[name].append({k: statistics.mean(r[k] for r in both) for k in both[0]})
                r = runs[name][-1]
                print(f"  [{w.key}] {name}: rounds {r['rounds']:.2f}s  total {r['total']:.2f}s", flush=True)
    med = {k: _median(v) for k, v in runs.items()}
    one, two_threads, two, alone, side = (med[k] for k in [*SCALE_OUT, *MACHINE])
    return {
        "median": med,
        "speedup_rounds_2proc_vs_1x1": one["rounds"] / two["rounds"],
        "speedup_rounds_1x2_vs_1x1": one["rounds"] / two_threads["rounds"],
        "total_2proc_over_1x2": two["total"] / two_threads["total"],
        "machine_ceiling": 2 * alone["rounds"] / side["rounds"],
        "runs": runs,
    }
