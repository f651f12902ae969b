"""W&B: the run's description (config, code version, x-axis), the helpers the parts log through, the finish.

``logger=wandb`` builds :class:`WandbLogger`, Lightning's ``WandbLogger`` that, when its run starts (global rank zero
only; Lightning creates it there):

- stores the whole resolved Hydra config as the run config (nested: W&B filters and groups by ``algo.lr``,
  ``data.name``, ``seed``), plus ``code.flx_version``, ``code.git_commit`` and ``code.git_dirty`` (a git checkout
  only); ``flx.run.build_trainer`` hands it the config (:meth:`WandbLogger.describe`);
- makes ``fl/round`` (rounds completed, logged with every round's and every evaluation's metrics) the x-axis of every
  key, in place of Lightning's ``trainer/global_step`` (0-based rounds: it does not count evaluations or the test);
- finishes its run when a Trainer call fails (``finalize("failed")``); ``flx.run.train`` finishes it after the test
  (:func:`finish`), so the offline files are complete when ``train`` returns.

One run across resumes: W&B's step is the round (``epoch + 1`` of each row: every row of a round is one W&B row, the
test after fit the row after the last round), so the steps of a resumed run continue those of the run before the
kill and are never lower (W&B drops a step lower than the run's last). :class:`WandbRun` (a callback ``flx.run``
adds with a W&B logger) writes each round's row once the round is complete and stores the run id in every
checkpoint (``checkpoint["wandb"]``); a run resumed from it passes ``id`` and ``resume="allow"`` to ``wandb.init``
(:func:`resume_runs`, before the run starts). :func:`close_runs` finishes the runs before a process ends on purpose
(a SLURM requeue, a signal), with the round's last row. wandb writes its run file every
``x_transaction_log_flush_interval`` seconds (15 by default, ``FLUSH_SECONDS`` here): a kill loses at most that much.

Parts find the W&B loggers with :func:`wandb_loggers` and draw line plots with :func:`log_line_series`; both do
nothing without W&B and off global rank zero. docs/dashboards.md lists what is logged.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
import warnings
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from flx.wandb_files import read_records

ROUND = "fl/round"  # the x-axis of every W&B chart: rounds completed (1-based)
FLUSH_SECONDS = 1.0  # wandb writes its run file this often (its default, 15 s, would lose 15 s of rows to a kill)


class WandbLogger(_LightningWandbLogger):
    """Lightning's ``WandbLogger`` that describes the run and keeps one W&B row per round (see the module doc). Same
    arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:  # Lightning passes None, which wandb warns about on every run
            self._wandb_init.pop("anonymous", None)
        if "settings" not in kwargs and "WANDB_X_TRANSACTION_LOG_FLUSH_INTERVAL" not in os.environ:
            self._wandb_init["settings"] = {"x_transaction_log_flush_interval": FLUSH_SECONDS}
        self._run_config: dict[str, Any] = {}
        self._described = False
        self._step, self._pending, self.closed = 0, False, False  # W&B's step; a row not yet written; close_runs

    def describe(self, config: Mapping[str, Any]) -> None:
        """The run config to store when the run starts (:func:`run_config`); before the run exists."""
        self._run_config = dict(config)

    def resume(self, run_id: str, rounds: int) -> None:
        """Continues the W&B run ``run_id``, whose rows hold ``rounds`` rounds (a checkpoint's): before the run starts,
        unless an id was given (``logger.wandb.id``)."""
        if self._experiment is None and not self._wandb_init.get("id"):
            self._wandb_init.update(id=run_id, resume="allow")
            self._id, self._step = run_id, rounds

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> Any:
        run = super().experiment
        if not self._described and getattr(run, "define_metric", None) is not None:
            self._described = True
            run.config.update(self._run_config, allow_val_change=True)
            run.define_metric(ROUND)
            run.define_metric("*", step_metric=ROUND, step_sync=True)
        return run

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Lightning's rows (and :meth:`flx.module_logging.Reporter.log_round`'s) carry ``epoch``: they go to W&B
        step ``epoch + 1``, with ``trainer/global_step`` as Lightning logs it."""
        row = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}" if self._prefix else k: v for k, v in metrics.items()}
        if step is not None:
            row["trainer/global_step"] = step
        self.log_row(row, int(metrics["epoch"]) + 1 if "epoch" in metrics else self._step)

    def log_row(self, data: Mapping[str, Any], step: int) -> None:
        """Adds ``data`` to the W&B row of ``step`` (the round; a lower step joins the current row: W&B would drop
        it). Nothing once :func:`close_runs` closed the run."""
        if self.closed:
            return
        self._step, self._pending = max(self._step, step), True
        self.experiment.log(dict(data), step=self._step)

    def commit(self) -> None:
        """Writes the current row (W&B holds a row until a later step arrives; a kill would lose it)."""
        if self._pending and self._experiment is not None and not self.closed:
            self._experiment.log({}, step=self._step, commit=True)
            self._pending = False

    @override
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if status == "failed":
            self.finish(exit_code=1)

    def finish(self, exit_code: int = 0) -> None:
        """Finishes the run (its offline files are then complete); a later log starts a new one. Only on the rank
        that holds a run."""
        if self._experiment is not None and hasattr(self._experiment, "finish"):
            settings = getattr(self._experiment, "settings", None)
            self._experiment.finish(exit_code=exit_code)
            wait_for_exit_record(getattr(settings, "sync_file", None))
        self._experiment, self._described, self._pending = None, False, False

    def close(self, exit_code: int, preempting: bool) -> None:
        """Finishes the run for good in this process (:func:`close_runs`): later logs are dropped, not a new run."""
        if preempting and self._experiment is not None and hasattr(self._experiment, "mark_preempting"):
            self._experiment.mark_preempting()
        self.finish(exit_code)
        self.closed = True


class WandbRun(pl.Callback):
    """Keeps a W&B run whole across kills and resumes (see the module doc): writes each round's row when the next
    round starts (the round's last values are logged after every hook of the round) and stores the run ids in every
    checkpoint, ``checkpoint["wandb"]["run_ids"]`` (one per :class:`WandbLogger`, in order; rank zero's)."""

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for logger in _flx_loggers(trainer.loggers):
            logger.commit()

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        ids = [logger.version for logger in _flx_loggers(trainer.loggers)]
        if trainer.is_global_zero and all(ids):
            checkpoint["wandb"] = {"run_ids": ids}


def _flx_loggers(loggers: Sequence[Any]) -> list[WandbLogger]:
    return [lg for lg in loggers if isinstance(lg, WandbLogger)]


def stored_runs(path: str) -> tuple[list[str], int]:
    """The W&B run ids a checkpoint stored (:class:`WandbRun`; none in older checkpoints or an unreadable file, which
    the checkpoint's load reports) and its rounds done. Loaded weights-only and memory-mapped: only these small
    entries are read."""
    import torch

    try:
        ckpt = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not this function's to report
        return [], 0
    if not isinstance(ckpt, dict):
        return [], 0
    return list(ckpt.get("wandb", {}).get("run_ids", [])), int(ckpt.get("epoch", -1)) + 1


def resume_runs(trainer: pl.Trainer, ckpt_path: str | None) -> None:
    """A run resumed from ``ckpt_path`` continues the W&B runs stored in it (:meth:`WandbLogger.resume`); call it
    before ``fit`` (Lightning starts the runs in its setup, before the checkpoint is restored)."""
    loggers = _flx_loggers(trainer.loggers)
    if ckpt_path is None or not loggers:
        return
    ids, rounds = stored_runs(ckpt_path)
    for logger, run_id in zip(loggers, ids):
        logger.resume(run_id, rounds)


def close_runs(trainer: pl.Trainer, exit_code: int = 0, preempting: bool = False) -> None:
    """Finishes the W&B runs before the process ends on purpose (a SLURM requeue: ``preempting``; a signal), so that
    nothing logged is lost when the process is stopped: the round's training row first when called from a round's
    epoch-end hooks (Lightning logs it after them), then every run with ``exit_code`` (its exit record written). Later
    logs of this process are dropped; a resumed run continues the same W&B run. Call it on every rank."""
    loop = trainer.fit_loop
    progress = loop.epoch_progress.current
    if progress.processed > progress.completed:  # in a round's epoch-end hooks: log its pending row now, as Lightning
        # would once they return (Lightning 2.6's fit loop, on_advance_end; the second call then has nothing to log)
        loop.epoch_loop._batches_that_stepped -= 1
        trainer._logger_connector.update_train_epoch_metrics()
        loop.epoch_loop._batches_that_stepped += 1
    for logger in _flx_loggers(trainer.loggers):
        logger.close(exit_code, preempting)


def wait_for_exit_record(path: str | None, timeout_s: float = 30.0) -> bool:
    """Waits until the run file ``path`` holds its exit record: wandb's service process (wandb-core, 0.31) may
    still be writing it when ``finish`` returns, and ``train.py`` ends without waiting for other processes. True
    when the record is there; False (with a warning) after ``timeout_s``, or for a run without a local file."""
    if not path:
        return False
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = read_records(path)
        except (OSError, ValueError):  # not there yet, or a chunk still being written
            records = []
        if any(record.WhichOneof("record_type") == "exit" for record in records):
            return True
        if time.monotonic() > deadline:
            warnings.warn(
                f"W&B: {path} has no exit record {timeout_s:.0f} s after finish; the run may be incomplete",
                stacklevel=2,
            )
            return False
        time.sleep(0.05)


def wandb_loggers(trainer: pl.Trainer) -> list[_LightningWandbLogger]:
    """The trainer's W&B loggers on global rank zero, but those :func:`close_runs` closed; ``[]`` elsewhere or without
    W&B."""
    if not trainer.is_global_zero:
        return []
    return [lg for lg in trainer.loggers if isinstance(lg, _LightningWandbLogger) and not getattr(lg, "closed", False)]


def log_wandb(trainer: pl.Trainer, data: Mapping[str, Any]) -> None:
    """``data`` (tables, plots, histograms) to every W&B logger, rank zero, in the row of the round in progress
    (``current_epoch + 1``; after fit, the row after the last round, with the test)."""
    for logger in wandb_loggers(trainer):
        if isinstance(logger, WandbLogger):
            logger.log_row(data, trainer.current_epoch + 1)
        else:
            logger.experiment.log(dict(data))


def describe_run(loggers: Sequence[Any], cfg: DictConfig) -> None:
    """Hands :func:`run_config` of ``cfg`` to every :class:`WandbLogger` among ``loggers`` (nothing is logged yet)."""
    described = [lg for lg in loggers if isinstance(lg, WandbLogger)]
    if described:
        config = run_config(cfg)
        for logger in described:
            logger.describe(config)


def finish(trainer: pl.Trainer, exit_code: int = 0) -> None:
    """Finishes the runs of the trainer's :class:`WandbLogger` s with ``exit_code`` (a plain Lightning one is left to
    wandb's exit)."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.finish(exit_code)


def run_config(cfg: DictConfig) -> dict[str, Any]:
    """The whole config, resolved (an interpolation that cannot be resolved outside a Hydra run is kept as written),
    and ``code``: :func:`code_version`."""
    try:
        config = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - e.g. ${hydra:...} in a config composed without a Hydra run
        config = OmegaConf.to_container(cfg, resolve=False)
    return {**config, "code": code_version()}


@functools.cache
def code_version() -> dict[str, Any]:
    """``flx_version``, and ``git_commit`` / ``git_dirty`` (tracked files changed) when flx runs from a git checkout."""
    try:
        out: dict[str, Any] = {"flx_version": metadata.version("flx")}
    except metadata.PackageNotFoundError:
        out = {"flx_version": "unknown"}
    root = str(Path(__file__).resolve().parent)

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=10, check=True)
        return done.stdout.strip()

    try:
        out["git_commit"] = git("rev-parse", "HEAD")
        out["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # not a checkout, or no git
        pass
    return out


def log_line_series(
    trainer: pl.Trainer,
    key: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    title: str,
    xname: str = "round",
) -> None:
    """W&B: one line chart ``key`` with a line per ``series`` entry (``name: [(x, y), ...]``; empty ones are left
    out), ``wandb.plot.line_series``; its data is the table ``<key>_table`` (columns ``lineKey``, ``lineVal``,
    ``step``). Nothing without W&B, off global rank zero, or with no points."""
    loggers = wandb_loggers(trainer)
    series = {name: list(points) for name, points in series.items() if points}
    if not loggers or not series:
        return
    import wandb

    xs = [[float(x) for x, _ in points] for points in series.values()]
    ys = [[float(y) for _, y in points] for points in series.values()]
    plot = wandb.plot.line_series(xs=xs, ys=ys, keys=list(series), title=title, xname=xname)
    log_wandb(trainer, {key: plot})
