"""``algo.vectorize=true`` against the sequential plain-PyTorch loop (the floor of one-client-at-a-time training).

Per workload: flx's ``trainer.fit`` with ``algo.vectorize=true`` and otherwise the defaults a user gets (console, CSV
logger, round checkpoints), against ``plain.py``'s FedAvg loop, which trains the clients one after the other. First a
check (flx vectorised and the plain loop on flx's cohorts and minibatches: the same number of local steps and the
same final model), then alternating timed runs (``harness.measure``). The target: flx / plain < 1.0, i.e. flx with the
stacked clients is faster than the hand-written sequential loop.

Usage: ``python scripts/bench/run.py --sections vectorized [--quick]``; :func:`vectorized_report` returns a dict.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import harness
from workloads import WORKLOADS, Workload

VECTORIZE = ("algo.vectorize=true",)
TARGET = 1.0
MLP = Workload(
    key="mlp",
    title="mlp 200-200 digits, 100 clients, 20/round, B=32, 5 steps",
    overrides=(*(o for o in WORKLOADS["b"].overrides if not o.startswith("model=")), "model=mlp"),
    rounds=60,
    quick_rounds=10,
    repeats=5,
    check_rounds=10,
    target=TARGET,
)
CASES: dict[str, Workload] = {
    "logreg": dataclasses.replace(WORKLOADS["b"], key="logreg", target=TARGET),
    "mlp": MLP,
}


def _vectorized(w: Workload) -> Workload:
    return dataclasses.replace(w, overrides=(*w.overrides, *VECTORIZE))


def measure(w: Workload, quick: bool) -> dict[str, Any]:
    v = _vectorized(w)
    rounds, repeats = (w.quick_rounds, 1) if quick else (w.rounds, w.repeats)
    diff, steps = harness.check(v, "cpu", None)
    print(f"  [{w.key}] check: {steps} local steps each side, max|flx vectorised - plain| = {diff:.2e}", flush=True)
    flx_s, plain_s, _ = harness.measure(v, rounds, repeats, "cpu", None)
    ratio = statistics.median(flx_s) / statistics.median(plain_s)
    paired = statistics.median(f / p for f, p in zip(flx_s, plain_s))
    return {
        "title": w.title, "rounds": rounds, "repeats": repeats, "check_max_abs_diff": diff,
        "flx_s": flx_s, "plain_s": plain_s, "ratio": ratio, "paired": paired, "target": TARGET,
        "passed": ratio < TARGET,
    }  # fmt: skip


def vectorized_report(quick: bool = False) -> dict[str, Any]:
    harness.quiet()
    return {key: measure(w, quick) for key, w in CASES.items()}


def table(report: dict[str, Any]) -> str:
    head = f"{'workload':9s}{'rounds':>7s}{'flx vec s':>11s}{'plain s':>9s}{'ratio':>7s}{'target':>9s}{'ok':>5s}"
    head += f"{'paired':>8s}{'check diff':>12s}"
    lines = [head, "-" * len(head)]
    for key, r in report.items():
        lines.append(
            f"{key:9s}{r['rounds']:7d}{statistics.median(r['flx_s']):11.3f}{statistics.median(r['plain_s']):9.3f}"
            f"{r['ratio']:7.2f}{'< ' + str(r['target']):>9s}{'yes' if r['passed'] else 'NO':>5s}{r['paired']:8.2f}"
            f"{r['check_max_abs_diff']:12.1e}"
        )
    lines.append("flx with algo.vectorize=true (defaults otherwise) against the sequential plain loop, per round")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(table(vectorized_report(parser.parse_args().quick)))
