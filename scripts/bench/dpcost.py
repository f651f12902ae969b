"""The cost of DP per round: flx with ``privacy=central`` (user level) or ``privacy=local`` (DP-SGD local steps)
against the same run without it.

Per workload, ``trainer.fit`` of the run as a user gets it (console, CSV logger, round checkpoints) with and without
``privacy=central privacy.noise_multiplier=1.0`` (Poisson sampling, the PLD accountant: the defaults), alternated,
a fresh build each time (only ``fit`` is timed; the noise is given, so nothing is calibrated). What DP adds per round:
drawing the cohort, clipping each upload, one noise draw the size of the model, and the accountant's epsilon for
``privacy/epsilon`` (one PLD composition, ~10 ms, whatever the model). Poisson cohorts vary in size around
``algo.clients_per_round``; over the rounds the clients trained are about the same on both sides (printed).
``privacy=local privacy.noise_multiplier=1.0`` (cases ``*-local``) adds per-example gradients (``torch.func``), their
clipping and a noise draw the size of the model at every local step of every client, and the per-client ledger;
``mlp-local-vec`` runs both sides with ``algo.vectorize=true`` (stacked clients).

Usage: ``python scripts/bench/run.py --sections dp [--quick]``; :func:`dp_report` returns a dict.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import harness
from workloads import MAKE_TRAIN, WORKLOADS, Workload

DP = ("privacy=central", "privacy.noise_multiplier=1.0")
LOCAL = ("privacy=local", "privacy.noise_multiplier=1.0")
VEC = ("algo.vectorize=true",)
CASES: dict[str, tuple[Workload, tuple[str, ...]]] = {
    "b": (WORKLOADS["b"], DP),
    "mlp": (MAKE_TRAIN, DP),
    "b-local": (WORKLOADS["b"], LOCAL),
    "mlp-local": (MAKE_TRAIN, LOCAL),
    "mlp-local-vec": (dataclasses.replace(MAKE_TRAIN, overrides=(*MAKE_TRAIN.overrides, *VEC)), LOCAL),
}


def _run(w: Workload, rounds: int) -> tuple[float, int]:
    """Seconds of one ``trainer.fit`` and the clients it trained."""
    b = harness.build_flx(harness.compose(w, rounds, "cpu"))
    run = harness.run_flx(b)
    return run.seconds, run.steps


def measure(w: Workload, quick: bool, dp: tuple[str, ...] = DP) -> dict[str, Any]:
    rounds, repeats = (w.quick_rounds, 1) if quick else (w.rounds, w.repeats)
    private = dataclasses.replace(w, overrides=(*w.overrides, *dp))
    plain_s, dp_s, steps = [], [], {"without": [], "with": []}
    for i in range(repeats):
        order = ((w, "without"), (private, "with")) if i % 2 == 0 else ((private, "with"), (w, "without"))
        for workload, side in order:
            seconds, n = _run(workload, rounds)
            (dp_s if side == "with" else plain_s).append(seconds)
            steps[side].append(n)
        print(f"  [{w.key}] run {i + 1}/{repeats}: without {plain_s[-1]:.3f}s  with DP {dp_s[-1]:.3f}s", flush=True)
    return {
        "title": w.title, "privacy": dp[0], "rounds": rounds, "repeats": repeats, "without_s": plain_s, "with_s": dp_s,
        "paired": statistics.median(d / p for d, p in zip(dp_s, plain_s)),
        "steps_without": statistics.median(steps["without"]), "steps_with": statistics.median(steps["with"]),
    }  # fmt: skip


def dp_report(quick: bool = False) -> dict[str, Any]:
    harness.quiet()
    return {key: measure(w, quick, dp) for key, (w, dp) in CASES.items()}


def table(report: dict[str, Any]) -> str:
    head = (
        f"{'workload':14s}{'rounds':>7s}{'without s':>11s}{'with DP s':>11s}{'paired':>8s}{'local steps w/o, w/':>22s}"
    )
    lines = [head, "-" * len(head)]
    for key, r in report.items():
        lines.append(
            f"{key:14s}{r['rounds']:7d}{statistics.median(r['without_s']):11.3f}{statistics.median(r['with_s']):11.3f}"
            f"{r['paired']:8.2f}{r['steps_without']:>13.0f}, {r['steps_with']:.0f}"
        )
    lines.append("trainer.fit with privacy=central, or privacy=local (*-local), noise_multiplier 1, Poisson, PLD,")
    lines.append("against the same run without it")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    print(table(dp_report(parser.parse_args().quick)))
