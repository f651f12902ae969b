"""What WHALE-FL's sub-network scheduling reports beside its metrics: the per-round level and Fisher histograms on
W&B, and at the end of the fit ``whale.json`` (every round's level and Fisher value per client, with the simulated
clock), the W&B table ``whale/history`` and a line plot of the Fisher trace, one line per client against the clock.

The history is :class:`flx.parts.systems.subnetwork.Subnetwork`'s (``history``: one entry per round, ``round`` 1-based,
``clock``, ``level`` and ``fi`` by client); these functions only show it (docs/whale.md).
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl

from flx.parts.systems import whale_utility as wu
from flx.wandb_logging import ROUND, log_line_series, log_wandb, wandb_loggers

MAX_PLOTTED_CLIENTS = 20  # W&B's whale/fisher_trace: a line per client for the first this many (the table has all)


def log_histograms(trainer: pl.Trainer, last: dict[str, Any], levels: int) -> None:
    """The round's level histogram (and Fisher histogram, when the round has Fisher values) on W&B, at this round
    (1-based: the charts' x-axis); nothing without a W&B logger."""
    if not wandb_loggers(trainer):
        return
    import wandb

    hists: dict[str, wandb.Histogram | float] = {
        "whale/level_hist": wandb.Histogram(list(last["level"].values()), num_bins=levels)
    }
    if last["fi"]:
        hists["whale/fi_hist"] = wandb.Histogram(list(last["fi"].values()))
    hists[ROUND] = float(trainer.current_epoch + 1)
    log_wandb(trainer, hists)


def write_history(trainer: pl.Trainer, history: list[dict[str, Any]], system: Any, s: float) -> None:
    """``whale.json`` next to ``curves.json``; with W&B, the table ``whale/history`` (a row per round and client:
    its device type from ``system``, level, width ``s^(level-1)`` and Fisher value) and the Fisher trace."""
    os.makedirs(trainer.default_root_dir, exist_ok=True)
    with open(os.path.join(trainer.default_root_dir, "whale.json"), "w") as f:
        json.dump({"rounds": history}, f)
    if not wandb_loggers(trainer):
        return
    import wandb

    table = wandb.Table(columns=["round", "sim_clock", "client", "device", "level", "width", "fisher"])
    for h in history:
        for cid, lvl in h["level"].items():
            device = system.device_type(cid) if system is not None else ""
            table.add_data(h["round"], h["clock"], cid, device, lvl, wu.width(lvl, s), h["fi"].get(cid))
    log_wandb(trainer, {"whale/history": table})
    log_line_series(trainer, "whale/fisher_trace", fisher_trace(history), "Fisher trace per client", "sim_clock")


def fisher_trace(history: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """``{"client <i>": [(clock, sqrt(mean FI^2)), ...]}``: each client's Fisher value at the simulated clock of
    every round it trained in, for the first :data:`MAX_PLOTTED_CLIENTS` clients that have one."""
    clients = sorted({cid for h in history for cid in h["fi"]})[:MAX_PLOTTED_CLIENTS]
    return {f"client {c}": [(h["clock"], h["fi"][c]) for h in history if c in h["fi"]] for c in clients}
