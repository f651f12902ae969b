"""Reproduce the shape of DRFA's Fashion-MNIST study (Deng et al., NeurIPS 2020, Figs. 1-3) on embedded data.

    .venv/bin/python scripts/reproduce/drfa.py            # digits, 10 clients one class each, 3 seeds
    .venv/bin/python scripts/reproduce/drfa.py --quick    # 1 seed, few rounds (smoke)
    .venv/bin/python scripts/reproduce/drfa.py --data fashion_mnist   # the paper's data (files under data/)

Protocol (paper Sec. 6, Figs. 1-2): N=10 clients, each holding one class (`partition=one_class_per_client`),
each measured on the test rows of its class (`client_eval=test_labels`), logistic regression started from zeros
(`model.init=zeros`, as in the authors' code; the paper does not say), eta 0.1, batch 50, m = N,
gamma 8e-3 for DRFA and AFL, q 0.2 for q-FedAvg, tau in {5, 10, 15} for DRFA and tau 10 for the baselines; AFL is
tau = 1. Every method runs the same number of communication rounds and the same seeds; the data split and the
partition are fixed (``data.split_seed``, ``partition.seed``), the seeds vary initialisation and sampling. Writes
`docs/results/drfa/{table.md,table.csv,worst_acc.png,lambda.png}`: worst-client and mean client accuracy at fixed
rounds, the largest client training loss max_i f_i (the objective DRFA minimises) at the end, the rounds (and local
steps) to 50% worst-client accuracy, the curves and lambda over rounds.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUIET_CPU  # noqa: E402

OUT = ROOT / "docs" / "results" / "drfa"
DATA = {"digits": ["data=digits"], "fashion_mnist": ["data=fashion_mnist"]}
BASE = [
    "model=logreg",
    "model.init=zeros",  # w^0 = 0: the paper is silent, the authors' FedTorch logistic regression starts from zeros
    "partition=one_class_per_client",
    "partition.test_fraction=0",  # clients train on their whole class ...
    "client_eval=test_labels",  # ... and are evaluated on the global test rows of it (per-class accuracy)
    "algo.lr=0.1",
    "algo.batch_size=50",
    "algo.clients_per_round=10",
    "algo.weighting=uniform",
    *QUIET_CPU,
    # max_i f_i of the global model on the training rows (the DRFA objective) for every method, baselines included
    "++algo.parts.client_loss._target_=flx.callbacks.client_loss.ClientLoss",
    # the paper has no validation split: clients train on their whole class and the curves are test accuracy per
    # round (eval_test: the test split inside the validation loop, plotted and tabulated here, never used to select)
    "data.val_fraction=0",
    "eval_test=true",
]
FEDTORCH = ["algo.sampling=uniform_weighted", "algo.gamma_decay=0.9", "algo.lambda_floor=1e-3"]
METHODS = {  # name -> (tau, overrides)
    "DRFA": (10, ["algo=drfa"]),
    "DRFA tau=5": (5, ["algo=drfa"]),
    "DRFA tau=15": (15, ["algo=drfa"]),
    "DRFA, authors' code options": (10, ["algo=drfa", *FEDTORCH, "algo.lambda_init=num_samples"]),
    "AFL": (1, ["algo=afl"]),
    "q-FedAvg (q=0.2)": (10, ["algo=qfedavg", "algo.q=0.2"]),
    "FedAvg": (10, ["algo=fedavg"]),
}
WORST, MEAN, STD = "test/client_acc_worst", "test/client_acc_mean", "test/client_acc_std"
LOSS_MAX = "train/client_loss_max"


def run(overrides: list[str], seed: int, rounds: int) -> tuple[dict, list | None]:
    from flx.config import precheck
    from flx.run import train

    with tempfile.TemporaryDirectory() as out:
        cfg = precheck([*BASE, *overrides, f"seed={seed}", f"algo.rounds={rounds}", f"paths.output_dir={out}"])
        train(cfg)
        curves = json.loads((Path(out) / "curves.json").read_text())
        lam_file = Path(out) / "lambda.json"
        lam = json.loads(lam_file.read_text())["round_end"] if lam_file.exists() else None
    return curves, lam


def _at(curve: list, rnd: int) -> float:
    """The value logged after round ``rnd`` (1-based), or the last one if the run is shorter."""
    return dict(curve).get(rnd, curve[-1][1])


def _first(curve: list, level: float) -> int | None:
    return next((r for r, v in curve if v >= level), None)


def _mean_std(values: list[float], digits: int = 3) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {std:.{digits}f}"


def _reached(rounds: list[int | None], tau: int) -> tuple[str, str]:
    hit = [r for r in rounds if r is not None]
    if not hit:
        return "not reached", "not reached"
    note = "" if len(hit) == len(rounds) else f" ({len(hit)}/{len(rounds)} seeds)"
    return _mean_std(hit, 1) + note, _mean_std([r * tau for r in hit], 0) + note


def main(argv: list[str]) -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for the table and the plots")
    parser.add_argument("--data", choices=sorted(DATA), default="digits")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    args = parser.parse_args(argv)
    OUT = Path(args.out) if args.out else OUT
    seeds, rounds = ([0], 4) if args.quick else ([0, 1, 2], 200)
    rounds = args.rounds or rounds
    early = max(1, rounds // 4)
    BASE[:0] = DATA[args.data]
    BASE.extend(args.set)
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("PYTHONWARNINGS", "ignore")

    header = ["method", "tau", f"worst @{early}", f"worst @{rounds}", f"mean @{rounds}", f"std @{rounds}"]
    header += [f"max f_i @{rounds}"]
    header += ["rounds to 50% worst", "local steps to 50% worst"]
    rows, curves, lam = [], {}, None
    for name, (tau, overrides) in METHODS.items():
        results = []
        for seed in seeds:
            curve, history = run([*overrides, f"algo.local_steps={tau}"], seed, rounds)
            results.append(curve)
            curves.setdefault(name, curve)
            if name == "DRFA" and lam is None:
                lam = history
            worst = curve[WORST]
            print(f"{name} seed={seed}: worst@{rounds}={worst[-1][1]:.3f} first50={_first(worst, 0.5)}", flush=True)
        rows.append(
            [name, str(tau)]
            + [_mean_std([_at(c[WORST], early) for c in results]), _mean_std([_at(c[WORST], rounds) for c in results])]
            + [_mean_std([_at(c[MEAN], rounds) for c in results]), _mean_std([_at(c[STD], rounds) for c in results])]
            + [_mean_std([_at(c[LOSS_MAX], rounds) for c in results])]
            + list(_reached([_first(c[WORST], 0.5) for c in results], tau))
        )
    _write(header, rows)
    _plot(curves, lam)
    print((OUT / "table.md").read_text())


def _write(header: list[str], rows: list[list[str]]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "table.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    (OUT / "table.md").write_text("\n".join(lines) + "\n")


def _plot(curves: dict[str, dict], lam: list[list[float]] | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, curve in curves.items():
        axes[0].plot(*zip(*curve[WORST]), label=name, linewidth=1.2)
        axes[1].plot(*zip(*curve[MEAN]), label=name, linewidth=1.2)
    for ax, title in zip(axes, ("worst-client accuracy", "mean client accuracy")):
        ax.axhline(0.5, color="grey", linewidth=0.6, linestyle=":")
        ax.set_xlabel("communication round")
        ax.set_title(f"{title} (seed 0)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "worst_acc.png", dpi=120)
    plt.close(fig)
    if lam:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for i, series in enumerate(zip(*lam)):
            ax.plot(range(1, len(lam) + 1), series, label=f"client {i}", linewidth=1)
        ax.set_xlabel("communication round")
        ax.set_ylabel("lambda_i")
        ax.set_title("DRFA mixing weights (tau=10, seed 0)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(OUT / "lambda.png", dpi=120)
        plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
