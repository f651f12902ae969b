"""Composition root: config -> datamodule, net, parts, federation, module, Trainer -> fit -> test.

No algorithm logic here: configs pick classes with ``_target_``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys
import tempfile
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.plugins.environments import SLURMEnvironment
from omegaconf import DictConfig, OmegaConf

from flx import composition, loop, signals, vectorized
from flx.checkpoint_io import LAST, AtomicCheckpointIO
from flx.checks import check_monitor, validate
from flx.console import final_line, headline
from flx.datamodules import prefetch
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.protocol import data_protocol
from flx.determinism import cuda_determinism
from flx.errors import ConfigError, bad_value, instantiate, one_line
from flx.federation import FederationConfig, FederationSpec
from flx.hooks import Build, FederatedCallback
from flx.launch import (
    DDP_STRATEGIES,
    fork_ranks,
    job_label,
    keep_threads,
    process_rank,
    run_threads,
    set_threads,
    slurm_job_id,
    slurm_restarts,
    threads_until_fork,
)
from flx.models.build import net_from_config as build_net
from flx.module import FederatedModule, metric_names
from flx.module_logging import participation_gap
from flx.resources import build_server_resources
from flx.resume import check_ckpt, fingerprint, newest_round_file
from flx.server import ServerOptConfig
from flx.state import ClientStateStore
from flx.systems.simulator import LatencySimulator
from flx.tasks import Classification, Task
from flx.threads import AUTO, by_work, startup_line, step_flops
from flx.threads import resolve as resolve_threads
from flx.wandb_logging import WandbLogger, WandbRun, describe_run, finish, log_wandb, resume_runs

# flx drives local optimizers itself: Lightning's notice that the module has none is expected, not a problem;
# the pytree notice is Lightning's own deprecation, not the user's
warnings.filterwarnings("ignore", message=r".*`LightningModule.configure_optimizers` returned `None`.*")
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
# data.val_fraction=0 means no validation loader: the skipped validation loop is intended
warnings.filterwarnings("ignore", message=r".*Total length of `list` across ranks is zero.*")
# flx logs round-level values that are identical on every rank (summed in the round's one all-reduce): syncing them
# again would cost a collective per key
warnings.filterwarnings("ignore", message=r".*sync_dist=True.*when logging on epoch level in distributed.*")
# srun on the PATH outside a SLURM job is a login node or a test machine, not a mistake
warnings.filterwarnings("ignore", message=r".*The `srun` command is available on your system but is not used.*")
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(lambda r: "💡 Tip:" not in r.getMessage())
# the planned end of fit: the progress bar's last line and the final line say it (other stops are still reported)
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
    lambda r: "stopped: `max_epochs=" not in r.getMessage()
)
# Lightning's info lines ("GPU available: ...") go to stdout: stderr carries flx's warnings and one-line errors only
for _name in ("lightning.pytorch", "lightning.fabric"):
    for _handler in logging.getLogger(_name).handlers:
        if isinstance(_handler, logging.StreamHandler) and _handler.stream is sys.stderr:
            _handler.setStream(sys.stdout)


def federation_config(cfg: DictConfig, num_train_clients: int | None = None) -> FederationConfig:
    """``FederationConfig`` from ``algo.*`` (every field of that name; missing keys keep the field's default), with
    ``seed`` and ``fault.*`` (policy, divergence rule) from the top level. Numbers are cast to the fields' types
    (``lr: 1`` is 1.0); ``algo.clients_per_round=all`` becomes ``num_train_clients``."""
    algo = OmegaConf.to_container(cfg.algo, resolve=True)
    if algo.get("clients_per_round") == "all":
        if num_train_clients is None:
            raise ValueError("algo.clients_per_round=all needs the number of training clients")
        algo["clients_per_round"] = num_train_clients
    values: dict[str, Any] = {f.name: algo[f.name] for f in dataclasses.fields(FederationConfig) if f.name in algo}
    for f in dataclasses.fields(FederationConfig):
        if f.name in values and f.type in ("float", "float | None") and values[f.name] is not None:
            values[f.name] = float(values[f.name])
    values["server"] = ServerOptConfig(**values.get("server", {}))
    fault = {f"diverge_{k}": cfg.fault.get(f"diverge_{k}", d) for k, d in (("factor", 100.0), ("rounds", 2))}
    if fault["diverge_factor"] is not None:
        fault["diverge_factor"] = float(fault["diverge_factor"])
    return FederationConfig(**values, seed=cfg.seed, fault_policy=cfg.fault.policy, **fault)


def _instantiate_group(group: DictConfig | None) -> list[Any]:
    """Instantiates every entry of a dict-of-configs group, in order (null entries are switched off)."""
    return [instantiate(c) for c in (group or {}).values() if c is not None]


def build_trainer(cfg: DictConfig, parts: list[Any]) -> pl.Trainer:
    """The Lightning Trainer with the federated loops installed; ``strategy=ddp`` maps to flx's DDP.

    Checkpoints are flx's round-boundary :class:`RoundCheckpoint` (``checkpoint.*``; ``checkpoint=null`` or
    ``trainer.enable_checkpointing=false`` switch them off, and with them Lightning's own default checkpoint), written
    atomically by :class:`AtomicCheckpointIO`.
    """
    callbacks = parts + _instantiate_group(cfg.get("callbacks"))
    checkpointing = cfg.get("checkpoint") is not None and bool(cfg.trainer.get("enable_checkpointing", True))
    if checkpointing:
        callbacks.append(instantiate(cfg.checkpoint))
    if cfg.trainer.get("enable_progress_bar") is False:
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    loggers = _instantiate_group(cfg.get("logger"))
    describe_run(loggers, cfg)  # W&B: the run config and code version, logged when its run starts (rank zero)
    if any(isinstance(lg, WandbLogger) for lg in loggers):  # W&B: a row per round, the run id in the checkpoints
        callbacks.append(WandbRun())
    kwargs: dict[str, Any] = {"plugins": [AtomicCheckpointIO()]}
    if cfg.trainer.get("strategy") in DDP_STRATEGIES:
        kwargs["strategy"] = loop.FederatedDDPStrategy(process_group_backend=cfg.trainer.get("process_group_backend"))
        if cfg.get("num_threads") is not None:  # else Lightning's DDP launcher replaces num_threads at the fit
            keep_threads(run_threads())  # resolved (num_threads=auto) and the same in every rank
    if slurm_job_id() is not None:  # flx requeues itself at a round boundary (RoundCheckpoint), not mid-round
        try:
            kwargs["plugins"].append(SLURMEnvironment(auto_requeue=False))
        except RuntimeError as err:  # e.g. `srun -n 2`: Lightning counts processes per node (--ntasks-per-node)
            raise ConfigError(f"SLURM: {one_line(err)}") from None
    # limit_train_batches caps the clients per rank and round: the loop's, not Lightning's (a round is one batch)
    trainer_cfg = {k: v for k, v in cfg.trainer.items() if k not in ("process_group_backend", "limit_train_batches")}
    trainer_cfg["enable_checkpointing"] = checkpointing  # off: no ModelCheckpoint of Lightning's own (epoch=*.ckpt)
    with cuda_determinism(cfg.trainer.get("deterministic")):  # before anything runs on the GPU (flx.determinism)
        trainer = instantiate(trainer_cfg, callbacks=callbacks, logger=loggers or False, **kwargs)
    return loop.install(trainer, client_limit=cfg.trainer.get("limit_train_batches"))


def build_task(cfg: DictConfig, data: Any) -> Task:
    """The ``task=`` config instantiated (:mod:`flx.tasks`; no task node: classification), checked against the loaded
    data (class labels or real-valued targets)."""
    task = Classification() if cfg.get("task") is None else instantiate(cfg.task)
    if not isinstance(task, Task):
        raise bad_value("task._target_", cfg.task.get("_target_"), "must name a flx.tasks.Task class")
    task.check_data(data)
    return task


def build_system(cfg: DictConfig, fed_cfg: FederationConfig, net: torch.nn.Module) -> LatencySimulator | None:
    """The ``system=`` device / latency simulator (docs/systems.md), given the run's ``B``, ``K`` and parameter count;
    None with ``system=none``."""
    if not cfg.get("system"):
        return None
    num_params = sum(p.numel() for p in net.parameters() if p.requires_grad)
    return instantiate(
        cfg.system, batch_size=fed_cfg.batch_size, local_steps=fed_cfg.local_steps, num_params=num_params
    )


def build_datamodule(cfg: DictConfig, loaded: Any = None) -> FederatedDataModule:
    """The run's datamodule, set up for fit: its data split, server split and clients (``data``, ``partition``,
    ``seed``, ``client_eval``, ``eval_test``); ``loaded``: the data already loaded (:mod:`flx.datamodules.prefetch`)."""
    dm = FederatedDataModule(
        instantiate(cfg.data.loader),
        instantiate(cfg.partition),  # its seed is partition.seed; cfg.seed only if that is null
        cfg.seed,
        cfg.data.eval_batch_size,
        client_eval=cfg.get("client_eval", "holdout"),
        protocol=data_protocol(cfg),
        eval_test=bool(cfg.get("eval_test", False)),
        loaded=loaded,
    )
    dm.setup("fit")
    return dm


def build(cfg: DictConfig) -> tuple[FederatedDataModule, FederatedModule, pl.Trainer]:
    validate(cfg)
    threads = threads_until_fork(resolve_threads(cfg.get("num_threads"), cfg.trainer))
    if threads:
        torch.set_num_threads(int(threads))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    dm = build_datamodule(cfg, loaded=prefetch.take(cfg))  # loaded while train.py imported Lightning, or None
    dm.server_resources = build_server_resources(cfg, dm)  # server split and frozen models, for the server only
    task = build_task(cfg, dm.data)
    outputs = task.num_outputs(dm.data, cfg.model.get("binary_head", "two_logits"))
    net = build_net(cfg.model, dm.data.input_shape, dm.data.num_classes, outputs)
    if threads and cfg.get("num_threads") == AUTO and not cfg.algo.get("vectorize"):  # stacked steps are large
        flops = step_flops(net, dm.data.input_shape, cfg.algo.batch_size)
        set_threads(by_work(resolve_threads(AUTO, cfg.trainer), flops))  # 1 thread for a small step
    store = ClientStateStore(cfg.state_store.backend, cfg.state_store.get("dir"))
    fed_cfg = federation_config(cfg, dm.clients.num_train_clients)
    fed = FederationSpec(fed_cfg, store, system=build_system(cfg, fed_cfg, net))
    module = FederatedModule(
        net, fed, dm.data.num_classes, dm.metric_clients(), fingerprint=fingerprint(cfg), task=task
    )
    parts = _instantiate_group(cfg.algo.get("parts"))
    if cfg.get("privacy"):  # last: it clips what the other parts left in the upload, and its weights win
        parts.append(instantiate(cfg.privacy))
    check_parts(cfg, dm, fed, net, task, parts)
    return dm, module, build_trainer(cfg, parts)


def check_parts(
    cfg: DictConfig, dm: FederatedDataModule, fed: FederationSpec, net: torch.nn.Module, task: Task, parts: list[Any]
) -> None:
    """The checks that need the built run but nothing written yet (``save_config`` and the Trainer come after): the
    parts' composition and their own checks (:func:`flx.composition.check`, once: the federation built at the fit's
    start does not repeat it), the net under ``algo.vectorize``, and ``checkpoint.monitor`` against the keys the task
    and parts log (:func:`flx.checks.check_monitor`)."""
    fed_parts = tuple(p for p in parts if isinstance(p, FederatedCallback))
    composition.check(Build(fed.cfg, net, fed_parts, dm.clients, fed.system, dm.server_resources, datamodule=dm))
    fed.checked = fed_parts
    if fed.cfg.vectorize:
        vectorized.check(net)
    if cfg.get("checkpoint") is not None and cfg.trainer.get("enable_checkpointing", True):
        check_monitor(cfg.checkpoint.get("monitor"), metric_names(task, parts, dm, fed.system is not None))


def save_config(cfg: DictConfig, dm: FederatedDataModule | None = None) -> None:
    """Writes ``<output_dir>/.hydra/config.yaml`` (and the command-line overrides) once the run is set up, and the
    exact data split and partition next to them (``data_split.json``, ``partition.json``; see ``dm.save``).

    A run resumed into the folder of an earlier one keeps the earlier config: its own goes to ``config.<k>.yaml`` /
    ``overrides.<k>.yaml`` with the first free ``k``; the split and partition are the same (the fingerprint says so)
    and their files are left as they are (:func:`save_split`).
    """
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or process_rank() != 0:  # every rank runs this; one writes
        return
    folder = os.path.join(HydraConfig.get().runtime.output_dir, ".hydra")
    os.makedirs(folder, exist_ok=True)
    k, suffix = 0, ""
    while os.path.exists(os.path.join(folder, f"config{suffix}.yaml")):
        k, suffix = k + 1, f".{k + 1}"
    OmegaConf.save(cfg, os.path.join(folder, f"config{suffix}.yaml"))
    OmegaConf.save(list(HydraConfig.get().overrides.task), os.path.join(folder, f"overrides{suffix}.yaml"))
    if dm is not None:
        save_split(folder, dm)


SPLIT_FILES = ("data_split.json", "partition.json")


def save_split(folder: str, dm: FederatedDataModule) -> None:
    """``dm.save`` into ``folder``, never over a file already there (a continuing run's are the same) and never
    half-written: the files are written into a temporary folder beside them and renamed into place."""
    if os.path.exists(os.path.join(folder, "partition.json")):  # always saved (data_split.json: with a pool split)
        return
    tmp = tempfile.mkdtemp(prefix=".split-", dir=folder)
    try:
        dm.save(tmp)
        for name in SPLIT_FILES:
            made, kept = os.path.join(tmp, name), os.path.join(folder, name)
            if os.path.exists(made) and not os.path.exists(kept):
                os.replace(made, kept)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def resume_path(cfg: DictConfig) -> str | None:
    """``ckpt_path``, with ``auto`` resolved: the run folder's ``checkpoints/last.ckpt`` if there is one (a requeued
    or restarted job), else its newest intact round file (:func:`flx.resume.newest_round_file`), else None (a fresh
    start). A SLURM job that was requeued (``SLURM_RESTART_COUNT`` > 0, e.g. a
    submitit sweep job after preemption) means ``auto`` when ``ckpt_path`` is null. The checkpoint must match the
    config (:func:`check_ckpt`)."""
    path = cfg.get("ckpt_path")
    if path is None and slurm_restarts() > 0 and cfg.get("checkpoint") is not None:
        path = "auto"  # a requeued job (preempted, timed out) resumes where it stopped instead of starting over
    if path != "auto":
        return path
    if cfg.get("checkpoint") is None:
        raise bad_value("ckpt_path", path, "needs checkpoint.dirpath (checkpoint is null)")
    last = os.path.join(str(cfg.checkpoint.dirpath), LAST)
    if not os.path.isfile(last):
        return newest_round_file(cfg, str(cfg.checkpoint.dirpath))
    check_ckpt(cfg, last)
    return last


def _tested_checkpoint(cfg: DictConfig, trainer: pl.Trainer) -> str | None:
    if cfg.get("test_on", "final") == "final":
        return None
    best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
    if not best:
        raise bad_value("test_on", cfg.test_on, "no best checkpoint was written (set checkpoint.monitor, e.g. val/acc)")
    return best


def print_final_line(
    metrics: dict[str, float], names: tuple[str, ...], extra: dict[str, float | str] | None = None
) -> None:
    """``final test_acc=0.9123 test_auroc=0.8812`` (the headline metrics of the test, then the parts' ``extra`` final
    values: ``epsilon=7.9812``), then ``for job <n> (<swept overrides>)`` in a ``-m`` sweep (:mod:`flx.console`,
    :func:`flx.launch.job_label`)."""
    line = final_line(metrics, names, job_label(), extra)
    if line is not None:
        print(line, flush=True)


def train(cfg: DictConfig) -> dict[str, float]:
    """Runs fit then test; returns the final metrics and prints the final line (``final test_acc=<value> ...``).
    A run that a part ended before a round (:class:`flx.hooks.RoundRefused`, a spent privacy budget) is tested and
    reported the same way, then raises it: ``train.py`` exits with its status."""
    ckpt_path = resume_path(cfg)
    dm, module, trainer = build(cfg)
    signals.stop_if_signalled(cfg.get("checkpoint"))  # a signal while the data loaded: stop before the first write
    save_config(cfg, dm)
    fork_ranks()  # trainer=ddp on the CPU: the other ranks start now, from this process (flx.launch.prelaunch)
    if process_rank() == 0:  # beside Lightning's banner: the threads each process runs on, and why
        print(startup_line(cfg.get("num_threads"), cfg.trainer, torch.get_num_threads()), flush=True)
    resume_runs(trainer, ckpt_path)  # W&B: a resumed run continues the run its checkpoint names
    trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
    stop = signals.stopped()
    if stop is not None:  # stopped on a signal at a round boundary (flx.signals): no test
        finish(trainer, exit_code=signals.status(stop.signum))  # W&B records how the process ends
        return {}
    results = trainer.test(
        module, datamodule=dm, verbose=False, ckpt_path=_tested_checkpoint(cfg, trainer), weights_only=True
    )
    metrics = {k: float(v) for k, v in (results[0] if results else {}).items()}
    extra: dict[str, float | str] = {**participation_gap(metrics, module.task.client_key)}  # unseen clients
    extra |= {
        k: v for cb in trainer.callbacks if isinstance(cb, FederatedCallback) for k, v in cb.final_values().items()
    }
    log_wandb(trainer, {f"final/{k}": v for k, v in extra.items()})  # the run's summary says it too
    refused = trainer.fit_loop.refused  # a part refused a round (a privacy budget): tested, then exit status 4
    finish(trainer, exit_code=refused.status if refused else 0)  # W&B: the run's files are complete when train returns
    if trainer.is_global_zero:
        print_final_line(metrics, headline(module.task, trainer.callbacks), extra)
    # after a successful run only (a rank that failed must not wait here for the others): without it Gloo's worker
    # threads can outlive the interpreter and abort the process at exit ("terminate called without an active
    # exception", status -6)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if refused is not None:
        raise refused
    return metrics
