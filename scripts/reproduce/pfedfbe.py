"""Reproduce pFedFBE's experiments (anonymous ICLR submission, Sec. 4.1-4.3, Figs. 1-6).

    .venv/bin/python scripts/reproduce/pfedfbe.py                        # every setting, 3 seeds, the paper's rounds
    .venv/bin/python scripts/reproduce/pfedfbe.py --quick                # 1 seed, few rounds (smoke)
    .venv/bin/python scripts/reproduce/pfedfbe.py --seeds 0 --rounds 50 --settings lasso2 matrix
    .venv/bin/python scripts/reproduce/pfedfbe.py --seeds 0 --rounds 1000 --methods pFedFBE FedMiD   # longer runs
    .venv/bin/python scripts/reproduce/pfedfbe.py --tune                 # the baselines' step sizes tuned first
    .venv/bin/python scripts/reproduce/pfedfbe.py --tune --jobs 2        # 2 runs at once (the same numbers)

Settings (`--settings`), each an experiment that holds its protocol and pFedFBE's values (`configs/experiment/`,
`python train.py experiment=<name>` runs pFedFBE in it): `lasso1`, `lasso2` (federated Lasso (I) and (II), §4.1;
`pfedfbe_lasso1`, `pfedfbe_lasso2`), `matrix` (matrix completion, §4.2; `pfedfbe_matrix`) and `mnist` (the MLP with a
nonsmooth l2 norm on its weights, §4.3, on the embedded 8x8 digits; `pfedfbe_digits`; `--set data=mnist` takes the
MNIST files). Every method runs in the experiment (`experiment=<name> algo=<method>`), with the experiment's `h`
(in its steps for the composite methods only) and its own lambda. Protocol: 30 generated clients x 128 rows
(`partition=by_group`), 10 clients a round, R = 20 local steps, batch 50, 200 rounds, `h = 0.1 ||w||_1` or
`0.1 ||W||_*`, float64, every client measured on 128 held-out rows of its own distribution
(`client_eval=test_group`; the paper has no test rows); MNIST: 20 clients with 2 labels, R = 10, batch 20, 100
rounds, `h = mu sum_l ||W_l||_2` (mu = 1e-3: the paper gives none). pFedFBE: eta = 5e-4, lambda = 2000 (MNIST
5e-3, 200). The paper tuned the baselines' step sizes and does not report them: with
`--tune` each baseline's `algo.lr` is searched over `TUNE_FACTORS` x eta on a seed of its own (`common.TUNE_SEED`,
none of the reported seeds) by the final training objective, and the table names the step size each method ran at
(`tuned.json` holds every candidate's score); without it every method uses pFedFBE's eta (none diverges at it;
larger ones diverge on these problems, L ~ 1e3). pFedMe's inner step nu = eta (not tuned) on the synthetic data (its
default 0.09 diverges there). Methods without personalisation are
evaluated with the global model as their personalised model (Sec. 4.1). Seeds vary the initial sampling and batches;
the generated data are fixed (`data.split_seed`).

Writes `docs/results/pfedfbe/{table.md,table.csv,<setting>.png}`: per setting and method, the final training
objective `F(w) = mean_i f_i(w) + h(w)` of the global model (`flx.parts.measures.objective`), the mean personalised
objective `mean_j f_j(theta_j) + h(theta_j)` and pFedFBE's envelope objective (Eq. 7), the support scores (Lasso:
global model in (I), personalised models in (II), as the paper), the rank and recovery error of the personalised
models (matrix completion), the global and personalised test metric, mean ± std over seeds; and the curves, a point
every 5 rounds (the experiments' ``eval_every``; every round when 5 does not divide the rounds).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import sys
import tempfile
from concurrent.futures import Future
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))  # flx, here and in the --jobs workers (they import this module)
from common import QUIET_CPU, TUNE_SEED, composed, executor, mean_std, own, plot_curves, save_tuned, tune  # noqa: E402

OUT = ROOT / "docs" / "results" / "pfedfbe"
BASE = [*QUIET_CPU]
# setting -> (label, the experiment that holds it: configs/experiment/<name>.yaml, pFedFBE at the paper's values)
SETTINGS = {
    "lasso1": ("Lasso (I)", "pfedfbe_lasso1"),
    "lasso2": ("Lasso (II)", "pfedfbe_lasso2"),
    "matrix": ("matrix completion", "pfedfbe_matrix"),
    "mnist": ("MNIST-like (digits, 2 labels a client)", "pfedfbe_digits"),
}
METHODS = {  # name -> (algo, uses h in its steps, settings it runs in)
    "FedAvg": ("fedavg_personal", False, ("lasso1", "lasso2", "matrix", "mnist")),
    "FedMiD": ("fedmid", True, ("lasso1", "lasso2", "matrix", "mnist")),
    # FedMiD without its server prox (algo.server_prox=false: the server takes the primal mean only): the paper names
    # one FedMiD and does not say which, so the variant runs by name only (--methods 'FedMiD (no server prox)')
    "FedMiD (no server prox)": ("fedmid", True, ("lasso1", "lasso2", "matrix")),
    "FedDualAvg": ("feddualavg", True, ("lasso1", "lasso2", "mnist")),  # dropped by the paper for matrix completion
    "pFedMe": ("pfedme", True, ("lasso1", "lasso2", "matrix", "mnist")),
    "Ditto": ("ditto", True, ("lasso1", "lasso2", "matrix", "mnist")),
    "FedProx-personal": ("fedprox_personal", False, ("matrix",)),
    "pFedFBE": ("pfedfbe", True, ("lasso1", "lasso2", "matrix", "mnist")),
}
DEFAULT_METHODS = [m for m in METHODS if m != "FedMiD (no server prox)"]
SUPPORT = ("support_f1", "support_precision", "support_recall", "density")
# --tune: each baseline's step size algo.lr over these multiples of pFedFBE's eta (the paper: "we tune the step sizes
# of the baselines", values not reported), on seed TUNE_SEED, by the final training objective F(w) (its figures' main
# panel); pFedFBE keeps the paper's eta. Larger multiples diverge on the generated data (L ~ 1e3, eta <= ~1e-3)
TUNE_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
# overrides of the tuning runs only: pFedMe's evaluated personal model (algo.personal) does not change its training,
# and the selection metric is the global model's objective, so its tuning runs skip the per-round optimum solve
TUNE_ONLY = {"pFedMe": ["algo.personal=stored"]}


def experiment(setting: str) -> Any:
    """The composed experiment of ``setting`` (its paper values: ``.algo.lr`` is eta, ``.algo.rounds`` the rounds)."""
    return composed(f"experiment={SETTINGS[setting][1]}")


def eta(setting: str) -> float:
    """pFedFBE's step size in ``setting`` (the paper's): every method's without ``--tune``."""
    return float(experiment(setting).algo.lr)


def overrides(setting: str, method: str, lr: float | None = None) -> list[str]:
    """The command-line overrides of one run (besides seed, rounds and the output folder): the setting's experiment,
    the method, and ``lr`` (the method's step size; default: the experiment's, pFedFBE's eta). Every method runs in
    the experiment's protocol and with its ``h``; lambda is pFedFBE's alone, and ``h`` is in the steps of the
    composite methods only: the others take their own config's values of these keys."""
    algo, composite, _ = METHODS[method]
    out = [f"experiment={SETTINGS[setting][1]}", f"algo={algo}", f"algo.lr={lr or eta(setting)}"]
    if method != "pFedFBE":
        out += own(algo, ["lam", *(() if composite else ("regularizer",))])
    if method.startswith(("FedMiD", "FedDualAvg")):  # no personalisation: the global model is the personalised one
        out += ["+algo.parts.personal_model._target_=flx.parts.personalisation.personal_model.PersonalModel"]
        out += ["+algo.parts.personal_model.model=global"]  # (Sec. 4.1)
    if method == "FedMiD (no server prox)":
        out.append("algo.server_prox=false")
    if method == "pFedMe" and setting != "mnist":
        out.append(f"algo.personal_lr={eta(setting)}")  # nu: the default 0.09 diverges when L ~ 1e3
    return out


def run(args: list[str], seed: int, rounds: int) -> tuple[dict, dict]:
    from flx.config import precheck
    from flx.run import train

    name = next(a.split("=", 1)[1] for a in args if a.startswith("experiment="))
    with tempfile.TemporaryDirectory() as out:
        # evaluated every eval_every rounds of the experiment (5) if that divides the rounds (the last is always
        # evaluated: the tables' values), else every round
        every = f"eval_every={math.gcd(composed(f'experiment={name}').eval_every, rounds)}"
        cfg = precheck([*BASE, every, *args, f"seed={seed}", f"algo.rounds={rounds}", f"paths.output_dir={out}"])
        final = train(cfg)
        curves = json.loads((Path(out) / "curves.json").read_text())
    return final, curves


def columns(setting: str) -> list[tuple[str, str]]:
    """(header, key) of the table's metrics: ``curve:<key>`` is the last point of a curve, else a final test metric."""
    cols = [("train objective F(w)", "curve:train/objective")]
    cols += [("train personalised objective", "curve:train/personal_objective")]
    cols += [("train FBE objective (Eq. 7; pFedFBE)", "curve:train/fbe_objective")]
    if setting in ("lasso1", "lasso2"):
        prefix, note = ("", "global") if setting == "lasso1" else ("personal_", "personalised")
        cols += [(f"{k.replace('support_', 'support ')} ({note})", f"test/{prefix}{k}") for k in SUPPORT]
        if setting == "lasso2":
            cols = [(h, k + "_mean" if k.startswith("test/personal_") else k) for h, k in cols]
    if setting == "matrix":
        cols += [("rank (personalised)", "test/personal_rank_mean")]
        cols += [("recovery error (personalised)", "test/personal_recovery_error_mean")]
    metric = "acc" if setting == "mnist" else "mse"
    return cols + [
        (f"test {metric} (global)", f"test/{metric}"),
        (f"test {metric} (personalised)", f"test/personal_{metric}_mean"),
    ]


def _value(final: dict, curves: dict, key: str) -> float:
    if key.startswith("curve:"):
        curve = curves.get(key[6:])
        return curve[-1][1] if curve else math.nan
    return final.get(key, math.nan)


def main(argv: list[str]) -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds for every setting (default: the paper's)")
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--settings", nargs="*", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--methods", nargs="*", choices=list(METHODS), default=DEFAULT_METHODS)
    parser.add_argument("--out", default=None, help="folder for the table and the plots")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    parser.add_argument(
        "--tune",
        action="store_true",
        help=f"tune each baseline's algo.lr over {TUNE_FACTORS} x eta on seed {TUNE_SEED} first (tuned.json)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, in worker processes (one per free core)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"argument --jobs: {args.jobs}: must be at least 1")
    OUT = Path(args.out) if args.out else OUT
    seeds = args.seeds if args.seeds is not None else [0] if args.quick else [0, 1, 2]
    rounds = args.rounds or (3 if args.quick else None)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")

    command = "python scripts/reproduce/pfedfbe.py " + shlex.join(argv)  # quoted: runnable as printed
    plan = [
        (setting, method)
        for setting in args.settings
        for method, (_, _, where) in METHODS.items()
        if setting in where and method in args.methods
    ]
    n_of = {setting: rounds or experiment(setting).algo.rounds for setting in args.settings}
    pool = executor(args.jobs)
    # every tuning run first (each baseline's grid, on TUNE_SEED), then each method's reported runs once its step
    # size is chosen: with --jobs the pool never waits for one method's tuning while others are queued
    searches = {
        (setting, method): {
            lr: pool.submit(run, [*args.set, *overrides(setting, method, lr), *TUNE_ONLY.get(method, [])], TUNE_SEED,
                            n_of[setting])
            for lr in _grid(setting)
        }
        for setting, method in plan
        if args.tune and method != "pFedFBE"
    }  # fmt: skip
    tuned: dict[str, dict] = {}
    reported = {}
    for setting, method in plan:
        lr = eta(setting)
        if (setting, method) in searches:
            lr = _tune(setting, method, n_of[setting], searches[(setting, method)], tuned)
        runs = [pool.submit(run, [*args.set, *overrides(setting, method, lr)], seed, n_of[setting]) for seed in seeds]
        reported[(setting, method)] = (lr, runs)
    sections, csv_rows, header_csv = [], [], ["setting", "method", "rounds", "seeds", "lr"]
    for setting in args.settings:
        label, n, cols = SETTINGS[setting][0], n_of[setting], columns(setting)
        rows, curves = [], {}
        for method in [m for s, m in plan if s == setting]:
            lr, runs = reported[(setting, method)]
            results = []
            for seed, future in zip(seeds, runs):
                final, curve = future.result()
                results.append((final, curve))
                curves.setdefault(method, curve)
                obj = _value(final, curve, "curve:train/objective")
                print(f"{setting} {method} seed={seed}: objective={obj:.4f}", flush=True)
            cells = [mean_std([_value(f, c, key) for f, c in results]) for _, key in cols]
            rows.append([method, f"{lr:g}", *cells])
            csv_rows.append(
                [setting, method, str(n), str(len(seeds)), f"{lr:g}", *(f"{h}={v}" for (h, _), v in zip(cols, cells))]
            )
        sections.append((label, n, ["method", "step size", *(h for h, _ in cols)], rows))
        _plot(setting, label, curves)
    pool.shutdown()
    if tuned:
        save_tuned(OUT / "tuned.json", tuned)
    _write(command, seeds, sections, header_csv, csv_rows, args.tune)
    print((OUT / "table.md").read_text())


def _grid(setting: str) -> list[float]:
    """The step sizes ``--tune`` tries in ``setting``: :data:`TUNE_FACTORS` x pFedFBE's eta."""
    return [eta(setting) * f for f in TUNE_FACTORS]


def _tune(setting: str, method: str, rounds: int, runs: dict[float, Future], tuned: dict[str, dict]) -> float:
    """The baseline's step size: the multiple of eta whose run (``runs``, on seed :data:`TUNE_SEED`) ended with the
    lowest training objective; recorded in ``tuned``."""

    def objective(lr: float) -> float:
        final, curve = runs[lr].result()
        value = _value(final, curve, "curve:train/objective")
        print(f"  tune {setting} {method} lr={lr:g}: objective={value:.4f}", flush=True)
        return value

    best, scores = tune(_grid(setting), objective)
    tuned.setdefault(setting, {})[method] = {
        "lr": best,
        "scores": {f"{lr:g}": v for lr, v in scores.items()},
        "seed": TUNE_SEED,
        "rounds": rounds,
        "metric": "final train/objective",
    }
    return best


def _write(
    command: str, seeds: list[int], sections: list, header_csv: list[str], csv_rows: list[list[str]], tuned: bool
) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "table.csv", "w", newline="") as f:
        csv.writer(f).writerows([[*header_csv, "metric=value ..."], *csv_rows])
    how = (
        f"each baseline's step size tuned over {list(TUNE_FACTORS)} x pFedFBE's eta on seed {TUNE_SEED} by the final "
        "training objective (tuned.json); pFedFBE at the paper's eta"
        if tuned
        else "not tuned: every method at pFedFBE's eta"
    )
    lines = [f"Produced by `{command.strip()}` (seeds {seeds}; mean ± std over seeds; {how}).", ""]
    for label, n, header, rows in sections:
        lines += [f"### {label}, {n} rounds", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows] + [""]
    (OUT / "table.md").write_text("\n".join(lines))


def _plot(setting: str, label: str, curves: dict[str, dict]) -> None:
    metric = "test/acc" if setting == "mnist" else "test/mse"
    third = {
        "lasso1": "val/support_f1",
        "lasso2": "val/personal_support_f1_mean",
        "matrix": "val/personal_rank_mean",
        "mnist": "test/personal_acc_mean",
    }[setting]
    log = ("train/objective",) if setting == "mnist" else ("train/objective", metric)
    plot_curves(OUT / f"{setting}.png", label, curves, ("train/objective", metric, third), log)


if __name__ == "__main__":
    main(sys.argv[1:])
