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

Parts find the W&B loggers with :func:`wandb_loggers` and draw line plots with :func:`log_line_series`; both do
nothing without W&B and off global rank zero. docs/dashboards.md lists what is logged.
"""

from __future__ import annotations

import functools
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
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from flx.wandb_files import read_records

ROUND = "fl/round"  # the x-axis of every W&B chart: rounds completed (1-based)


class WandbLogger(_LightningWandbLogger):
    """Lightning's ``WandbLogger`` that describes the run (see the module doc). Same arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:  # Lightning passes None, which wandb warns about on every run
            self._wandb_init.pop("anonymous", None)
        self._run_config: dict[str, Any] = {}
        self._described = False

    def describe(self, config: Mapping[str, Any]) -> None:
        """The run config to store when the run starts (:func:`run_config`); before the run exists."""
        self._run_config = dict(config)

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
        self._experiment, self._described = None, False


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
    """The trainer's W&B loggers on global rank zero; ``[]`` elsewhere or without W&B."""
    if not trainer.is_global_zero:
        return []
    return [lg for lg in trainer.loggers if isinstance(lg, _LightningWandbLogger)]


def describe_run(loggers: Sequence[Any], cfg: DictConfig) -> None:
    """Hands :func:`run_config` of ``cfg`` to every :class:`WandbLogger` among ``loggers`` (nothing is logged yet)."""
    described = [lg for lg in loggers if isinstance(lg, WandbLogger)]
    if described:
        config = run_config(cfg)
        for logger in described:
            logger.describe(config)


def finish(trainer: pl.Trainer) -> None:
    """Finishes the runs of the trainer's :class:`WandbLogger` s (a plain Lightning one is left to wandb's exit)."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.finish()


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
    for logger in loggers:
        logger.experiment.log({key: plot})
