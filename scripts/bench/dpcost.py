"""The cost of user-level central DP per round: flx with ``privacy=central`` against the same run without it.

Per workload, ``trainer.fit`` of the run as a user gets it (console, CSV logger, round checkpoints) with and without
``privacy=central privacy.noise_multiplier=1.0`` (Poisson sampling, the PLD accountant: the defaults), alternated,
a fresh build each time (only ``fit`` is timed; the noise is given, so nothing is calibrated). What DP adds per round:
drawing the cohort, clipping each upload, one noise draw the size of the model, and the accountant's epsilon for
``privacy/epsilon`` (one PLD composition, ~10 ms, whatever the model). Poisson cohorts vary in size around
``algo.clients_per_round``; over the rounds the clients trained are about the same on both sides (printed).

Usage: ``python scripts/bench/run.py --sections dp [--quick]``; :func:`dp_report` returns a dict.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import harness
from workloads import MAKE_TRAIN, WORKLOADS, Workload

DP = ("privacy=central", "privacy.noise_multiplier=1.0")
CASES: dict[str, Workload] = {"b": WORKLOADS["b"], "mlp": MAKE_TRAIN}


def _run(w: Workload, rounds: int) -> tuple[float, int]:
    """Seconds of one ``trainer.fit`` and the clients it trained."""
    b = harness.build_flx(harness.compose(w, rounds, "cpu"))
    run = harness.run_flx(b)
    return run.seconds, run.steps


def measure(w: Workload, quick: bool) -> dict[str, Any]:
    rounds, repeats = (w.quick_rounds, 1) if quick else (w.rounds, w.repeats)
    private = dataclasses.replace(w, overrides=(*w.overrides, *DP))
    plain_s, dp_s, steps = [], [], {"without": [], "with": []}
    for i in range(repeats):
        order = ((w, "without"), (private, "with")) if i % 2 == 0 else ((private, "with"), (w, "without"))
        for workload, side in order:
            seconds, n = _run(workload, rounds)
            (dp_s if side == "with" else plain_s).append(seconds)
            steps[side].append(n)
        print(f"  [{w.key}] run {i + 1}/{repeats}: without {plain_s[-1]:.3f}s  with DP {dp_s[-1]:.3f}s", flush=True)
    return {
        "title": w.title, "rounds": rounds, "repeats": repeats, "without_s": plain_s, "with_s": dp_s,
        "paired": statistics.median(d / p for d, p in zip(dp_s, plain_s)),
        "steps_without": statistics.median(steps["without"]), "steps_with": statistics.median(steps["with"]),
    }  # fmt: skip


def dp_report(quick: bool = False) -> dict[str, Any]:
    harness.quiet()
    return {key: measure(w, quick) for key, w in CASES.items()}


def table(report: dict[str, Any]) -> str:
    head = (
        f"{'workload':9s}{'rounds':>7s}{'without s':>11s}{'with DP s':>11s}{'paired':>8s}{'local steps w/o, w/':>22s}"
    )
    lines = [head, "-" * len(head)]
    for key, r in report.items():
        lines.append(
            f"{key:9s}{r['rounds']:7d}{statistics.median(r['without_s']):11.3f}{statistics.median(r['with_s']):11.3f}"
            f"{r['paired']:8.2f}{r['steps_without']:>13.0f}, {r['steps_with']:.0f}"
        )
    lines.append("trainer.fit with privacy=central (noise_multiplier 1, Poisson, PLD) against the same run without it")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(table(dp_report(parser.parse_args().quick)))
