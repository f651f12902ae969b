"""``make bench``: flx against the same federated work written by hand in plain PyTorch, in paired runs.

Sections (``--sections``, default all):

* ``rounds``: wall-clock of flx's ``trainer.fit`` against a hand-written plain-PyTorch FedAvg loop, in one process.
  Both sides do the same FedAvg work (same data tensors, model class and initial weights, cohort size, local steps,
  batch size, n_i-weighted mean, SGD without momentum, torch thread settings; ``harness.py``, ``plain.py``). Per
  workload: a check (untimed, also the warm-up: flx and the plain loop drawing flx's cohorts and minibatches must do
  the same number of local steps and end with the same global model), a warm-up of the plain loop, then
  ``--repeats`` alternating measurements, a fresh flx build each time (only ``trainer.fit`` is timed).
* ``process``: the whole process, ``python train.py`` against ``python scripts/bench/plain_process.py``, each split
  into start-up (imports, data, model, Trainer), rounds and what follows (``process.py``).
* ``scaleout``: workload a on 1 process x 1 thread, 1 process x 2 threads and 2 processes (DDP) x 1 thread.
* ``vectorized``, ``memory``, ``eval``: ``algo.vectorize`` against the plain loop, peak memory with 100 against
  1,000,000 clients and a stateful algorithm's bytes per client in the state store, the cost of evaluation
  (``vectorized.py``, ``memory.py`` with ``state_memory.py``, ``evalcost.py``).
* ``dp``: a run with ``privacy=central`` or ``privacy=local`` against the same run without it (``dpcost.py``).

flx runs with the defaults a user gets (``--settings defaults``: console, CSV logger, round checkpoints, the default
callbacks), validation off on both sides (the plain loop evaluates nothing). Prints the ratios against their targets
and writes everything as JSON to ``bench_results/bench.json``. ``--breakdown`` adds a split of the flx time,
``--profile`` a cProfile listing of one flx fit.

Usage: ``make bench``, ``make bench ARGS="--workload b --quick --sections rounds,process"``.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import harness
import lightning
import process
import torch
from workloads import WORKLOADS, Workload

ROOT = Path(__file__).resolve().parents[2]
# the optional sections: (script, function returning its report); each prints its own table
OPTIONAL = {
    "vectorized": ("vectorized", "vectorized_report"),
    "memory": ("memory", "memory_report"),
    "eval": ("evalcost", "eval_report"),
    "threads": ("threads", "threads_report"),
    "dp": ("dpcost", "dp_report"),
}
SECTIONS = ("rounds", "process", "scaleout", *OPTIONAL)


@dataclass
class Result:
    """The measurements of one workload."""

    workload: str
    title: str
    rounds: int
    repeats: int
    flx_s: float
    plain_s: float
    ratio: float
    paired_ratio: float
    target: float
    passed: bool
    steps_per_run: int
    check_rounds: int
    check_max_abs_diff: float
    flx_runs_s: list[float] = field(default_factory=list)
    plain_runs_s: list[float] = field(default_factory=list)
    breakdown: dict[str, float] | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    p.add_argument("--quick", action="store_true", help="fewer rounds and repeats (a smoke run, noisy numbers)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per side (default: per workload, --quick 1)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per timed run (default: per workload)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for both sides (default: torch's)")
    p.add_argument("--accelerator", default="cpu", help="trainer.accelerator; the plain loop uses the same device")
    p.add_argument("--breakdown", action="store_true", help="split the flx time: Lightning loop vs flx client work")
    p.add_argument("--profile", action="store_true", help="cProfile one flx fit per workload (top functions)")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated parts to run (default all): {', '.join(SECTIONS)}",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "bench.json")
    p.add_argument(
        "--settings",
        choices=list(harness.SETTINGS),
        default="defaults",
        help="flx's settings: defaults (progress bar, CSV logger, round checkpoints as shipped) or lean (all off)",
    )
    return p.parse_args(argv)


def bench(w: Workload, args: argparse.Namespace) -> Result:
    rounds = args.rounds or (w.quick_rounds if args.quick else w.rounds)
    repeats = args.repeats or (1 if args.quick else w.repeats)
    print(f"workload {w.key}: {w.title}; {rounds} rounds x {repeats} repeats", flush=True)
    diff, check_steps = harness.check(w, args.accelerator, args.threads)
    print(f"  [{w.key}] check ({w.check_rounds} rounds, {check_steps} steps each side): max|flx - plain| = {diff:.2e}")
    flx_s, plain_s, steps = harness.measure(w, rounds, repeats, args.accelerator, args.threads)
    flx_med, plain_med = statistics.median(flx_s), statistics.median(plain_s)
    ratio = flx_med / plain_med
    paired = statistics.median(f / p for f, p in zip(flx_s, plain_s))
    result = Result(
        w.key, w.title, rounds, repeats, flx_med, plain_med, ratio, paired, w.target, ratio <= w.target,
        steps, w.check_rounds, diff, flx_s, plain_s,
    )  # fmt: skip
    if args.breakdown or args.profile:
        import breakdown

        fresh = lambda: harness.build_flx(harness.compose(w, rounds, args.accelerator, args.threads))  # noqa: E731
        if args.breakdown:
            result.breakdown = breakdown.split_flx_time(fresh())
            breakdown.print_split(w.key, result.breakdown)
        if args.profile:
            breakdown.cprofile_flx(fresh(), args.out.parent, w.key)
    return result


def table(results: list[Result]) -> str:
    """Medians per side, their ratio against the target, the median of the per-pair ratios, the check."""
    cols = ("workload", "rounds", "flx s", "plain s", "ratio", "target", "ok", "paired", "check diff")
    widths = (9, 7, 9, 9, 7, 9, 5, 8, 11)
    rows = [
        (
            r.workload, str(r.rounds), f"{r.flx_s:.3f}", f"{r.plain_s:.3f}", f"{r.ratio:.2f}", f"<= {r.target}",
            "yes" if r.passed else "NO", f"{r.paired_ratio:.2f}", f"{r.check_max_abs_diff:.1e}",
        )
        for r in results
    ]  # fmt: skip
    lines = ["".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
    head = "".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths)))
    return "\n".join([head, "-" * len(head), *lines])


def environment(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "threads": torch.get_num_threads(),
        "accelerator": args.accelerator,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "sections": args.sections,
        "load_average": os.getloadavg(),
        "settings": args.settings,
    }


def optional(module: str, fn: str, quick: bool) -> dict[str, Any] | None:
    """A section that lives in its own script (``memory.py``, ...): its report, or None when the script is absent."""
    try:
        mod = __import__(module)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        print(f"  ({module}.py is not there: section skipped)")
        return None
    return getattr(mod, fn)(quick=quick)


def process_table(rows: dict[str, dict[str, Any]]) -> str:
    head = "workload  flx total  start-up  rounds  after | plain total  start-up  rounds | total ratio  paired  rounds"
    lines = [head, "-" * len(head)]
    for key, r in rows.items():
        f, p = r["flx"], r["plain"]
        lines.append(
            f"{key:9s}{f['total']:10.2f}{f['startup']:10.2f}{f['rounds']:8.2f}{f['after']:7.2f} |"
            f"{p['total']:12.2f}{p['startup']:10.2f}{p['rounds']:8.2f} |{r['ratio_total']:12.2f}"
            f"{r['paired_total']:8.2f}{r['ratio_rounds']:8.2f}"
        )
    return "\n".join(lines)


def scale_table(r: dict[str, Any]) -> str:
    lines = [f"{'':24s}{'rounds s':>10s}{'total s':>10s}{'start-up s':>12s}"]
    for name, m in r["median"].items():
        lines.append(f"{name:24s}{m['rounds']:10.2f}{m['total']:10.2f}{m['startup']:12.2f}")
    if "machine_ceiling" in r:
        lines.append(
            f"this machine: two plain loops side by side each run {2 / r['machine_ceiling']:.2f}x as long as one alone:"
            f" 2 workers can be at most {r['machine_ceiling']:.2f}x faster than 1 here"
        )
    lines.append(
        f"rounds: 2 processes x 1 thread are {r['speedup_rounds_2proc_vs_1x1']:.2f}x faster than 1 x 1 (target >= 1.7),"
        f" 1 x 2 threads {r['speedup_rounds_1x2_vs_1x1']:.2f}x; whole process: 2 x 1 / 1 x 2 ="
        f" {r['total_2proc_over_1x2']:.2f} (target <= 1.0)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"bench: --sections: unknown {', '.join(unknown)}; allowed: {', '.join(SECTIONS)}")
    if args.out.is_dir():  # found before the runs, not when their results are written
        raise SystemExit(f"bench: --out: {args.out} is a folder; give the JSON file to write ({args.out}/bench.json)")
    harness.quiet()
    harness.settings = args.settings
    # the processes this bench starts read flx's (and its own) byte code from __pycache__, as a user's second run
    # does: with PYTHONDONTWRITEBYTECODE set (CI, containers) every run would otherwise compile ~100 modules again
    for folder in (ROOT / "src", ROOT / "scripts" / "bench"):
        compileall.compile_dir(folder, quiet=1)
    print(f"flx settings: {args.settings} ({' '.join(harness.SETTINGS[args.settings])}); load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    keys = list(WORKLOADS) if args.workload == "all" else [args.workload]
    payload: dict[str, Any] = {"environment": environment(args)}
    report: list[str] = []
    if "rounds" in sections:
        results = [bench(WORKLOADS[k], args) for k in keys]
        payload["results"] = [asdict(r) for r in results]
        report += ["per round (trainer.fit vs the plain loop, in one process):", table(results),
                   "ratio = median(flx) / median(plain); paired = median of the per-run flx/plain ratios"]  # fmt: skip
    if "process" in sections:
        print("whole process: python train.py vs python scripts/bench/plain_process.py", flush=True)
        rows = {}
        for k in keys:
            w = WORKLOADS[k]
            rows[k] = process.whole_process(w, args.rounds or (w.quick_rounds if args.quick else w.rounds),
                                            args.repeats or (1 if args.quick else w.repeats))  # fmt: skip
        payload["process"] = rows
        report += ["", "whole process (seconds, medians; start-up: process start to the first round):",
                   process_table(rows)]  # fmt: skip
    if "scaleout" in sections:
        w = WORKLOADS["a"]
        print(f"scale-out on workload a ({w.title})", flush=True)
        r = process.scale_out(w, args.rounds or (w.quick_rounds if args.quick else w.rounds),
                              args.repeats or (1 if args.quick else 3))  # fmt: skip
        payload["scaleout"] = r
        report += ["", f"scale-out, workload a (medians of {len(r['runs'][next(iter(r['runs']))])} runs):",
                   scale_table(r)]  # fmt: skip
    for name, (module, fn) in OPTIONAL.items():
        if name in sections:
            print(f"{name}:", flush=True)
            r = optional(module, fn, args.quick)
            if r is not None:
                payload[name] = r
                shown = getattr(__import__(module), "table", None)
                report += ["", f"{name} ({module}.py):", shown(r) if shown else "see above"]
    print()
    print("\n".join(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"\nwritten {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
