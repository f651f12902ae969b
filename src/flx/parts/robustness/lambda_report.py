"""What DRFA's lambda sampling reports beside the model: ``lambda/<i>`` every round, and at the end of the fit
``lambda.json`` (lambda after every round) and, with W&B, the line plot ``lambda/plot``.

The values are :class:`flx.parts.robustness.lambda_sampling.LambdaSampling`'s (``lam``, ``history``: lambda after each
round); these functions only show them.
"""

from __future__ import annotations

import json
import os

import lightning.pytorch as pl
from torch import Tensor

from flx.metrics.dtype import logged_dtype
from flx.wandb_logging import log_line_series

MAX_LOGGED_CLIENTS = 100  # lambda/<i> is logged per client up to this many clients (lambda/max always)
MAX_PLOTTED_CLIENTS = 20  # W&B's lambda/plot: a line per client for the first this many, and the max and min


def log_lambda(trainer: pl.Trainer, pl_module: pl.LightningModule, lam: Tensor) -> None:
    """``lambda/max``, ``lambda/min`` and, up to :data:`MAX_LOGGED_CLIENTS` clients, ``lambda/<i>`` at this round, in
    the run's logged dtype (float64 in a float64 run)."""
    lam = lam.to(logged_dtype(trainer))
    values = {"lambda/max": lam.max(), "lambda/min": lam.min()}
    if len(lam) <= MAX_LOGGED_CLIENTS:
        values |= {f"lambda/{i}": v for i, v in enumerate(lam)}
    pl_module.log_dict(values, on_epoch=True)


def write_history(trainer: pl.Trainer, history: list[list[float]]) -> None:
    """``lambda.json`` next to ``curves.json`` (``{"round_end": history}``) and, with W&B, ``lambda/plot``: a line per
    client for the first :data:`MAX_PLOTTED_CLIENTS`, and the max and min over the clients."""
    os.makedirs(trainer.default_root_dir, exist_ok=True)
    with open(os.path.join(trainer.default_root_dir, "lambda.json"), "w") as f:
        json.dump({"round_end": history}, f)
    rounds = range(1, len(history) + 1)
    series = {f"lambda_{i}": list(zip(rounds, col)) for i, col in enumerate(zip(*history))}
    shown = dict(list(series.items())[:MAX_PLOTTED_CLIENTS])
    shown |= {"max": [(r, max(row)) for r, row in zip(rounds, history)]}
    shown |= {"min": [(r, min(row)) for r, row in zip(rounds, history)]}
    log_line_series(trainer, "lambda/plot", shown, "lambda per client over rounds")
