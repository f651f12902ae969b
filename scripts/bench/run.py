"""``make bench``: wall-clock of flx's ``trainer.fit`` against a hand-written plain-PyTorch FedAvg loop.

Both sides do the same FedAvg work (same data tensors, model class and initial weights, cohort size, local
steps, batch size, n_i-weighted mean, SGD without momentum, torch thread settings); see ``harness.py`` and
``plain.py``. Per workload:

1. check (untimed, also the warm-up): flx and the plain loop drawing flx's cohorts and minibatches must do
   the same number of local steps and end with the same global model (max abs difference printed);
2. warm-up of the plain loop with its own randomness;
3. ``--repeats`` alternating measurements (flx then plain, then plain then flx, ...), a fresh flx build each
   time (building is not timed: only ``trainer.fit``); the step counts of both sides must agree.

Prints a table of medians and the flx / plain ratio against its target and writes it as JSON to
``bench_results/bench.json``. ``--breakdown`` adds a low-overhead split of the flx time (Lightning loop vs
flx's per-client work), ``--profile`` a cProfile listing of one flx fit.

Usage: ``make bench ARGS="--workload b --quick"`` or ``python scripts/bench/run.py --workload all``.
"""

from __future__ import annotations

import argparse
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
import torch
from workloads import WORKLOADS, Workload

ROOT = Path(__file__).resolve().parents[2]
DIFF_TOLERANCE = 1e-4  # flx vs plain on the same cohorts and batches: identical maths, fp32 summation order


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
    p.add_argument("--whatif", default="", help="comma-separated runtime patches of suggested flx fixes: seed,log,xfer")
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "bench.json")
    p.add_argument(
        "--settings",
        choices=list(harness.SETTINGS),
        default="defaults",
        help="flx's settings: defaults (progress bar, CSV logger, round checkpoints as shipped) or lean (all off)",
    )
    return p.parse_args(argv)


def check(w: Workload, accelerator: str, threads: int | None) -> tuple[float, int]:
    """flx and the plain loop on flx's cohorts and batches: same steps, same final model. Returns (diff, steps)."""
    b = harness.build_flx(harness.compose(w, w.check_rounds, accelerator, threads))
    f, p = harness.run_flx(b), harness.run_plain(b, matched=True)
    if f.steps != p.steps or f.steps == 0:
        raise AssertionError(f"workload {w.key}: flx made {f.steps} local steps, the plain loop {p.steps}")
    diff = harness.max_abs_diff(f.params, p.params)
    if diff > DIFF_TOLERANCE:
        raise AssertionError(f"workload {w.key}: final models differ by {diff:.3g} (> {DIFF_TOLERANCE})")
    harness.run_plain(b, matched=False)  # warm-up of the timed plain variant
    return diff, f.steps


def measure(
    w: Workload, rounds: int, repeats: int, accelerator: str, threads: int | None
) -> tuple[list[float], list[float], int]:
    """Alternating timed runs; returns the flx and plain seconds and the (common) step count per run."""
    cfg = harness.compose(w, rounds, accelerator, threads)
    flx_s, plain_s, steps = [], [], set()
    for i in range(repeats):
        b = harness.build_flx(cfg)
        order = ("flx", "plain") if i % 2 == 0 else ("plain", "flx")
        runs = {side: harness.run_flx(b) if side == "flx" else harness.run_plain(b, matched=False) for side in order}
        if runs["flx"].steps != runs["plain"].steps:
            raise AssertionError(f"workload {w.key}: flx made {runs['flx'].steps} steps, plain {runs['plain'].steps}")
        flx_s.append(runs["flx"].seconds)
        plain_s.append(runs["plain"].seconds)
        steps.add(runs["flx"].steps)
        pair = f"flx {flx_s[-1]:.3f}s  plain {plain_s[-1]:.3f}s  ratio {flx_s[-1] / plain_s[-1]:.2f}"
        print(f"  [{w.key}] run {i + 1}/{repeats} ({' then '.join(order)}): {pair}", flush=True)
        del b, runs
    return flx_s, plain_s, steps.pop() if len(steps) == 1 else -1


def bench(w: Workload, args: argparse.Namespace) -> Result:
    rounds = args.rounds or (w.quick_rounds if args.quick else w.rounds)
    repeats = args.repeats or (1 if args.quick else w.repeats)
    print(f"workload {w.key}: {w.title}; {rounds} rounds x {repeats} repeats", flush=True)
    diff, check_steps = check(w, args.accelerator, args.threads)
    print(f"  [{w.key}] check ({w.check_rounds} rounds, {check_steps} steps each side): max|flx - plain| = {diff:.2e}")
    flx_s, plain_s, steps = measure(w, rounds, repeats, args.accelerator, args.threads)
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
        "whatif": args.whatif,
        "settings": args.settings,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    harness.quiet()
    harness.settings = args.settings
    print(f"flx settings: {args.settings} ({' '.join(harness.SETTINGS[args.settings])})")
    if args.whatif:
        import whatif

        whatif.apply(args.whatif.split(","))
        print(f"whatif: flx patched at runtime with {args.whatif} (see scripts/bench/whatif.py)")
    if args.threads:
        torch.set_num_threads(args.threads)
    keys = list(WORKLOADS) if args.workload == "all" else [args.workload]
    results = [bench(WORKLOADS[k], args) for k in keys]
    print()
    print(table(results))
    print("ratio = median(flx) / median(plain); paired = median of the per-run flx/plain ratios (less drift-prone)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(args), "results": [asdict(r) for r in results]}
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwritten {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
