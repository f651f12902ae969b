"""The values of a composed run config: a wrong value stops with one line naming the key, the value and what is
allowed (:func:`validate`, run by :func:`flx.config.precheck` before the run starts, with no torch imported).

:mod:`flx.config` composes the command line; this module checks what it composed. Loaders and partitioners check
what only they can (files on disk, sample counts); the allowed values of keys whose owners need torch are in
:mod:`flx.choices`.
"""

from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flx.checkpoint_spec import check_checkpoint
from flx.choices import (
    AGGREGATORS,
    CLIENT_EVAL,
    DUPLICATES,
    FAULT_POLICIES,
    MINIBATCH,
    MODEL_INITS,
    SERVER_OPTIMIZERS,
    SINGLE_ROW_BATCH,
)
from flx.errors import LOOP_WHY, MAX_INT, MAX_LOOP, ConfigError, bad_value, count, number_error, one_line
from flx.launch import DDP_STARTS, DDP_STRATEGIES, slurm_job_id
from flx.resource_spec import check_server
from flx.resume import check_ckpt
from flx.systems.params import check_system
from flx.task_spec import check_task
from flx.threads import AUTO

PRECISIONS = ("32-true", "32", "64-true", "64", "bf16-mixed", "bf16-true", "16-true")


STRATEGIES = ("auto", *DDP_STRATEGIES)


def check_files(cfg: DictConfig) -> None:
    """The dataset's files are where ``data.loader`` will read them (:func:`flx.datamodules.files.locate`)."""
    from flx.datamodules.files import locate

    loader = OmegaConf.to_container(cfg.data.loader, resolve=True) if OmegaConf.select(cfg, "data.loader") else None
    if isinstance(loader, dict):
        locate(loader)


def check_wandb(cfg: DictConfig) -> None:
    """``logger=wandb`` needs an account (an API key) unless W&B runs offline; without one wandb raises at fit start."""
    if "wandb" not in (cfg.get("logger") or {}):
        return
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    settings = [os.environ.get("NETRC", "~/.netrc"), "~/.config/wandb/settings", "wandb/settings"]
    for path in (os.path.expanduser(p) for p in settings):
        if os.path.isfile(path):
            with open(path, errors="ignore") as f:
                text = f.read()
            if "wandb" in text and "machine" in text or "mode = offline" in text or "mode = disabled" in text:
                return
    why = "no W&B API key: run `wandb login` or set WANDB_API_KEY, or set WANDB_MODE=offline to log locally"
    raise bad_value("logger", "wandb", why)


def check_partition(cfg: DictConfig) -> None:
    """Builds the partitioner (cheap, no data) so that its parameter checks run before the run starts."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        part = instantiate(cfg.partition)
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise ConfigError(f"partition: {one_line(e)}") from None
    train = getattr(part, "num_train_clients", part.num_clients)  # the unseen (few_shot: held-out) clients never train
    k = cfg.algo.get("clients_per_round")
    if _every_client(cfg) or k <= train:  # from_file: the count comes from the file
        return
    unseen = OmegaConf.select(cfg, "partition.unseen_clients")
    if unseen and k <= part.num_clients:
        why = f"leaves {train} of the {part.num_clients} clients to train, fewer than algo.clients_per_round={k}"
        raise bad_value("partition.unseen_clients", unseen, why)
    raise bad_value("algo.clients_per_round", k, f"must be <= the number of training clients ({train})")


def _every_client(cfg: DictConfig) -> bool:
    """``algo.clients_per_round=all``: every training client in every round."""
    return cfg.algo.get("clients_per_round") == "all"


def _num(cfg: DictConfig, key: str) -> Any:
    value = OmegaConf.select(cfg, key)
    err = number_error(key, value)
    if err is not None:
        raise err
    return value


def _int(cfg: DictConfig, key: str, low: int, high: int | None = None, why: str = "") -> int:
    """``key``'s value, an integer in ``[low, high]`` (``high`` None: no upper bound; ``why``: the bound's reason)."""
    value = OmegaConf.select(cfg, key)
    if isinstance(value, float) and math.isnan(value):
        raise bad_value(key, value, "not a number; must be an integer")
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" + ("" if high is None else f" and <= {high}{why}")
        raise bad_value(key, value, f"must be {allowed}")
    return value


def _check(cfg: DictConfig, key: str, ok: Callable[[Any], bool], allowed: str) -> None:
    value = _num(cfg, key)
    if not ok(value):
        raise bad_value(key, value, allowed)


def _check_algo(cfg: DictConfig) -> None:
    _int(cfg, "algo.rounds", 1, MAX_LOOP, LOOP_WHY)
    if not _every_client(cfg):
        _int(cfg, "algo.clients_per_round", 1)
    _int(cfg, "algo.batch_size", 1, MAX_BATCH, BATCH_WHY)
    _int(cfg, "algo.local_steps", 0, MAX_LOOP, LOOP_WHY)  # 0 only with a part that replaces the local steps (build)
    if cfg.algo.get("local_epochs") is not None:
        _int(cfg, "algo.local_epochs", 1, MAX_EPOCHS, LOOP_WHY)
    _check(cfg, "algo.lr", lambda v: v > 0, "must be > 0")
    _check(cfg, "algo.momentum", lambda v: 0 <= v < 1, "must be in [0, 1)")
    _check(cfg, "algo.weight_decay", lambda v: v >= 0, "must be >= 0")
    _check_server_opt(cfg)
    if cfg.algo.weighting not in ("num_samples", "uniform"):
        raise bad_value("algo.weighting", cfg.algo.weighting, "allowed: num_samples, uniform")
    if cfg.algo.get("duplicates", "multiplicity") not in DUPLICATES:
        raise bad_value("algo.duplicates", cfg.algo.duplicates, f"allowed: {', '.join(DUPLICATES)}")
    for key in BOOLEAN_KEYS:
        if not isinstance(OmegaConf.select(cfg, key, default=False), bool):
            raise bad_value(key, OmegaConf.select(cfg, key), "allowed: true, false")
    if cfg.algo.get("minibatch", "epochs") not in MINIBATCH:
        raise bad_value("algo.minibatch", cfg.algo.minibatch, f"allowed: {', '.join(MINIBATCH)}")
    if cfg.algo.get("aggregator", "mean") not in AGGREGATORS:
        raise bad_value("algo.aggregator", cfg.algo.aggregator, f"allowed: {', '.join(AGGREGATORS)}")
    if cfg.algo.server.name not in SERVER_OPTIMIZERS:
        raise bad_value("algo.server.name", cfg.algo.server.name, f"allowed: {', '.join(SERVER_OPTIMIZERS)}")
    if cfg.partition.get("num_clients") is None and "path" in cfg.partition.keys():
        return  # partition=from_file takes the count from its file: checked when the partitioner is built
    _int(cfg, "partition.num_clients", 1)
    if not _every_client(cfg) and cfg.algo.clients_per_round > cfg.partition.num_clients:
        raise bad_value(
            "algo.clients_per_round",
            cfg.algo.clients_per_round,
            f"must be <= partition.num_clients ({cfg.partition.num_clients})",
        )


MAX_PROCESSES = 2**16
"""The most ``trainer.devices`` (per node) and ``trainer.num_nodes``: beyond any machine or cluster."""


BOOLEAN_KEYS = (
    "algo.vectorize",
    "algo.binary_task",
    "checkpoint.background",
    "trainer.enable_checkpointing",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.use_distributed_sampler",
)
"""Keys that hold a boolean where they are set: ``"no"`` or ``1`` is refused, not read as true (``run.overwrite``:
:func:`flx.run_folder.overwrite`, before the run folder is touched)."""


def _check_server_opt(cfg: DictConfig) -> None:
    """``algo.server.*`` (:class:`flx.server.ServerOptConfig`): the adaptive steps' ``betas`` two numbers in [0, 1),
    ``eps`` (tau) > 0, ``initial_accumulator`` (v_{-1}) null or >= 0, ``weight_decay`` >= 0."""
    _check(cfg, "algo.server.lr", lambda v: v > 0, "must be > 0")
    _check(cfg, "algo.server.momentum", lambda v: 0 <= v < 1, "must be in [0, 1)")
    _check(cfg, "algo.server.eps", lambda v: v > 0, "the adaptive steps' tau, must be > 0")
    if OmegaConf.select(cfg, "algo.server.initial_accumulator", default=None) is not None:
        _check(cfg, "algo.server.initial_accumulator", lambda v: v >= 0, "v_{-1}, must be >= 0 (null: the default)")
    _check(cfg, "algo.server.weight_decay", lambda v: v >= 0, "must be >= 0")
    betas = OmegaConf.select(cfg, "algo.server.betas")
    pair = list(betas) if OmegaConf.is_list(betas) or isinstance(betas, (list, tuple)) else None
    if pair is None or len(pair) != 2 or any(number_error("", b) is not None or not 0 <= b < 1 for b in pair):
        raise bad_value("algo.server.betas", betas, "must be two numbers in [0, 1), e.g. [0.9,0.99] (beta_1, beta_2)")


def _world_size(cfg: DictConfig) -> int:
    devices, nodes = cfg.trainer.get("devices", 1), cfg.trainer.get("num_nodes", 1) or 1
    count("trainer.num_nodes", nodes, 1, MAX_PROCESSES)
    ok = isinstance(devices, int) and not isinstance(devices, bool) and 0 < devices <= MAX_PROCESSES
    if not (devices in ("auto", -1) or OmegaConf.is_list(devices) or ok):
        allowed = f"an integer from 1 to {MAX_PROCESSES}, a list of device ids, -1 or auto"
        raise bad_value("trainer.devices", devices, f"allowed: {allowed}")
    if isinstance(devices, int) and devices > 0:
        return devices * nodes
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        return len(devices) * nodes
    return nodes  # "auto" / -1: not known before the Trainer resolves it; checked again at round start


def _check_trainer(cfg: DictConfig) -> None:
    t = cfg.trainer
    if str(t.get("precision", "32-true")) not in PRECISIONS:
        raise bad_value("trainer.precision", t.precision, f"allowed: {', '.join(PRECISIONS)}")
    strategy = t.get("strategy", "auto")
    if isinstance(strategy, str) and strategy not in STRATEGIES:
        raise bad_value("trainer.strategy", strategy, f"allowed: {', '.join(STRATEGIES)}")
    limit = t.get("limit_train_batches")  # applied by flx's loop (clients per rank and round), not by Lightning
    ok = limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1)
    if not (ok or (isinstance(limit, float) and 0 < limit <= 1)):
        allowed = "null, an integer >= 1 (clients per rank and round) or a fraction in (0, 1]"
        raise bad_value("trainer.limit_train_batches", limit, f"allowed: {allowed}")
    for key, low in (("num_sanity_val_steps", -1), ("log_every_n_steps", 1)):
        if t.get(key) is not None:
            count(f"trainer.{key}", t.get(key), low, MAX_INT)
    deterministic = t.get("deterministic")
    if not (deterministic is None or isinstance(deterministic, bool) or deterministic == "warn"):
        raise bad_value("trainer.deterministic", t.deterministic, "allowed: true, false, warn")
    fast = t.get("fast_dev_run", False)
    if not isinstance(fast, bool):
        count("trainer.fast_dev_run", fast, 0, MAX_INT)
    start = cfg.get("ddp_start", "auto")
    if start not in DDP_STARTS:
        raise bad_value("ddp_start", start, f"allowed: {', '.join(DDP_STARTS)}")
    _check_slurm_layout(cfg)  # before the checks of the world size it gives
    world = _world_size(cfg)
    if world > 1 and strategy == "auto":
        raise bad_value("trainer.strategy", strategy, f"set trainer.strategy=ddp to run on {world} devices")
    if not _every_client(cfg) and cfg.algo.clients_per_round < world:
        raise bad_value("algo.clients_per_round", cfg.algo.clients_per_round, f"must be >= the world size ({world})")


# trainer=ddp's layout against a SLURM job's: (key, the SLURM variable, its sbatch/srun option, what it counts)
SLURM_LAYOUT = (
    ("trainer.devices", "SLURM_NTASKS_PER_NODE", "--ntasks-per-node", "tasks per node"),
    ("trainer.num_nodes", "SLURM_NNODES", "--nodes", "nodes"),
)


def _check_slurm_layout(cfg: DictConfig) -> None:
    """In a SLURM job, ``trainer=ddp`` runs one process per task: ``trainer.devices`` must be the job's tasks per node
    and ``trainer.num_nodes`` its nodes. Lightning checks it only at ``trainer.fit``, with a traceback, once the run has
    written its config; here it is one line before anything is written. Skipped where Lightning skips it (an
    interactive job, ``SLURM_JOB_NAME`` bash or interactive; a layout SLURM does not export)."""
    t = cfg.trainer
    if slurm_job_id() is None or t.get("strategy") not in ("ddp", "flx_ddp"):
        return
    if os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return
    for key, variable, option, what in SLURM_LAYOUT:
        value, slurm = OmegaConf.select(cfg, key, default=None), os.environ.get(variable, "")
        skip = not isinstance(value, int) or value < 1 or not slurm.isdigit()  # other values: _world_size's checks
        if not skip and int(slurm) != value:
            raise bad_value(key, value, f"must be the SLURM job's {what} ({option}={slurm}): one process per task")


def _check_ckpt(cfg: DictConfig) -> None:
    path = cfg.get("ckpt_path")
    if path is None or path == "auto":  # auto is resolved inside the run, where the output folder is known
        return
    if not os.path.isfile(str(path)):
        raise bad_value("ckpt_path", path, "file not found")
    check_ckpt(cfg, str(path))


def check_experiments(cfg: DictConfig, own: Callable[[str], DictConfig]) -> None:
    """A data config's ``experiments``: the algorithms whose own defaults cannot train its data, each with the
    experiment that holds a setting that does (``pfedfbe: {experiment: pfedfbe_lasso1, keys: [lr, lam]}``). A run of
    such an algorithm whose ``keys`` (under ``algo.``) all still hold its defaults (``own(name)``: the algorithm's
    config alone) stops here with one line naming the experiment, not at a divergence in round 2. Setting any of the
    keys (or running the experiment, which sets them) is a choice of the user's: the run goes on."""
    hints = OmegaConf.select(cfg, "data.experiments")
    hint = hints.get(cfg.algo.name) if hints is not None else None
    if hint is None:
        return
    defaults = own(cfg.algo.name)
    values = {key: OmegaConf.select(cfg.algo, key) for key in hint["keys"]}
    if any(value != OmegaConf.select(defaults, key) for key, value in values.items()):
        return
    shown = ", ".join(f"algo.{key}={value}" for key, value in values.items())
    fix = " and ".join(f"algo.{key}" for key in values)
    raise ConfigError(
        f"data={cfg.data.name}: algo={cfg.algo.name} at its defaults ({shown}) does not train these data (it "
        f"diverges); run the paper's setting, python train.py experiment={hint.experiment}, or set {fix}"
    )


def check_monitor(monitor: str | None, logged: tuple[str, ...]) -> None:
    """Raises one line unless ``monitor`` (``checkpoint.monitor`` of :class:`flx.callbacks.checkpoint.RoundCheckpoint`)
    is among the keys the run will log: ``logged``, names or ``*`` patterns (:func:`flx.module.metric_names`).
    At build time, before anything is written: a name the run never logs would otherwise be found at the end of the
    first validated round."""
    if monitor is None or any(fnmatch.fnmatchcase(monitor, name) for name in logged):
        return
    allowed = ", ".join(n for n in logged if n.startswith(("val/", "test/", "train/"))) or "none"
    why = f"not logged by this run (val/* needs data.val_fraction > 0, test/* eval_test=true); it logs {allowed}"
    raise bad_value("checkpoint.monitor", monitor, why)


def _check_run(cfg: DictConfig) -> None:
    """Top-level run keys: fault policy, what is tested, and Lightning settings that would contradict the rounds."""
    policy = OmegaConf.select(cfg, "fault.policy")
    if policy not in FAULT_POLICIES:
        raise bad_value("fault.policy", policy, f"allowed: {', '.join(FAULT_POLICIES)}")
    if OmegaConf.select(cfg, "fault.diverge_factor") is not None:
        _check(cfg, "fault.diverge_factor", lambda v: v > 1, "must be a number > 1 (null: the rule is off)")
    if OmegaConf.select(cfg, "fault.diverge_rounds") is not None:
        _int(cfg, "fault.diverge_rounds", 1)
    single = cfg.algo.get("single_row_batch", "auto")
    if single not in SINGLE_ROW_BATCH:
        raise bad_value("algo.single_row_batch", single, f"allowed: {', '.join(SINGLE_ROW_BATCH)}")
    ck = cfg.get("checkpoint")
    if ck is not None:
        keys = ("every_rounds", "every_seconds", "keep_last", "mode", "requeue", "requeue_signal", "min_seconds")
        defaults = (1, None, 2, "max", "auto", "SIGUSR1", None)
        check_checkpoint(*(ck.get(k, d) for k, d in zip(keys, defaults)))
    if cfg.get("test_on", "final") not in ("final", "best"):
        raise bad_value("test_on", cfg.test_on, "allowed: final, best")
    if cfg.get("test_on") == "best" and OmegaConf.select(cfg, "checkpoint.monitor") is None:
        raise bad_value("test_on", "best", "needs checkpoint.monitor (e.g. checkpoint.monitor=val/acc)")
    max_epochs = cfg.trainer.get("max_epochs")
    if max_epochs is not None and max_epochs != cfg.algo.rounds:
        why = f"conflicts with algo.rounds={cfg.algo.rounds} (one Lightning epoch is one round): set algo.rounds"
        raise bad_value("trainer.max_epochs", max_epochs, why)
    for key in ("min_epochs", "max_steps", "min_steps"):
        value = cfg.trainer.get(key)
        if value is not None and value not in (-1, 0) and not (key == "max_steps" and value == -1):
            raise bad_value(f"trainer.{key}", value, "rounds are set by algo.rounds; leave it unset")


def check_output_dir(path: str, key: str = "paths.output_dir") -> None:
    """Raises a one-line :class:`ConfigError` naming ``key`` unless files can be created in ``path`` (created if
    missing)."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(b"flx")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        why = f"cannot write there ({e.strerror}); choose another folder"
        raise bad_value(key, path, why) from None


MAX_SEED = 2**32 - 1
"""The largest ``seed`` (and ``data.split_seed``, ``partition.seed``): numpy's legacy seeds and Lightning's
``seed_everything`` take 32 bits. The per-round and per-client seeds derived from it
(:func:`flx.sampling.derive_seed`) are 63-bit whatever the run seed, within torch's and numpy's ranges."""


SEED_WHY = " (numpy's and Lightning's seed range)"


MAX_BATCH = 2**31 - 1
"""The largest ``algo.batch_size`` and ``data.eval_batch_size``: int32, what every index type accepts (torch's
``split`` raises an overflow beyond int64). A batch larger than a client's rows is the client's whole data."""


BATCH_WHY = " (int32; a batch larger than the rows holds all of them)"

MAX_EPOCHS = 10**4
"""The most ``algo.local_epochs``: passes over a client's rows per round (10^4 passes of 100 rows are 10^6 steps of
one row, :data:`flx.errors.MAX_LOOP`)."""


THREADS_PER_CORE = 4
"""``num_threads`` is at most this many per CPU core: more threads only contend (torch.set_num_threads(100000)
starts that many threads and the process runs out of memory)."""


def max_threads() -> int:
    """The largest ``num_threads``: :data:`THREADS_PER_CORE` per CPU core of this machine."""
    return THREADS_PER_CORE * (os.cpu_count() or 1)


def _check_threads(cfg: DictConfig) -> None:
    """``num_threads``: ``auto`` (:mod:`flx.threads`), null (torch's default) or 1 to :func:`max_threads`."""
    value = cfg.get("num_threads")
    if value is None or value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_threads():
        raise bad_value(
            "num_threads",
            value,
            f"allowed: auto (this process's share of the cores it may use), null (torch's default) or an integer "
            f"from 1 to {max_threads()} ({THREADS_PER_CORE} per CPU core of this machine)",
        )


def validate(cfg: DictConfig) -> None:
    """Checks value ranges and cross-key constraints; raises :class:`ConfigError` with one line."""
    _int(cfg, "seed", 0, MAX_SEED, SEED_WHY)
    _int(cfg, "eval_every", 1)
    _int(cfg, "data.eval_batch_size", 1, MAX_BATCH, BATCH_WHY)
    _check_threads(cfg)
    if cfg.get("client_eval", "holdout") not in CLIENT_EVAL:
        raise bad_value("client_eval", cfg.client_eval, f"allowed: {', '.join(CLIENT_EVAL)}")
    init = OmegaConf.select(cfg, "model.init", default="default")
    if init not in MODEL_INITS:
        raise bad_value("model.init", init, f"allowed: {', '.join(MODEL_INITS)}")
    backend = OmegaConf.select(cfg, "state_store.backend")
    if backend not in ("memory", "disk"):
        raise bad_value("state_store.backend", backend, "allowed: memory, disk")
    _check_data(cfg)
    _check_algo(cfg)
    _check_trainer(cfg)
    _check_run(cfg)
    check_task(cfg)  # the task against the data, partition and algorithm (flx.task_spec)
    _check_ckpt(cfg)
    check_server(cfg)
    check_system(cfg)  # the device / latency simulator (flx.systems.params)


def _check_data(cfg: DictConfig) -> None:
    """The ``data.*`` protocol keys, ``partition.seed`` and ``eval_test`` (no torch import: the pre-run check)."""
    for key, split in (("val_fraction", "validation"), ("server_fraction", "server")):
        if cfg.data.get(key) is not None:
            _check(cfg, f"data.{key}", lambda v: 0 <= v < 1, f"must be in [0, 1) (0: no {split} split)")
    for key in ("data.split_seed", "partition.seed"):
        if OmegaConf.select(cfg, key) is not None:
            _int(cfg, key, 0, MAX_SEED, SEED_WHY)
    for key in ("data.standardize", "data.standardize_target", "eval_test"):
        if not isinstance(OmegaConf.select(cfg, key, default=False), bool):
            raise bad_value(key, OmegaConf.select(cfg, key), "must be true or false")
    split_file = cfg.data.get("split_file")
    if split_file is not None and not os.path.isfile(str(split_file)):
        raise bad_value("data.split_file", split_file, f"file not found (looked at {os.path.abspath(str(split_file))})")
