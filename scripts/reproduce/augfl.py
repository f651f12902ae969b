"""Reproduce AugFL's comparison (Table II shape: baselines, AugFL without and with the PM; Section VI).

    .venv/bin/python scripts/reproduce/augfl.py                       # embedded digits, 3 seeds, 100 rounds
    .venv/bin/python scripts/reproduce/augfl.py --quick               # 1 seed, 3 rounds (smoke)
    .venv/bin/python scripts/reproduce/augfl.py --settings cifar10 --rounds 300   # needs the CIFAR-10 files

Protocol (the paper's §VI-A and Table I): few-shot clients (``partition=few_shot``: 2 random classes a client,
``D_i ~ U(M, 2M)``, 50/50 support/query, 20% of the clients held out), every training client every round, alpha =
0.03, rho = 0.7, lambda = 5, delta_t = 1/(10t + 100); the metric is the held-out clients' accuracy on their query sets
after one SGD step of alpha on their support sets (``test/personal_acc_mean``), measured on the final model. The PM
is trained on the server split (``data.server_fraction`` = 0.2, rows no client holds) at the start of each AugFL run.

Settings (``--settings``), each an experiment that holds its protocol and AugFL's values (``augfl_digits``,
``augfl_cifar10``, ``augfl_cifar100`` in configs/experiment/; every method runs in it, the PM AugFL w/ PM's alone):
``digits`` (the embedded 8x8 digits, 50 clients, M = 10: the paper's M = 20 needs more rows
than digits has; client MLP [200, 200], PM MLP [512, 512]: ResNet8x4 costs ~9 s a round on this 2-core CPU), and
``cifar10`` / ``cifar100`` (the paper's nets, ResNet8x4 client and ResNet32x4 PM; 50 / 100 clients, M = 20; skipped
with a message when the files are not under ``paths.data_dir``). Methods: FedAvg (the global model, no adaptation),
FedAvg + FT (one step of alpha on the support set), Per-FedAvg (FO) and (HF), AugFL without PM (lambda = 0), AugFL
with PM. Seeds vary the initial model and the partition's clients (``partition.seed``); the data split is fixed.

Hyper-parameters: no ``--tune``. The paper gives AugFL's values (Sec. VI-A and Table I: alpha 0.03, rho 0.7,
lambda 5, the last chosen from its Fig. 8 sweep as "consistently" good) and says nothing about how its baselines'
step sizes were chosen, nor that it tuned them; its values are used as given, and the baselines run untuned at AugFL's
alpha (FedAvg's local step and fine-tuning step 0.03, Per-FedAvg's beta = alpha = 0.03, 5 local steps). The table's
header line says so, and its "step sizes" column gives every row's values (read from the composed config).

Writes ``docs/results/augfl/{table.md,table.csv,<setting>.png}``.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))  # flx, for the experiments' values
from common import QUIET_CPU, composed, data_available, mean_std, own, plot_curves  # noqa: E402

OUT = ROOT / "docs" / "results" / "augfl"
BASE = [*QUIET_CPU]
# setting -> (label, the experiment that holds its protocol and AugFL's values, configs/experiment/<name>.yaml)
SETTINGS = {
    "digits": ("digits (embedded 8x8), 50 clients, M = 10", "augfl_digits"),
    "cifar10": ("CIFAR-10, 50 clients, M = 20", "augfl_cifar10"),
    "cifar100": ("CIFAR-100, 100 clients, M = 20", "augfl_cifar100"),
}
PM_KEYS = ["pm_model", "pm_pretrain"]  # the experiments' PM: AugFL w/ PM's alone, the other rows take their own
METHODS = {  # name -> overrides (in the setting's experiment)
    "FedAvg": ["algo=fedavg_ft", "algo.adapt_steps=0", *own("fedavg_ft", PM_KEYS)],
    "FedAvg + FT": ["algo=fedavg_ft", *own("fedavg_ft", PM_KEYS)],
    "Per-FedAvg (FO)": ["algo=per_fedavg", "algo.hessian=none", *own("per_fedavg", PM_KEYS)],
    "Per-FedAvg (HF)": ["algo=per_fedavg", "algo.hessian=fd", *own("per_fedavg", PM_KEYS)],
    "AugFL w/o PM": ["algo=augfl", "algo.lam=0", *own("augfl", PM_KEYS)],
    "AugFL w/ PM": ["algo=augfl"],
}
STEP_KEYS = {  # algo name -> (label, algo key) of the step sizes and weights the table names for its rows
    "fedavg_ft": (("lr", "lr"), ("adapt", "adapt_lr")),
    "per_fedavg": (("beta", "lr"), ("alpha", "alpha")),
    "augfl": (("alpha", "alpha"), ("rho", "rho"), ("lambda", "lam")),
}
HOW = (
    "hyper-parameters not tuned: AugFL at the paper's Table I values, the baselines (whose settings the paper does "
    "not give) at AugFL's alpha; the step sizes column"
)
COLUMNS = [
    ("held-out acc, 1 step (%)", "test/personal_acc_mean"),
    ("held-out worst client (%)", "test/personal_acc_worst"),
    ("global model, test split (%)", "test/acc"),
]


def run(args: list[str], seed: int, rounds: int, every: int) -> tuple[dict, dict]:
    from flx.config import precheck
    from flx.run import train

    with tempfile.TemporaryDirectory() as out:
        over = [*BASE, *args, f"seed={seed}", f"algo.rounds={rounds}", f"eval_every={every}", f"paths.output_dir={out}"]
        final = train(precheck(over))
        curves = json.loads((Path(out) / "curves.json").read_text())
    return final, curves


def step_sizes(args: list[str]) -> str:
    """The step sizes (and AugFL's rho, lambda) a run with ``args`` takes from its config, e.g. ``lr 0.03, adapt 0``
    (``adapt`` is 0 when the held-out clients are not adapted)."""
    from flx.config import precheck

    algo = precheck([*BASE, *args, "paths.output_dir=/tmp/flx_augfl_step_sizes"]).algo
    values = {label: float(algo[key]) for label, key in STEP_KEYS.get(algo.name, (("lr", "lr"),))}
    if algo.name == "fedavg_ft" and algo.adapt_steps == 0:
        values["adapt"] = 0.0
    return ", ".join(f"{label} {v:g}" for label, v in values.items())


def available(setting: str) -> bool:
    return data_available(setting, [*BASE, f"experiment={SETTINGS[setting][1]}"])


def main(argv: list[str]) -> None:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--settings", nargs="*", choices=sorted(SETTINGS), default=["digits"])
    parser.add_argument("--methods", nargs="*", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra overrides for every run")
    args = parser.parse_args(argv)
    OUT = Path(args.out) if args.out else OUT
    seeds = args.seeds if args.seeds is not None else [0] if args.quick else [0, 1, 2]
    sys.path.insert(0, str(ROOT / "src"))
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    command = "python scripts/reproduce/augfl.py " + shlex.join(argv)  # quoted: runnable as printed
    lines = [f"Produced by `{command.strip()}` (seeds {seeds}; mean ± std over seeds, in %; {HOW}).", ""]
    rows_csv = []
    OUT.mkdir(parents=True, exist_ok=True)
    for setting in args.settings:
        if not available(setting):
            continue
        label, name = SETTINGS[setting]
        protocol = composed(f"experiment={name}")
        rounds = args.rounds or (3 if args.quick else protocol.algo.rounds)
        every = min(protocol.eval_every, rounds)
        table, curves = [], {}
        for method in args.methods:
            results = []
            over = [f"experiment={name}", *METHODS[method], *args.set]
            steps = step_sizes(over)
            for seed in seeds:
                final, curve = run(over, seed, rounds, every)
                results.append(final)
                curves.setdefault(method, curve)
                acc = final.get("test/personal_acc_mean", math.nan)
                print(f"{setting} {method} seed={seed}: held-out acc {acc:.4f}", flush=True)
            cells = [mean_std([r.get(key, math.nan) for r in results], 100, 2) for _, key in COLUMNS]
            table.append([method, steps, *cells])
            rows_csv.append([setting, method, rounds, len(seeds), steps, *cells])
        head = "| method | step sizes | " + " | ".join(h for h, _ in COLUMNS) + " |"
        lines += [f"### {label}, {rounds} rounds", "", head]
        lines += ["|" + "---|" * (len(COLUMNS) + 2), *("| " + " | ".join(r) + " |" for r in table), ""]
        plot_curves(OUT / f"{setting}.png", label, curves, ("test/personal_acc_mean", "train/loss"))
    (OUT / "table.md").write_text("\n".join(lines))
    with open(OUT / "table.csv", "w", newline="") as f:
        head = ["setting", "method", "rounds", "seeds", "step sizes", *(h for h, _ in COLUMNS)]
        csv.writer(f).writerows([head, *rows_csv])
    print((OUT / "table.md").read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
