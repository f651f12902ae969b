"""Renders the W&B dashboard panels of offline runs as PNGs (docs/dashboards.md).

The W&B web UI needs a network; this script draws the same content from the run files the wandb library writes
(read back with :mod:`flx.wandb_files`, as the tests do): the per-round global metrics against ``fl/round``, the
last evaluation round's per-client table as a bar chart, and every ``wandb.plot.line_series`` chart of the run
(DRFA's ``lambda/plot``, ``plots/auc``, ``plots/personal_vs_global``).

    python scripts/dashboards.py                          # trains the three example runs offline, then draws
    python scripts/dashboards.py --runs <output_dir> ...  # draws existing runs (an output dir or offline-run-*)

Output: ``<out>/<run name>_<panel>.png`` (default ``docs/results/dashboards``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flx.wandb_files import OfflineRun, load_run  # noqa: E402

ROUND = "fl/round"
QUIET = ["trainer.enable_progress_bar=false", "callbacks.progress_bar=null", "trainer.accelerator=cpu"]
# the example runs: one per kind of chart (each with the per-round metrics and the per-client tables)
EXAMPLES = {
    "fedxl": [
        "algo=fedxl1",
        "data=digits_binary",
        "partition=iid",
        "partition.num_clients=10",
        "algo.clients_per_round=5",
    ],
    "drfa": ["algo=drfa", "partition.num_clients=10", "algo.clients_per_round=5"],
    "pfedfbe": [
        "algo=pfedfbe",
        "partition.num_clients=10",
        "partition.test_fraction=0.3",
        "algo.lr=0.02",
        "algo.lam=50",
    ],
}
GLOBAL_PANELS = {
    "loss": ["train/loss", "val/loss"],
    "accuracy / AUC": ["val/acc", "val/client_acc_mean", "val/client_acc_worst", "val/auroc", "val/pauc_0.3"],
}


def train_examples(workdir: Path, rounds: int) -> list[Path]:
    """Trains :data:`EXAMPLES` offline (``logger=[csv,wandb]``) into ``workdir/<name>``; returns the folders."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_X_DISABLE_STATS", "true")
    from flx.config import precheck
    from flx.run import train

    folders = []
    for name, overrides in EXAMPLES.items():
        out = workdir / name
        args = [*overrides, *QUIET, f"algo.rounds={rounds}", "logger=[csv,wandb]", f"paths.output_dir={out}"]
        print(f"training {name}: {' '.join(overrides)}", flush=True)
        train(precheck(args))
        folders.append(out)
    return folders


def _axes(title: str, ncols: int = 1, width: float = 6.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, 3.6), squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, list(axes[0])


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if hasattr(ax.yaxis.get_major_formatter(), "set_useOffset"):
            ax.yaxis.get_major_formatter().set_useOffset(False)
        if ax.get_xlabel() == "round":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


def draw_metrics(run: OfflineRun, path: Path) -> None:
    """The per-round global metrics, each panel a set of keys against ``fl/round`` (W&B's line charts)."""
    fig, axes = _axes(f"{run.name}: per-round metrics (x-axis {ROUND})", ncols=len(GLOBAL_PANELS))
    for ax, (title, keys) in zip(axes, GLOBAL_PANELS.items()):
        for key in keys:
            points = run.series(key)
            if points:
                ax.plot(*zip(*points), marker="o", markersize=2.5, label=key)
        ax.set(title=title, xlabel="round")
    _save(fig, path)


def draw_clients(run: OfflineRun, key: str, path: Path) -> None:
    """The last per-client table logged as ``key``: each client's accuracy (bars, the sampled ones dark), its loss and
    evaluation rows on the right axis."""
    row, table = run.tables(key)[-1]
    metric = next(c for c in table[0] if c not in ("client", "loss", "samples", "train_samples", "sampled"))
    fig, (ax,) = _axes(f"{run.name}: {key} at round {int(row[ROUND])}", width=8.0)
    clients = [t["client"] for t in table]
    colours = ["tab:blue" if t["sampled"] else "lightsteelblue" for t in table]
    ax.bar(clients, [t[metric] for t in table], color=colours)
    ax.set(xlabel="client (dark: sampled this round)", ylabel=metric, xticks=clients)
    if "loss" in table[0]:
        twin = ax.twinx()
        twin.plot(clients, [t["loss"] for t in table], "o-", color="tab:red", markersize=3, label="loss")
        twin.set_ylabel("loss", color="tab:red")
        for c, t in zip(clients, table):
            ax.annotate(str(t["samples"]), (c, 0), ha="center", va="bottom", fontsize=7, color="white")
    _save(fig, path)


def line_series_keys(run: OfflineRun) -> list[str]:
    """The run's ``wandb.plot.line_series`` charts: W&B's panel specs in ``config._wandb.visualize``."""
    panels = run.config.get("_wandb", {}).get("visualize", {})
    return [k for k, v in panels.items() if "lineseries" in v.get("panel_config", {}).get("panelDefId", "")]


def draw_line_series(run: OfflineRun, key: str, path: Path) -> None:
    """A line-series chart from its table (columns ``lineKey``, ``lineVal``, ``step``), as W&B draws it."""
    spec = run.config["_wandb"]["visualize"][key]["panel_config"]["stringSettings"]
    _, rows = run.tables(f"{key}_table")[-1]
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        lines.setdefault(r["lineKey"], []).append((r["step"], r["lineVal"]))
    fig, (ax,) = _axes(f"{run.name}: {key}", width=7.0)
    for name, points in lines.items():
        style = {"linewidth": 2.2, "color": "black" if name == "max" else "grey"} if name in ("max", "min") else {}
        ax.plot(*zip(*points), marker="o", markersize=2, label=name, **style)
    ax.set(title=spec.get("title", key), xlabel=spec.get("xname", "round"))
    if len(lines) > 8:  # lambda per client: the legend names only the max and min
        for line in ax.lines:
            line.set_label(line.get_label() if line.get_label() in ("max", "min") else "_")
    _save(fig, path)


def draw(run_dir: Path, out: Path) -> None:
    run = load_run(run_dir)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", run.name)
    draw_metrics(run, out / f"{stem}_metrics.png")
    for key in ("val/client_acc_table", "val/client_personal_acc_table"):
        if run.tables(key):
            draw_clients(run, key, out / f"{stem}_{key.replace('/', '_')}.png")
    for key in line_series_keys(run):
        draw_line_series(run, key, out / f"{stem}_{key.replace('/', '_')}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="*", type=Path, help="run folders to draw (default: train the examples)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/flx-dashboards"), help="where examples train")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of each example run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "dashboards")
    args = parser.parse_args()
    runs = args.runs or train_examples(args.workdir, args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    for run_dir in runs:
        draw(run_dir, args.out)


if __name__ == "__main__":
    main()
