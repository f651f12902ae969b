"""``make gpu-check``: the GPU path of flx verified in one run, printed as one table (docs/gpu.md).

Sections (``--sections``, default all, run in the order given; each is one function returning table rows):

* ``a``: every ``algo=`` config (``configs/algo/*.yaml``, as ``tests/test_algo_defaults.py`` runs them), 2 rounds on
  the bundled data, on the device (in this process) and on the CPU (in a pool of worker processes, meanwhile): the
  final test metrics agree within :data:`METRIC_TOL` (float32 on both sides: TF32 is switched off for this section).
* ``b``: ``trainer.precision=bf16-mixed`` and ``16-mixed``: the run ends with finite metrics and a finite model.
* ``c`` (``gpu_check_procs.py``): 2 processes on one device (gloo; each process started as one node of a 2-node
  job, so both share the one GPU) against 1 process: the same global model within :data:`MODEL_TOL`; NCCL with 2
  processes where 2+ GPUs exist.
* ``d`` (``gpu_check_procs.py``): ``kill -9`` in the middle of a round and ``ckpt_path=auto`` with
  ``trainer.deterministic=true``: the final model is bitwise equal to the uninterrupted run's.
* ``f``: differential privacy, 2 rounds on the device and on the CPU: ``privacy=central`` gives the CPU's final
  metrics within :data:`METRIC_TOL` (its noise is drawn on the host) and the same epsilon; ``privacy=local`` the
  same epsilon (the per-client ledger) and a finite model (its noise comes from the device's generator, so the
  metrics are not compared).
* ``e``: speed (``gpu_check_speed.py``): ``make bench``'s workload a (small CNN, 50 of 1000 clients) and a ResNet-18
  on CIFAR-shaped data, flx (defaults) against the plain PyTorch loop on the same device, sequential and
  ``algo.vectorize=true``: rounds per second, peak device memory, the targets next to them.

Without CUDA (or with ``--device cpu``) it runs the CPU analogue: the same sections, smaller (a few configs, CPU
against CPU in (a), no ``16-mixed``, gloo on the CPU, tiny speed workloads). A section that cannot run here says
``skipped: <reason>``. The table is also written as ``gpu_check.json`` and ``gpu_check.md`` under ``--out`` (after
every row, so a run stopped by a time limit leaves what it had). Exit status 1 when a check failed.

Usage: ``make gpu-check``, ``python scripts/gpu_check.py --sections a,d --out /tmp/gc``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("src", "scripts/bench", "scripts")]

import torch  # noqa: E402
from gpu_check_common import MODEL_TOL as MODEL_TOL  # noqa: E402  (the table's tolerance of (c), named here too)
from gpu_check_common import QUIET, ROOT, Row, Setup, progress, timed_row  # noqa: E402

SECTIONS = ("a", "b", "c", "d", "e", "f")
#: (a): |device - cpu| <= METRIC_TOL * max(1, |cpu|) per final metric: absolute on accuracies/AUCs (in [0, 1]),
#: relative on losses above 1. Float32 on different kernels after 2 rounds differs by ~1e-6 (docs/gpu.md)
METRIC_TOL = 1e-3
#: the CPU analogue's configs in (a): plain FedAvg, a client-state store (Ditto), a server-side lambda (DRFA)
CPU_ALGOS = ("fedavg", "ditto", "drfa")


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """Float32 matrix products and convolutions in full float32 (PyTorch lets cuDNN use TF32 by default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def train_here(out: Path, overrides: Sequence[str]) -> dict[str, float]:
    """``python train.py <overrides>`` in this process (``flx.run.train``); its console output is discarded (progress
    bars of server-side pretraining included: an error still reaches the table as the exception)."""
    from flx.config import precheck
    from flx.run import train

    cfg = precheck([*overrides, *QUIET, f"paths.output_dir={out}"])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return train(cfg)


def metric_gap(ref: dict[str, float], got: dict[str, float]) -> tuple[float, str, bool]:
    """``(max |got - ref|, its key, within tolerance)`` over the final metrics; different keys or a non-finite
    value never pass."""
    if ref.keys() != got.keys() or not ref:
        return math.inf, f"keys differ: {sorted(ref.keys() ^ got.keys())}", False
    gaps = {k: abs(got[k] - ref[k]) for k in ref}
    worst = max(gaps, key=lambda k: gaps[k] if math.isfinite(gaps[k]) else math.inf)
    ok = all(math.isfinite(gaps[k]) and gaps[k] <= METRIC_TOL * max(1.0, abs(ref[k])) for k in ref)
    return gaps[worst], worst, ok


def _pool_size() -> tuple[int, int]:
    """(worker processes, torch threads each) for the CPU references of (a): a quarter of the cores as workers (at
    most 4, at least 1), half of the cores shared among them; the other half is left to the device runs."""
    cpus = os.cpu_count() or 1
    workers = max(1, min(4, cpus // 4))
    return workers, max(1, cpus // (2 * workers))


def cpu_reference(algo: str, out: str, threads: int) -> dict[str, float]:
    """The CPU run of one config of (a), in a worker process (the device runs go on meanwhile in the main one)."""
    from harness import quiet

    quiet()
    overrides = [f"algo={algo}", "algo.rounds=2", "trainer.accelerator=cpu", f"num_threads={threads}"]
    return train_here(Path(out), overrides)


def _one_algo(s: Setup, algo: str, ref: futures.Future, threads: int) -> Row:
    on_cpu = [f"num_threads={threads}"] if s.device == "cpu" else []  # the CPU analogue: the reference's settings
    overrides = [f"algo={algo}", "algo.rounds=2", *on_cpu, f"trainer.accelerator={s.device}"]
    with no_tf32():
        got = train_here(s.work / f"a-{algo}-{s.device}", overrides)
    try:  # the device run is done: its reference may wait at most 45 s past the budget (the device command's limit)
        cpu = ref.result(timeout=max(1.0, s.deadline + 45 - time.monotonic()))
    except futures.TimeoutError:  # not the builtin one before Python 3.11
        return Row("a", f"algo={algo}", "skipped: its CPU reference did not finish within the time budget (--budget-s)")
    gap, key, ok = metric_gap(cpu, got)
    return Row(
        "a", f"algo={algo}: {s.device} vs cpu, 2 rounds", "passed" if ok else "FAILED",
        value=f"max diff {gap:.2e} ({key})", limit=f"<= {METRIC_TOL:g} x max(1, abs(cpu))",
        detail={"cpu": cpu, s.device: got},
    )  # fmt: skip


def section_a(s: Setup) -> Iterator[Row]:
    """Every ``algo=`` config on the device and on the CPU: the same final test metrics."""
    if time.monotonic() > s.deadline:  # no worker is started for nothing
        yield from (Row("a", f"algo={algo}", "skipped: the time budget (--budget-s) ran out") for algo in s.algos)
        return
    workers, threads = _pool_size()
    pool = futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))  # CUDA: no fork
    try:
        refs = {a: pool.submit(cpu_reference, a, str(s.work / f"a-{a}-reference"), threads) for a in s.algos}
        for algo in s.algos:
            if time.monotonic() > s.deadline:
                yield Row("a", f"algo={algo}", "skipped: the time budget (--budget-s) ran out")
            else:
                yield timed_row("a", f"algo={algo}", lambda algo=algo: _one_algo(s, algo, refs[algo], threads))
    finally:  # past the budget, a reference still running is not waited for
        pool.shutdown(wait=False, cancel_futures=True)


def finite_model(ckpt: Path) -> bool:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def _precision(s: Setup, precision: str) -> Row:
    out = s.work / f"b-{precision}"
    metrics = train_here(out, ["algo.rounds=2", f"trainer.accelerator={s.device}", f"trainer.precision={precision}"])
    finite = bool(metrics) and all(math.isfinite(v) for v in metrics.values())
    ok = finite and finite_model(out / "checkpoints" / "last.ckpt")
    return Row(
        "b", f"trainer.precision={precision} on {s.device}, 2 rounds", "passed" if ok else "FAILED",
        value=f"test/acc {metrics.get('test/acc', math.nan):.4f}, test/loss {metrics.get('test/loss', math.nan):.4f}",
        limit="metrics and model finite", detail=metrics,
    )  # fmt: skip


def section_b(s: Setup) -> list[Row]:
    """Mixed precision: bf16 and fp16 runs end with finite metrics and a finite model."""
    rows = []
    for precision in ("bf16-mixed", "16-mixed"):
        check = f"trainer.precision={precision}"
        if s.device == "cpu" and precision == "16-mixed":
            rows.append(Row("b", check, "skipped: Lightning has no fp16 autocast on the CPU (bf16-mixed is its form)"))
        elif s.device == "cuda" and precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
            rows.append(Row("b", check, "skipped: this GPU has no bf16"))
        else:
            rows.append(timed_row("b", check, lambda p=precision: _precision(s, p)))
    return rows


def _privacy(s: Setup, mode: str) -> Row:
    common = ["algo.rounds=2", f"privacy={mode}", "privacy.noise_multiplier=1.0"]
    runs = {}
    for device in (s.device, "cpu"):
        out = s.work / f"f-{mode}-{device}-{len(runs)}"
        with no_tf32():
            metrics = train_here(out, [*common, f"trainer.accelerator={device}"])
        epsilon = json.loads((out / "curves.json").read_text())["privacy/epsilon"][-1][1]
        runs[len(runs)] = (metrics, float(epsilon), finite_model(out / "checkpoints" / "last.ckpt"))
    (got, eps, finite), (cpu, eps_cpu, _) = runs[0], runs[1]
    gap, key, close = metric_gap(cpu, got)
    ok = finite and eps == eps_cpu and (close or mode == "local")
    compared = f"max diff {gap:.2e} ({key}), " if mode == "central" else ""
    return Row(
        "f", f"privacy={mode} on {s.device} vs cpu, 2 rounds", "passed" if ok else "FAILED",
        value=f"{compared}epsilon {eps:.6f} vs {eps_cpu:.6f}",
        limit="metrics within tolerance, equal epsilon" if mode == "central" else "equal epsilon, finite model",
        detail={"cpu": cpu, s.device: got},
    )  # fmt: skip


def section_f(s: Setup) -> list[Row]:
    """Differential privacy: central DP as on the CPU, local DP's ledger as on the CPU."""
    return [timed_row("f", f"privacy={mode}", lambda mode=mode: _privacy(s, mode)) for mode in ("central", "local")]


def section_e(s: Setup) -> list[Row]:
    """Speed against the plain loop (``gpu_check_speed.py``)."""
    import gpu_check_speed

    return gpu_check_speed.speed_rows(s.device, s.small)


def section_c(s: Setup) -> list[Row]:
    """1 process == 2 processes: gloo on one device, NCCL on two GPUs."""
    import gpu_check_procs

    return gpu_check_procs.ranks_rows(s)


def section_d(s: Setup) -> list[Row]:
    """kill -9 in the middle of a round, resume: bitwise the uninterrupted model."""
    import gpu_check_procs

    return gpu_check_procs.resume_rows(s)


RUNNERS: dict[str, Callable[[Setup], Iterable[Row]]] = {
    "a": section_a,
    "b": section_b,
    "c": section_c,
    "d": section_d,
    "e": section_e,
    "f": section_f,
}


def table(rows: Sequence[Row]) -> str:
    """The rows as a markdown table (read as plain text too), in section order whatever order they ran in."""
    rows = sorted(rows, key=lambda r: r.section)
    head = "| | check | status | value | limit / target | s |\n| --- | --- | --- | --- | --- | --- |"
    cells = [(r.section, r.check, r.status, r.value, r.limit, f"{r.seconds:.0f}") for r in rows]
    body = ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in cells]
    return "\n".join([head, *body])


def environment(device: str) -> dict[str, Any]:
    import lightning

    gpu = torch.cuda.get_device_name(0) if device == "cuda" else None
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device,
        "gpu": gpu,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "lightning": lightning.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }


def write(out: Path, env: dict[str, Any], rows: Sequence[Row]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ordered = [asdict(r) for r in sorted(rows, key=lambda r: r.section)]
    (out / "gpu_check.json").write_text(json.dumps({"environment": env, "rows": ordered}, indent=1))
    title = f"flx gpu-check on {env['gpu'] or 'the CPU'} (torch {env['torch']}, {env['time']})"
    (out / "gpu_check.md").write_text(f"{title}\n\n{table(rows)}\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of a,b,c,d,e, run in this order")
    p.add_argument("--out", type=Path, default=ROOT / "bench_results" / "gpu_check", help="folder for the table")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda when there is one")
    p.add_argument("--algos", default=None, help="comma-separated configs for (a) (default: all on CUDA, a few on CPU)")
    p.add_argument("--budget-s", type=float, default=400, help="(a) skips its remaining configs after this many s")
    args = p.parse_args(argv)
    args.sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.exit(2, f"gpu_check: error: --sections: unknown {', '.join(unknown)}; allowed: {', '.join(SECTIONS)}\n")
    if args.algos is not None:
        from flx.config import group_options

        allowed = group_options("algo")
        bad = [a for a in args.algos.split(",") if a not in allowed]
        if bad:
            p.exit(2, f"gpu_check: error: --algos: unknown {', '.join(bad)}; allowed: {', '.join(allowed)}\n")
    if not args.budget_s > 0:
        p.exit(2, f"gpu_check: error: --budget-s: {args.budget_s}; allowed: > 0 seconds\n")
    if args.out.exists() and not args.out.is_dir():
        p.exit(2, f"gpu_check: error: --out: {args.out} is a file; give a folder\n")
    return args


def setup(args: argparse.Namespace, work: Path, start: float) -> Setup:
    from flx.config import group_options

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: error: --device cuda: torch sees no CUDA device here")
    small = device == "cpu"
    algos = tuple(args.algos.split(",")) if args.algos else CPU_ALGOS if small else tuple(group_options("algo"))
    return Setup(device, small, work, start + args.budget_s, algos)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    from harness import quiet

    quiet()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="flx-gpu-check-", ignore_cleanup_errors=True) as work:
        s = setup(args, Path(work), start)
        env = environment(s.device)
        progress(
            f"device {s.device} ({env['gpu'] or platform.processor() or 'cpu'}), sections {','.join(args.sections)}"
        )
        for name in args.sections:
            progress(f"section {name}: {RUNNERS[name].__doc__.splitlines()[0]}")
            for row in RUNNERS[name](s):  # written row by row: a run stopped by a time limit keeps its rows
                rows.append(row)
                write(args.out, env, rows)
    print(f"\n{table(rows)}\n\n{len(rows)} rows in {time.monotonic() - start:.0f} s; written to {args.out}", flush=True)
    failed = [r for r in rows if r.status == "FAILED"]
    if failed:
        print(f"gpu_check: {len(failed)} check(s) FAILED: {', '.join(r.check for r in failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
