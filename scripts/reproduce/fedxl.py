"""Reproduce the shape of FeDXL's Tables 2-3 (Guo et al., ICML 2023) on the embedded data.

    .venv/bin/python scripts/reproduce/fedxl.py            # digits made binary (data=digits_binary), 3 seeds
    .venv/bin/python scripts/reproduce/fedxl.py --quick    # 1 seed, few rounds (smoke)
    .venv/bin/python scripts/reproduce/fedxl.py --data chestmnist --rounds 625 --out results/chestmnist
                                                           # the paper's data (files under data/), 20k iterations
    .venv/bin/python scripts/reproduce/fedxl.py --tune     # every method's step size (and lambda) tuned first

Protocol (paper Sec. 4; the experiments ``fedxl2_digits`` (Table 2) and ``fedxl1_digits`` (Table 3) hold it, every
method runs in its table's): N=16 clients (stratified shards) with per-client input noise
N(-0.08 + 0.01 i, 0.2^2), K=32 local steps, B1=B2=32, the same seeds for every method; the data, their split and
the partition are fixed (``data.split_seed``, ``partition.seed``), the seeds vary initialisation and sampling. As
the paper (its Sec. 4 and Table 5), 20% of the training rows are held out for validation (``data.val_fraction=0.2``,
carved before the 1:5 subsample and the label flips, so the validation labels are clean) and the round that is best
on validation is tested (``test_on=best``); the paper does not say which validation metric selects, so each table
selects on its own metric (``checkpoint.monitor``: val/pauc_0.3, val/auroc). ChestMNIST's own validation split is not
read: 20% of its training split is carved instead. Table 2: partial-AUC
(KL-OPAUC) methods, test pAUC at FPR <= 0.3 / 0.5. Table 3: AUROC under 20% label flips (PSM for the pairwise
methods, AUC-M for CODASCA). CODASCA's stage length is a fifth of the run (the authors' 4000 of 20000 iterations).

Hyper-parameters. The paper (Sec. 4) tunes every algorithm's initial step size "in [1e-3, 1] using grid search" and
KL-OPAUC's lambda "in [1:5]", selecting models on the validation set; it gives neither the grid nor the values. With
``--tune`` each method's ``algo.lr`` is searched over ``TUNE_LR`` (a half-decade grid of [1e-3, 1]) on a seed of its
own (``common.TUNE_SEED``, none of the reported seeds), scored by the best value over rounds of its table's
validation metric (the round ``test_on=best`` would test), and then, for the KL-OPAUC methods of Table 2, ``algo.lam``
over ``TUNE_LAM`` at the selected step size (``tuned.json`` keeps every candidate's score). Without it every method
runs at its config's defaults. Either way the step size is constant: the paper's decay by 0.1 every 5K of its 20K
iterations is not applied (flx has no step-size schedule over rounds), and Centralized's batch sizes B1 = B2 = 32 are
not searched (the paper tunes them over {32, ..., 512}). Each table's header line says how the values were chosen,
and its columns give the step size (and lambda) every row ran at.

Writes `docs/results/fedxl/{table2,table3}.{md,csv}` and `docs/results/fedxl/convergence.png` (and `tuned.json`).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))  # flx, for the experiments' values
from common import TUNE_SEED, composed, save_tuned, tune  # noqa: E402

OUT = ROOT / "docs" / "results" / "fedxl"
COMMAND = "python scripts/reproduce/fedxl.py"  # set by main(): the command line printed above each table
# the tables' settings: the protocol and the table's metric (checkpoint.monitor), configs/experiment/<name>.yaml
EXPERIMENTS = {"table2": "fedxl2_digits", "table3": "fedxl1_digits"}
DATA = {  # --data: the experiments' embedded digits, and the paper's datasets where their files are present
    "digits": [],
    # the experiments' digits-only choice (positive classes 3, 5, 8) is dropped: the loader's own default (null:
    # classes 0-4 positive, 1:5, LibAUC style) or, for ChestMNIST (label Mass, column 4), no such key
    "cifar10": ["data=cifar10_binary", "model=resnet18", "data.loader.positive=null"],
    "cifar100": ["data=cifar100_binary", "model=resnet18", "data.loader.positive=null"],
    "chestmnist": ["data=chestmnist", "model=resnet18", "~data.loader.positive"],
}
BASE = ["logger=none", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu", "num_threads=1"]
TABLE2 = {  # method -> overrides (pAUC task, KL-OPAUC loss for the X-risk methods)
    "FeDXL2": ["algo=fedxl2"],
    "Local Pair": ["algo=fedxl_localpair"],
    "Local SGD (CE)": [
        "algo=fedavg",
        "algo.clients_per_round=${partition.num_clients}",
        "algo.batch_size=64",
        "algo.weighting=uniform",
    ],
    "CODASCA": ["algo=codasca"],  # + algo.t0, set from the run length in main()
    "Centralized": ["algo=fedxl_localpair", "partition.num_clients=1", "algo.clients_per_round=1"],
}
TABLE3 = {  # AUROC with 20% flipped training labels, symmetric PSM loss for the pairwise methods
    "FeDXL1": ["algo=fedxl1"],
    "Local Pair": [
        "algo=fedxl_localpair",
        "algo.loss=psm",
        "algo.beta=1.0",
        "algo.parts.passive_buffer.compositional=false",
    ],
    "Local SGD (CE)": TABLE2["Local SGD (CE)"],
    "CODASCA": TABLE2["CODASCA"],
    "Centralized": [
        "algo=fedxl_localpair",
        "algo.loss=psm",
        "algo.beta=1.0",
        "algo.parts.passive_buffer.compositional=false",
        "partition.num_clients=1",
        "algo.clients_per_round=1",
    ],
}


def setting(name: str) -> Any:
    """The composed experiment of the table ``name`` (``table2``, ``table3``)."""
    return composed(f"experiment={EXPERIMENTS[name]}")


def run(overrides: list[str], seed: int, rounds: int) -> tuple[dict[str, float], dict]:
    from flx.config import precheck
    from flx.run import train

    with tempfile.TemporaryDirectory() as out:
        cfg = precheck([*BASE, *overrides, f"seed={seed}", f"algo.rounds={rounds}", f"paths.output_dir={out}"])
        metrics = train(cfg)
        curves = json.loads((Path(out) / "curves.json").read_text())
    return metrics, curves


# --tune: each method's initial step size over a half-decade grid of the paper's [1e-3, 1] (Sec. 4; it gives no grid
# points), then KL-OPAUC's lambda over the paper's [1:5] at that step size
TUNE_LR = (1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)
TUNE_LAM = (1.0, 2.0, 3.0, 4.0, 5.0)
KL_OPAUC = ("FeDXL2", "Local Pair", "Centralized")  # Table 2's methods on the KL-OPAUC loss (lambda applies)


def defaults(overrides: list[str], extra: list[str]) -> dict[str, float]:
    """The step size (and, for a KL-OPAUC method, lambda) a run with ``overrides`` takes from its config."""
    from flx.config import precheck

    cfg = precheck([*BASE, *overrides, *extra, "paths.output_dir=/tmp/flx_fedxl_defaults"])
    return {"lr": float(cfg.algo.lr), **({"lam": float(cfg.algo.lam)} if "lam" in cfg.algo else {})}


def best_val(curves: dict, metric: str) -> float:
    """The best (highest) validation value of ``metric`` over the rounds: what ``test_on=best`` tests; nan if none."""
    values = [v for _, v in curves.get(metric, [])]
    return max(values) if values else math.nan


def tune_method(
    name: str, method: str, overrides: list[str], extra: list[str], metric: str, rounds: int
) -> dict[str, float]:
    """The method's step size (then lambda, for KL-OPAUC) with the best validation ``metric`` on :data:`TUNE_SEED`;
    returns the chosen values and records every candidate's score in :data:`TUNED`."""

    def score(values: list[str]) -> float:
        metrics, curve = run([*overrides, *extra, *values], TUNE_SEED, rounds)
        value = best_val(curve, metric)
        print(f"  tune [{name}] {method} {' '.join(values)}: best {metric}={value:.4f}", flush=True)
        return value

    lr, lr_scores = tune(TUNE_LR, lambda v: score([f"algo.lr={v:g}"]), maximize=True)
    chosen, record = {"lr": lr}, {"lr": lr, "scores": {f"{v:g}": x for v, x in lr_scores.items()}}
    if name == "table2" and method in KL_OPAUC:
        lam, lam_scores = tune(TUNE_LAM, lambda v: score([f"algo.lr={lr:g}", f"algo.lam={v:g}"]), True, "lambda")
        chosen["lam"] = lam
        record.update(lam=lam, lam_scores={f"{v:g}": x for v, x in lam_scores.items()})
    record.update(seed=TUNE_SEED, rounds=rounds, metric=f"best {metric} over rounds")
    TUNED.setdefault(name, {})[method] = record
    return chosen


TUNED: dict[str, dict] = {}
"""What ``--tune`` searched: ``{table: {method: {"lr", "scores", ["lam", "lam_scores"], "seed", "rounds",
"metric"}}}``, written to ``tuned.json``."""


def table(
    name: str,
    methods: dict[str, list[str]],
    extra: list[str],
    metric: str,
    keys: list[str],
    seeds: list[int],
    rounds: int,
    tuned: bool = False,
) -> dict[str, list]:
    """Runs every method of ``methods`` (at its tuned values with ``tuned``, else its config's) on ``seeds`` with the
    overrides ``extra`` (the table's experiment), tests the round that is best on ``metric`` (the experiment's
    ``checkpoint.monitor``: the paper's model selection) and writes the table ``name``; returns seed 0's curves."""
    rows, curves = [], {}
    for method, overrides in methods.items():
        chosen = tune_method(name, method, overrides, extra, metric, rounds) if tuned else defaults(overrides, extra)
        hp = [f"algo.{k}={v:g}" for k, v in chosen.items()]
        results = []
        for seed in seeds:
            metrics, curve = run([*overrides, *extra, *hp], seed, rounds)
            results.append(metrics)
            curves.setdefault(method, curve)
            print(f"[{name}] {method} seed={seed}: " + ", ".join(f"{k}={metrics[k]:.4f}" for k in keys), flush=True)
        lam = [f"{chosen['lam']:g}" if method in KL_OPAUC else "-"] if name == "table2" else []
        rows.append([method, f"{chosen['lr']:g}", *lam] + [_mean_std([r[k] for r in results]) for k in keys])
    lam_head = ["lambda"] if name == "table2" else []
    _write(name, ["method", "step size", *lam_head, *keys], rows, _how(tuned, metric, name), seeds)
    return curves


def _pick(methods: dict[str, list[str]], names: list[str] | None) -> dict[str, list[str]]:
    return {m: o for m, o in methods.items() if names is None or m in names}


def _how(tuned: bool, metric: str, name: str) -> str:
    """How the table's hyper-parameters were chosen, for its header line."""
    if not tuned:
        return "not tuned: every method at its config's default step size and lambda (the columns), constant"
    lam = f", then KL-OPAUC's lambda over {list(TUNE_LAM)} at it" if name == "table2" else ""
    return (
        f"each method's step size tuned over {list(TUNE_LR)}{lam}, on seed {TUNE_SEED} by the best {metric} over "
        "rounds (tuned.json); constant, no decay"
    )


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {std:.4f}"


def _write(name: str, header: list[str], rows: list[list[str]], how: str, seeds: list[int]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / f"{name}.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    lines = [f"Produced by `{COMMAND}` (seeds {seeds}; mean ± std over seeds; {how}).", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")


def plot(curves: dict[str, dict], key: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for method, curve in curves.items():
        if key in curve:
            ax.plot(*zip(*curve[key]), marker="o", markersize=2.5, label=method)
    ax.set_xlabel("round (K=32 local steps)")
    ax.set_ylabel(f"test {key.split('/')[1]} (seed 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    global OUT, COMMAND  # the tables and the plot go here (the docs folder unless --out)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="*", default=None, help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--tables", nargs="*", choices=["table2", "table3"], default=["table2", "table3"])
    parser.add_argument("--methods", nargs="*", choices=list({**TABLE2, **TABLE3}), default=None, help="default: all")
    parser.add_argument("--out", default=None, help="folder for the tables and the plot")
    parser.add_argument("--data", choices=sorted(DATA), default="digits", help="dataset (default: embedded digits)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    parser.add_argument(
        "--tune",
        action="store_true",
        help=f"tune each method's algo.lr over {TUNE_LR} (KL-OPAUC's algo.lam over {TUNE_LAM}) on seed {TUNE_SEED}",
    )
    args = parser.parse_args(argv)
    BASE[:0] = DATA[args.data]
    BASE.extend(args.set)
    OUT = Path(args.out) if args.out else OUT
    COMMAND = shlex.join(["python", "scripts/reproduce/fedxl.py", *argv])
    seeds, rounds = ([0], 3) if args.quick else ([0, 1, 2], setting("table2").algo.rounds)  # both tables': 15
    seeds = args.seeds if args.seeds is not None else seeds
    rounds = args.rounds or rounds
    TABLE2["CODASCA"].append(f"algo.t0={max(1, rounds * 32 // 5)}")  # 5 stages, as 20000 / 4000 in the code
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    if "table2" in args.tables:
        keys2 = ["test/pauc_0.3", "test/pauc_0.5"]
        exp, metric = [f"experiment={EXPERIMENTS['table2']}"], setting("table2").checkpoint.monitor
        curves = table("table2", _pick(TABLE2, args.methods), exp, metric, keys2, seeds, rounds, args.tune)
        plot(curves, "test/pauc_0.3", OUT / "convergence.png")
    if "table3" in args.tables:
        exp, metric = [f"experiment={EXPERIMENTS['table3']}"], setting("table3").checkpoint.monitor
        table("table3", _pick(TABLE3, args.methods), exp, metric, ["test/auroc"], seeds, rounds, args.tune)
    if TUNED:
        save_tuned(OUT / "tuned.json", TUNED)
    print(*((OUT / f"{t}.md").read_text() for t in args.tables), sep="\n")


if __name__ == "__main__":
    main(sys.argv[1:])
