"""Section (e) of ``scripts/gpu_check.py``: flx against the plain PyTorch loop on one device, per round.

Two workloads: ``make bench``'s workload a (the small CNN of McMahan et al. 2017 on synthetic 3x32x32 data, 50 of
1000 clients, B=10, one epoch) and the same with ``model=resnet18`` (timm's ResNet-18 on CIFAR-shaped inputs). Each
runs through ``scripts/bench/harness.py``: first the check (flx and the plain loop on flx's cohorts and minibatches
end with the same model; also the warm-up), then alternating timed runs of flx (its defaults, validation off as the
plain loop has none) and the plain sequential loop, each from a fresh build, once sequential and once with
``algo.vectorize=true`` (a net with BatchNorm is refused there, and the row says so). Reported: rounds per second
(medians), the per-round ratio against the plain sequential loop with the targets of issue 26 (flx sequential within
1.1x of the plain loop; vectorised cohorts at least 3x faster than the plain sequential loop for the small CNN) and
the peak device memory each side allocated in its run (``torch.cuda.max_memory_allocated`` less what was allocated
when the run started; not measured on the CPU). The targets are reported, not enforced: the exit status stays 0
when one is missed.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable
from typing import Any

import harness
import torch
from gpu_check_common import Row, timed_row
from workloads import WORKLOADS, Workload

from flx.errors import ConfigError

SEQUENTIAL_TARGET = 1.1  # flx / plain time per round, sequential
VECTORIZED_TARGET = 3.0  # plain sequential / flx vectorised time per round, small CNN
MIB = 2**20
# the CPU analogue: the same workloads, 40 clients x 50 samples, a few per round, one round
TINY = (
    "data.loader.num_samples=2000",
    "data.loader.test_samples=100",
    "partition.num_clients=40",
    "algo.clients_per_round=4",
)


def workloads(small: bool) -> list[Workload]:
    """The small CNN and ResNet-18 workloads (tiny ones for the CPU analogue)."""
    cnn = dataclasses.replace(WORKLOADS["a"], key="cnn", rounds=2, repeats=3, check_rounds=1)
    resnet = dataclasses.replace(
        cnn, key="resnet18", title=cnn.title.replace("cnn", "resnet18 (timm)"),
        overrides=tuple("model=resnet18" if o == "model=cnn" else o for o in cnn.overrides),
    )  # fmt: skip
    if not small:
        return [cnn, resnet]
    return [dataclasses.replace(w, overrides=(*w.overrides, *TINY), rounds=1, repeats=1) for w in (cnn, resnet)]


def peak(device: torch.device, fn: Callable[[], harness.Run]) -> tuple[harness.Run, float]:
    """``fn()``'s run and the peak device memory it allocated in MiB, on top of what was allocated when it started
    (the other side's model and data are left out); NaN on the CPU."""
    if device.type != "cuda":
        return fn(), float("nan")
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run = fn()
    return run, (torch.cuda.max_memory_allocated(device) - base) / MIB


def measure(w: Workload, accelerator: str) -> dict[str, Any]:
    """Alternating timed runs of flx and the plain sequential loop; medians of seconds and peaks per side."""
    cfg = harness.compose(w, w.rounds, accelerator)
    sides: dict[str, dict[str, list[float]]] = {"flx": {"s": [], "mib": []}, "plain": {"s": [], "mib": []}}
    for i in range(w.repeats):
        b = harness.build_flx(cfg)
        device = b.trainer.strategy.root_device
        for side in ("flx", "plain") if i % 2 == 0 else ("plain", "flx"):
            fn = (
                functools.partial(harness.run_flx, b)
                if side == "flx"
                else functools.partial(harness.run_plain, b, False)
            )
            run, mib = peak(device, fn)
            sides[side]["s"].append(run.seconds)
            sides[side]["mib"].append(mib)
        del b
    med = {side: statistics.median(v["s"]) for side, v in sides.items()}
    return {
        "rounds": w.rounds, "repeats": w.repeats, "runs": sides,
        "rounds_per_s": {side: w.rounds / s for side, s in med.items()},
        "peak_mib": {side: max(v["mib"]) for side, v in sides.items()},
    }  # fmt: skip


def _mem(mib: float) -> str:
    return "" if mib != mib else f", peak {mib:.0f} MiB"


def _check(w: Workload, accelerator: str) -> Row:
    """flx and the plain loop on flx's cohorts and minibatches end with the same model (``harness.check``'s
    comparison; the forward counts are reported, not compared: flx's defaults add forwards of their own, e.g. the
    initial loss of the finite-divergence rule). A net that ``algo.vectorize=true`` refuses gives a skipped row."""
    name = f"{w.key} {'vectorised' if 'algo.vectorize=true' in w.overrides else 'sequential'}"
    try:
        b = harness.build_flx(harness.compose(w, w.check_rounds, accelerator))
    except ConfigError as err:
        return Row("e", name, f"skipped: {err}")
    f, p = harness.run_flx(b), harness.run_plain(b, matched=True)
    diff = harness.max_abs_diff(f.params, p.params)
    harness.run_plain(b, matched=False)  # warm-up of the timed plain variant
    return Row(
        "e", f"{name}: flx == plain loop on flx's cohorts ({w.check_rounds} round)",
        "passed" if diff <= harness.DIFF_TOLERANCE else "FAILED",
        value=f"max abs param diff {diff:.2e}; net forwards flx {f.steps}, plain {p.steps}",
        limit=f"<= {harness.DIFF_TOLERANCE:g}",
    )  # fmt: skip


def _speed(w: Workload, accelerator: str, vectorised: bool) -> Row:
    """The timed row: rounds per second and peaks of both sides, the ratio against the plain loop's time per round
    (which trains the clients one after the other in both modes) and its target."""
    m = measure(w, accelerator)
    r, p = m["rounds_per_s"], m["peak_mib"]
    if not vectorised:
        ratio, target = r["plain"] / r["flx"], SEQUENTIAL_TARGET
        met, limit = ratio <= target, f"flx/plain time <= {target}x"
    else:
        ratio = r["flx"] / r["plain"]
        target = VECTORIZED_TARGET if w.key == "cnn" else None
        met, limit = target is not None and ratio >= target, f"plain seq/flx vec time >= {target}x"
    mode = "vectorised" if vectorised else "sequential"
    value = f"flx {r['flx']:.2f} r/s{_mem(p['flx'])}; plain {r['plain']:.2f} r/s{_mem(p['plain'])}; ratio {ratio:.2f}"
    return Row(
        "e", f"{w.key} {mode}: rounds/s, flx (defaults) vs plain loop", "measured",
        value=value, limit=f"{limit}: {'met' if met else 'NOT met'}" if target else "no target", detail=m,
    )  # fmt: skip


def speed_rows(device: str, small: bool) -> list[Row]:
    """The rows of section (e): per workload, the check and the timings, sequential then vectorised."""
    accelerator = "gpu" if device == "cuda" else "cpu"
    rows = []
    for w in workloads(small):
        for vectorised in (False, True):
            v = dataclasses.replace(w, overrides=(*w.overrides, "algo.vectorize=true")) if vectorised else w
            name = f"{w.key} {'vectorised' if vectorised else 'sequential'}"
            rows.append(timed_row("e", f"{name} check", functools.partial(_check, v, accelerator)))
            if rows[-1].status == "passed":
                rows.append(timed_row("e", name, functools.partial(_speed, v, accelerator, vectorised)))
    return rows
