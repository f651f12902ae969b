"""One benchmark command: the baselines x heterogeneity settings x seeds, on one budget, as one table and one plot.

    python scripts/benchmark.py                 # the default grid on the bundled digits, tuned (< 2 h on 2 cores)
    python scripts/benchmark.py --quick         # 2 settings, 1 seed, 10 rounds, untuned (< 10 min; smoke)
    python scripts/benchmark.py --out DIR       # write the table, plot and run store there
    python scripts/benchmark.py --data cifar10 --set model=cnn trainer.accelerator=gpu --rounds 50 --local-epochs 10 \
        --batch-size 64 --lr 0.01 --momentum 0.9 --no-tune                 # NIID-Bench's CIFAR-10 protocol, on a GPU

Protocol (the NIID-Bench study's shape: Li, Diao, Chen, He, "Federated Learning on Non-IID Data Silos: An
Experimental Study", ICDE 2022, arXiv:2102.02079, Section 5): ``--clients`` clients (10) that all train every round,
plus ``--unseen`` clients that never train (``partition.unseen_clients``: their accuracy is the "unseen" column, Yuan
et al., ICLR 2022), each client keeping a fifth of its rows as its own test split (the personalised methods' accuracy,
``client_eval=holdout``); every method gets the same budget: ``--rounds`` rounds of ``--local-epochs`` passes over
each client's rows at batch ``--batch-size`` (so clients of different sizes do different work, as in NIID-Bench and
FedNova's experiments). The settings (``--settings``) are NIID-Bench's kinds of skew: IID, label distribution skew
``Dir(beta)``, label quantity skew ``#C=k``, noise-based feature skew, quantity skew (``partition=niid_dirichlet``,
``label_quantity``, ``noise_feature``, ``niid_quantity``: docs/baselines.md). The partition is fixed
(``partition.seed`` 0, the data split ``data.split_seed`` 0): the seeds vary the initial model and the minibatches.

Step sizes: each method's local step size ``algo.lr`` is tuned per setting over ``GRID`` on a seed of its own
(``common.TUNE_SEED``, none of the reported seeds), scored by its headline validation metric (``val/acc``, or
``val/personal_acc_mean`` for a method that personalises) averaged over the last quarter of the rounds; the rest of
each method's keys are its config's defaults (``configs/algo/<name>.yaml``). ``--no-tune`` runs every method at its
config's ``algo.lr`` (``--lr`` sets one for all). ``tuned.json`` keeps every candidate's score.

Writes ``OUT/{table.md,table.csv,tuned.json,accuracy.png}`` and ``OUT/runs/`` (every run, stored by its resolved config:
a killed sweep continues where it stopped when called again, and ``--stored-only`` rebuilds the table from the store).
OUT is ``docs/results/baselines/`` (``--quick``: ``docs/results/baselines/quick/``) unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import shlex
import statistics
import sys
import time
from concurrent.futures import Future
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "reproduce"))
sys.path.insert(0, str(ROOT / "src"))
from common import QUIET_CPU, TUNE_SEED, composed, executor, mean_std, save_tuned, stored_run, tune  # noqa: E402

OUT = ROOT / "docs" / "results" / "baselines"
METHODS = {  # the table's name -> configs/algo/<name>.yaml
    "FedAvg": "fedavg",
    "FedProx": "fedprox",
    "FedAvgM": "fedavgm",
    "FedAdam": "fedadam",
    "FedAdagrad": "fedadagrad",
    "FedYogi": "fedyogi",
    "SCAFFOLD": "scaffold",
    "FedNova": "fednova",
    "FedDyn": "feddyn",
    "MOON": "moon",
    "FedBN": "fedbn",
    "FedPer": "fedper",
    "FedRep": "fedrep",
    "FedBABU": "fedbabu",
    "LG-FedAvg": "lg_fedavg",
    "APFL": "apfl",
    "FedALA": "fedala",
    "Ditto": "ditto",
}
SETTINGS = {  # NIID-Bench's skews (Section III), on --clients + --unseen clients
    "IID": ["partition=iid"],
    "Dir(0.5)": ["partition=niid_dirichlet", "partition.alpha=0.5"],
    "Dir(0.1)": ["partition=niid_dirichlet", "partition.alpha=0.1"],
    "#C=2": ["partition=label_quantity", "partition.classes_per_client=2"],
    "noise(0.1)": ["partition=noise_feature", "partition.noise=0.1"],
    "quantity Dir(0.5)": ["partition=niid_quantity", "partition.alpha=0.5"],
}
QUICK_SETTINGS = ["IID", "Dir(0.1)"]
GRID = (0.01, 0.03, 0.1, 0.3)  # algo.lr, half-decades around the configs' 0.05
SEEDS = (0, 1, 2)
_UP = "unseen/personal_acc_mean"  # the unseen clients' personalised models (the method's adaptation, if any)
KEEP = ("acc", "train/loss")  # the curves a stored run keeps (metric keys containing one of these)


def keep(key: str) -> bool:
    """Whether the store keeps the curve ``key``: accuracies and the training loss (not the per-client spreads)."""
    return any(k in key for k in KEEP) and "client_acc" not in key


def budget(args: argparse.Namespace, setting: str) -> list[str]:
    """The overrides every run of ``setting`` shares: its partition, the clients and the budget."""
    over = [*QUIET_CPU, *(f"data={args.data}",) * (args.data is not None), *SETTINGS[setting]]
    over += [
        f"partition.num_clients={args.clients + args.unseen}",
        "partition.test_fraction=0.2",
        "partition.seed=0",
        "algo.clients_per_round=all",
        f"algo.rounds={args.rounds}",
        f"algo.local_epochs={args.local_epochs}",
        f"algo.batch_size={args.batch_size}",
        "eval_test=true",
        "client_eval=holdout",
    ]
    if args.unseen:
        over.append(f"partition.unseen_clients={args.unseen}")
    if args.momentum is not None:
        over.append(f"algo.momentum={args.momentum}")
    return over + list(args.set)


def headline(curves: dict, split: str) -> str:
    """The metric a method is judged by: its personalised mean accuracy when it personalises, else the global one."""
    personal = f"{split}/personal_acc_mean"
    return personal if personal in curves else f"{split}/acc"


def validation_score(record: dict | None) -> float:
    """A tuning run's score: its headline validation metric averaged over the last quarter of its rounds (at least
    one); nan for a run that failed or did not finish (:func:`common.tune` ranks it last)."""
    if record is None:
        return math.nan
    values = [v for _, v in record["curves"][headline(record["curves"], "val")]]
    tail = values[-max(1, len(values) // 4) :]
    return statistics.mean(tail) if tail else math.nan


def collect(jobs: dict[tuple, Future]) -> dict[tuple, dict | None]:
    """Each job's record; None for a run that failed (a divergence, stored as such: its line is printed, the run
    counts as missing and is not trained again) or is not in the store (``--stored-only``)."""
    out = {}
    for key, job in jobs.items():
        record = job.result()
        if record is not None and "failed" in record:
            print(f"{' '.join(map(str, key))}: failed ({record['failed']})", flush=True)
            record = None
        out[key] = record
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 settings, 1 seed, 10 rounds, untuned (smoke)")
    parser.add_argument("--out", default=None, help="default docs/results/baselines (--quick: .../quick)")
    parser.add_argument("--methods", nargs="*", choices=list(METHODS), default=None, help="default: all")
    parser.add_argument("--settings", nargs="*", choices=list(SETTINGS), default=None, help="default: all")
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--data", default=None, help="a data config (default: the bundled digits)")
    parser.add_argument("--clients", type=int, default=10, help="clients that train (all, every round)")
    parser.add_argument("--unseen", type=int, default=2, help="clients that never train (0: none)")
    parser.add_argument("--rounds", type=int, default=None, help="default 50 (--quick: 10)")
    parser.add_argument("--local-epochs", type=int, default=None, help="default 2 (--quick: 1)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--momentum", type=float, default=None, help="local momentum (default: each config's)")
    parser.add_argument("--lr", type=float, default=None, help="one algo.lr for every method (implies --no-tune)")
    parser.add_argument("--no-tune", action="store_true", help="each method at its config's algo.lr")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once (default: the cores)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    parser.add_argument("--stored-only", action="store_true", help="the table from the runs in OUT/runs only")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (10 if args.quick else 50)
    args.local_epochs = args.local_epochs or (1 if args.quick else 2)
    methods = args.methods or list(METHODS)
    settings = args.settings or (QUICK_SETTINGS if args.quick else list(SETTINGS))
    seeds = args.seeds if args.seeds is not None else [0] if args.quick else list(SEEDS)
    tuning = not (args.quick or args.no_tune or args.lr is not None)
    out = Path(args.out) if args.out else OUT / "quick" if args.quick else OUT
    store = out / "runs"
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    start = time.time()

    def submit(pool, over: list[str]) -> Future:
        return pool.submit(stored_run, store, over, not args.stored_only, keep, True)

    with executor(args.jobs) as pool:  # first the tuning runs, all at once; then the reported seeds at the tuned lr
        trials = {
            (s, m, lr): submit(pool, [*budget(args, s), f"algo={METHODS[m]}", f"seed={TUNE_SEED}", f"algo.lr={lr}"])
            for s in settings
            for m in methods
            for lr in (GRID if tuning else ())
        }
        records = collect(trials)
        lrs: dict[tuple, float | None] = {}
        tuned: dict[str, dict] = {}
        for s in settings:
            for m in methods:
                if not tuning:
                    lrs[(s, m)] = args.lr if args.lr is not None else float(composed(f"algo={METHODS[m]}").algo.lr)
                    continue
                score = {lr: validation_score(records[(s, m, lr)]) for lr in GRID}
                try:  # the best validation score; failed runs rank last (-inf); ties: the smaller step (GRID ascends)
                    lrs[(s, m)], score = tune(GRID, score.__getitem__, maximize=True, name=f"{s} {m} lr")
                except RuntimeError as e:
                    print(e, flush=True)
                    lrs[(s, m)] = None
                tuned.setdefault(s, {})[m] = {"lr": lrs[(s, m)], "scores": score, "seed": TUNE_SEED}
        jobs = {
            (s, m, seed): submit(pool, [*budget(args, s), f"algo={METHODS[m]}", f"seed={seed}", f"algo.lr={lr}"])
            for s in settings
            for m in methods
            for seed in seeds
            if (lr := lrs[(s, m)]) is not None
        }
        runs = {key: None for key in ((s, m, seed) for s in settings for m in methods for seed in seeds)}
        runs |= collect(jobs)
    out.mkdir(parents=True, exist_ok=True)
    if tuned:
        save_tuned(out / "tuned.json", {"grid": list(GRID), "metric": "val headline, last-quarter mean"} | tuned)
    write(out, argv, args, settings, methods, seeds, lrs, runs, tuning, time.time() - start)


def write(out: Path, argv: list[str], args, settings, methods, seeds, lrs, runs, tuning: bool, wall: float) -> None:
    """``table.md``: per setting, the final and best-round test accuracy, the personalised accuracy, the unseen
    clients' (the global model on all their rows; the personalised models on their held-out rows, after the method's
    adaptation to a new client where it has one), mean ± std over the seeds; then side by side the global models'
    final accuracy and the personalised methods', each setting's best in bold, and NIID-Bench's findings.
    ``table.csv``: one row per run. ``accuracy.png``: test accuracy against rounds, seed mean, a panel per setting."""
    command = "python scripts/benchmark.py " + shlex.join(argv)
    how = f"step size tuned per setting over {list(GRID)} on seed {TUNE_SEED}" if tuning else "each config's algo.lr"
    lines = [
        f"Produced by `{command.strip()}`: {args.clients} clients (all every round) + {args.unseen} never trained, "
        f"{args.rounds} rounds x {args.local_epochs} local epochs at batch {args.batch_size}; seeds {seeds}, "
        f"mean ± std over seeds; {how}.",
        "",
    ]
    rows, finals, personals = [], {}, {}
    for s in settings:
        lines += [
            f"### {s}",
            "",
            "| method | lr | final test acc (%) | best-round test acc (%) | personalised acc (%) "
            "| unseen clients acc (%) | unseen clients, personalised (%) |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in methods:
            got = [runs[(s, m, seed)] for seed in seeds if runs[(s, m, seed)] is not None]
            final = [r["final"].get("test/acc", math.nan) for r in got]
            best = [max(v for _, v in r["curves"]["test/acc"]) for r in got if r["curves"].get("test/acc")]
            personal = [r["final"]["test/personal_acc_mean"] for r in got if "test/personal_acc_mean" in r["final"]]
            unseen = [r["final"]["unseen/acc"] for r in got if "unseen/acc" in r["final"]]  # the global model
            adapted = [r["final"][_UP] for r in got if _UP in r["final"]]  # its personalised models, held-out rows
            finals[(s, m)], personals[(s, m)] = final, personal
            cells = [mean_std(v, 100, 2) if v else "n/a" for v in (final, best, personal, unseen, adapted)]
            missing = len(seeds) - len(got)
            lr = "every grid value failed" if lrs[(s, m)] is None else f"{lrs[(s, m)]:g}"
            lines.append(f"| {m}{f' ({missing} failed)' if missing else ''} | {lr} | " + " | ".join(cells) + " |")
            for seed in seeds:
                if (r := runs[(s, m, seed)]) is not None:
                    f = r["final"]
                    got_row = [f.get("test/acc"), f.get("test/personal_acc_mean"), f.get("unseen/acc"), f.get(_UP)]
                    rows.append([s, m, seed, lrs[(s, m)], *got_row])
        lines.append("")
    # the methods that personalise are judged by their personalised models, the others by the global one
    personalising = [m for m in methods if any(personals[(s, m)] for s in settings)]
    shared = [m for m in methods if m not in personalising]
    lines += side_by_side("Global model: final test accuracy (%)", finals, settings, shared)
    lines += side_by_side("Personalised models: mean client accuracy (%)", personals, settings, personalising)
    lines += claims(finals, settings, shared)
    lines += [
        "",
        f"Wall time of this call: {wall:.0f} s (the runs it found in the store were not trained again)."
        if not args.stored_only
        else "Built from the stored runs (no training).",
        "",
    ]
    (out / "table.md").write_text("\n".join(lines))
    with open(out / "table.csv", "w", newline="") as f:
        csv.writer(f).writerows(
            [
                ["setting", "method", "seed", "lr", "test_acc", "personal_acc", "unseen_acc", "unseen_personal_acc"],
                *rows,
            ]
        )
    plot(out / "accuracy.png", settings, methods, seeds, runs, args)
    print((out / "table.md").read_text())


def side_by_side(title: str, values: dict[tuple, list[float]], settings: list[str], methods: list[str]) -> list[str]:
    """A table of ``values`` (mean ± std over seeds, in %), a row per method and a column per setting, each setting's
    best mean in bold."""
    if not methods:
        return []
    lines = [f"### {title}, side by side (each setting's best in bold)", ""]
    lines += ["| method | " + " | ".join(settings) + " |", "|---|" + "---|" * len(settings)]
    means = {k: statistics.mean(v) for k, v in values.items() if v}
    best = {s: max((means[(s, m)] for m in methods if (s, m) in means), default=math.nan) for s in settings}
    for m in methods:
        cells = [mean_std(values[(s, m)], 100, 2) if values[(s, m)] else "n/a" for s in settings]
        cells = [f"**{c}**" if means.get((s, m)) == best[s] else c for s, c in zip(settings, cells)]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return [*lines, ""]


LABEL_SKEW = ("Dir(0.1)", "Dir(0.5)", "#C=2")  # NIID-Bench's label skews: where SCAFFOLD gains (its Section 5.3)


def claims(finals: dict[tuple, list[float]], settings: list[str], methods: list[str]) -> list[str]:
    """NIID-Bench's two findings, as this sweep measured them on the global models (``methods``): which method is best
    in each setting (its finding: none wins everywhere) and SCAFFOLD against FedAvg under label skew (its finding:
    SCAFFOLD gains there); a difference is called a gain or a loss only when it exceeds the two methods' seed spreads
    added."""
    best = {}
    for s in settings:
        means = {m: statistics.mean(finals[(s, m)]) for m in methods if finals[(s, m)]}
        if means:
            best[s] = max(means, key=means.__getitem__)
    if not best:
        return []
    winners = sorted(set(best.values()))
    verdict = "no method is best in every setting" if len(winners) > 1 else f"{winners[0]} is best in every setting"
    out = ["### NIID-Bench's findings, measured here", "", "- Best global model's final test accuracy per setting: "]
    out[-1] += ", ".join(f"{s}: {m}" for s, m in best.items()) + f" ({verdict})."
    for s in (s for s in settings if s in LABEL_SKEW):
        a, b = finals.get((s, "FedAvg")), finals.get((s, "SCAFFOLD"))
        if not a or not b:
            continue
        diff = (statistics.mean(b) - statistics.mean(a)) * 100
        spread = sum(statistics.stdev(v) if len(v) > 1 else 0.0 for v in (a, b)) * 100
        word = "within the seeds' spread" if abs(diff) <= spread else "a gain" if diff > 0 else "a loss"
        out.append(f"- {s}: SCAFFOLD - FedAvg = {diff:+.2f} points ({word}; spreads added {spread:.2f}).")
    return out


def plot(path: Path, settings, methods, seeds, runs, args) -> None:
    """Test accuracy of the global model against rounds, the mean over seeds; a panel per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(settings), figsize=(4.6 * len(settings), 4.0), squeeze=False, sharey=True)
    colours = plt.get_cmap("tab20")
    for ax, s in zip(axes[0], settings):
        for i, m in enumerate(methods):
            curves = [
                dict(r["curves"]["test/acc"])
                for seed in seeds
                if (r := runs[(s, m, seed)]) and "test/acc" in r["curves"]
            ]
            if not curves:
                continue
            xs = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(
                xs, [statistics.mean(c[x] for c in curves) for x in xs], label=m, color=colours(i % 20), linewidth=1.1
            )
        ax.set_title(s, fontsize=10)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy (global model)")
    axes[0][-1].legend(fontsize=7, loc="lower right", ncol=2)
    fig.suptitle(
        f"{args.data or 'digits'}: {args.clients} clients, {args.rounds} rounds, mean over seeds {list(seeds)}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
