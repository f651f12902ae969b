"""Learning curves per round, saved as ``<output_dir>/curves.png`` (and ``curves.json``) when fit ends.

A plain Lightning callback: it reads the round-level metrics Lightning already computed, so it works with
any logger (or none) and costs nothing per client. With a simulated system (``system=mobile20``) it also records
``sim/clock`` (simulated seconds after each round) and plots the accuracy curves against it as a third panel.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

TRACKED = (
    "train/loss",
    "val/loss",
    "val/acc",
    "val/client_acc_mean",
    "val/client_acc_worst",
    "val/client_acc_std",
    "val/auroc",
    "val/pauc_0.3",
    "val/pauc_0.5",
    "train/client_loss_max",
    "train/client_loss_mean",
    # the test split per round, with eval_test=true
    "test/loss",
    "test/acc",
    "test/client_acc_mean",
    "test/client_acc_worst",
    "test/client_acc_std",
    "test/auroc",
    "test/pauc_0.3",
    "test/pauc_0.5",
    # regression (task=regression): the errors, plotted with the losses
    *(f"{split}/{key}" for split in ("val", "test") for key in ("mse", "rmse", "client_mse_mean", "client_mse_worst")),
    # composite objectives (flx.parts.measures.objective) and personalised models (pFedFBE and its baselines)
    "train/objective",
    "train/h",
    "train/personal_objective",
    "train/fbe_objective",
    "test/personal_objective",
    *(f"test/personal_{key}_mean" for key in ("acc", "mse")),
    # structure of the global and personalised models (flx.parts.measures.structure; logged in the validation loop)
    *(
        f"val/{p}{key}{s}"
        for p, s in (("", ""), ("personal_", "_mean"))
        for key in ("support_f1", "rank", "recovery_error")
    ),
    # simulated wall-clock (flx.systems, docs/systems.md): an x-axis, not a curve of the panels
    "sim/round_time",
    "sim/clock",
    # sub-network scheduling (flx.parts.systems.subnetwork, docs/whale.md): recorded for the reproduction's traces, not
    # plotted in the panels (counts and widths are not accuracies)
    "whale/width_mean",
    "whale/fi_mean",
    *(f"whale/level_{p}" for p in range(1, 9)),
    # differential privacy (flx.parts.privacy.central_dp, docs/privacy.md): the ledger, recorded, not plotted in the
    # panels
    "privacy/epsilon",
    "privacy/clip",
)
CLOCK = "sim/clock"
EVAL_ONLY = (
    "val/",
    "test/",
    "train/client_loss_",
)  # logged on validated rounds only: not recorded (stale) on the others


def record_round(
    history: dict[str, list[tuple[int, float]]], trainer: pl.Trainer, keys: Iterable[str], rnd: int | None = None
) -> None:
    """Appends ``(rnd, value)`` of each of ``keys`` in ``trainer.callback_metrics`` to ``history[key]``; ``rnd`` is the
    round the values belong to, 1-based (default ``current_epoch``: the last round done, between rounds). Call it once
    the round's training, validation and logging are done (:class:`RoundRecorder` says when). Evaluation keys
    (``EVAL_ONLY``) only on validated rounds (on the others they are stale), a round at most once per key."""
    rnd = trainer.current_epoch if rnd is None else rnd
    metrics, every = trainer.callback_metrics, trainer.check_val_every_n_epoch
    validated = every is None or rnd % every == 0
    for key in keys:
        points = history.setdefault(key, [])
        if key in metrics and (not points or points[-1][0] != rnd) and (validated or not key.startswith(EVAL_ONLY)):
            points.append((rnd, float(metrics[key])))


class RoundRecorder(pl.Callback):
    """A callback that keeps a per-round history of logged metrics in its ``state_dict`` (:class:`RoundCurves`,
    :class:`~flx.callbacks.line_plots.LinePlots`): when to record a round so that every checkpoint holds it.

    A round is complete (the module logs ``train/loss`` in its own ``on_train_epoch_end``, after the plain callbacks'
    epoch-end hooks) only once the checkpoint callbacks' epoch-end hooks run, and those write the round's checkpoint.
    So the round is recorded while its checkpoint is being written (:meth:`on_save_checkpoint`: the hooks of the
    checkpoint callbacks come after the module's, Lightning orders them last) and the state in the file is replaced
    by one that holds it; rounds with no checkpoint are recorded at the next round's start and at the end of
    training. A resumed run finds every round up to its checkpoint in the history, and the round-once rule of
    :func:`record_round` keeps each round once.
    """

    def _record(self, trainer: pl.Trainer, rnd: int) -> None:
        """Records round ``rnd`` (1-based) from ``trainer.callback_metrics``."""
        raise NotImplementedError

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > 0:  # the previous round is complete
            self._record(trainer, trainer.current_epoch)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer, trainer.current_epoch)

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # between a round's epoch-end hooks and its end (processed > completed) the round is logged: a checkpoint
        # written then is the round's (flx.callbacks.checkpoint); one written during validation is not recorded
        progress = trainer.fit_loop.epoch_progress.current
        if progress.processed > progress.completed and self.state_key in checkpoint.get("callbacks", {}):
            self._record(trainer, progress.processed)
            checkpoint["callbacks"][self.state_key] = self.state_dict()


class RoundCurves(RoundRecorder):
    """Collects ``TRACKED`` metrics at every round end and plots them against the round.

    Args:
        dirpath: where to write ``curves.png`` / ``curves.json`` (default: the trainer's root dir).
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.history: dict[str, list[tuple[int, float]]] = defaultdict(list)

    @override
    def _record(self, trainer: pl.Trainer, rnd: int) -> None:
        record_round(self.history, trainer, TRACKED, rnd)

    @override
    def state_dict(self) -> dict[str, Any]:
        """``keys``: the metrics with points; ``points``: one float64 ``(n, 3)`` tensor of ``(key index, round,
        value)`` rows. Pickling it is one object however many rounds ran; as lists of pairs, every point cost the round
        checkpoint three objects, a cost that grew with each round (and one tensor per key would cost one more each)."""
        keys = [k for k, points in self.history.items() if points]
        rows = [(i, r, v) for i, k in enumerate(keys) for r, v in self.history[k]]
        return {"keys": keys, "points": torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reads :meth:`state_dict`'s form and the ``{key: [(round, value), ...]}`` of older checkpoints."""
        self.history = defaultdict(list)
        if set(state_dict) == {"keys", "points"} and isinstance(state_dict["points"], Tensor):
            keys = state_dict["keys"]
            for i, r, v in state_dict["points"].tolist():
                self.history[keys[int(i)]].append((int(r), v))
            return
        for key, points in state_dict.items():
            self.history[key] = [(int(r), float(v)) for r, v in points]

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or not self.history or trainer.fast_dev_run:
            return
        folder = self.dirpath or trainer.default_root_dir
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "curves.json"), "w") as f:
            json.dump(self.history, f, indent=1)
        self._plot(os.path.join(folder, "curves.png"))

    def _plot(self, path: str) -> None:
        # matplotlib's object API with the Agg canvas, not pyplot: no global figure state or backend switch, and no
        # pyplot import (~0.2 s at the end of every run)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        clock = dict(self.history.get(CLOCK, []))  # round -> simulated seconds
        fig = Figure(figsize=(15 if clock else 10, 3.6))
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 3 if clock else 2)
        ax_loss, ax_acc = axes[:2]
        for key, points in self.history.items():
            if key.startswith(("sim/", "whale/", "privacy/")):
                continue
            is_loss = any(k in key for k in ("loss", "mse", "objective"))
            (ax_loss if is_loss else ax_acc).plot(*zip(*points), marker="o", markersize=2.5, label=key)
            timed = [(clock[r], v) for r, v in points if r in clock]
            if clock and not is_loss and timed:
                axes[2].plot(*zip(*timed), marker="o", markersize=2.5, label=key)
        panels = [(ax_loss, "loss", "round"), (ax_acc, "global model: accuracy / AUC", "round")]
        panels += [(axes[2], "against simulated wall-clock", "simulated time (s)")] if clock else []
        for ax, title, xlabel in panels:
            if xlabel == "round":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel(xlabel)
            ax.set_title(title)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
        # fixed margins: tight_layout measures every text extent with a full extra draw (~0.1 s)
        fig.subplots_adjust(left=0.06 if clock else 0.07, right=0.99, bottom=0.14, top=0.91, wspace=0.16)
        # zlib level 1: a mostly white plot compresses almost as well, and the encoder took ~1/10 of the drawing
        fig.savefig(path, dpi=120, pil_kwargs={"compress_level": 1})
