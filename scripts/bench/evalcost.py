"""The cost of evaluation: ``make bench``'s ``eval`` section (``run.py``), or ``python scripts/bench/evalcost.py``.

The default run's config (``python train.py``: digits, the MLP, 30 clients, the default callbacks) and workload b,
fit in one process with validation after every round (``eval_every=1``), every 5 rounds and only after the last round:
the time of one evaluation (the validation loop with its per-client metrics) is
``(fit(eval_every=1) - fit(eval_every=R)) / (R - 1)``, set against the time of one training round, ``fit(eval_every=R)
/ R``. Evaluation runs only on evaluation rounds (``eval_every``), in batches of ``data.eval_batch_size`` from the
in-memory tensors, its rows split over the ranks (docs/loop.md#validation-and-test).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch
from workloads import WORKLOADS

from flx.config import precheck
from flx.run import build

SETUPS = {"default run": (), "workload b": WORKLOADS["b"].overrides}


def fit_seconds(overrides: tuple[str, ...], rounds: int, every: int) -> float:
    with tempfile.TemporaryDirectory(prefix="flx-bench-eval-") as out:
        cfg = precheck([*overrides, f"algo.rounds={rounds}", f"eval_every={every}", f"paths.output_dir={out}"])
        dm, module, trainer = build(cfg)
        start = time.perf_counter()
        trainer.fit(module, datamodule=dm)
        return time.perf_counter() - start


def eval_report(quick: bool = False) -> dict[str, dict[str, float]]:
    rounds, repeats = (10, 1) if quick else (30, 3)
    torch.set_num_threads(1)
    report = {}
    for name, overrides in SETUPS.items():
        runs = {every: [] for every in (rounds, 5, 1)}
        for _ in range(repeats):
            for every in runs:
                runs[every].append(fit_seconds(overrides, rounds, every))
        t = {every: statistics.median(v) for every, v in runs.items()}
        round_s, eval_s = t[rounds] / rounds, (t[1] - t[rounds]) / (rounds - 1)
        report[name] = {
            "round_s": round_s,
            "evaluation_s": eval_s,
            "evaluation_over_round": eval_s / round_s,
            "fit_eval_every_1_s": t[1],
            "fit_eval_every_5_s": t[5],
            "fit_eval_last_only_s": t[rounds],
        }
        r = report[name]
        print(
            f"  {name}: a training round {round_s * 1e3:.1f} ms, an evaluation {eval_s * 1e3:.1f} ms "
            f"({r['evaluation_over_round']:.2f} rounds); fit of {rounds} rounds: eval_every=1 {t[1]:.2f}s, "
            f"5 {t[5]:.2f}s, last only {t[rounds]:.2f}s",
            flush=True,
        )
    return report


if __name__ == "__main__":
    import harness

    harness.quiet()
    eval_report()
