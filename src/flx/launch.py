"""How this process was launched: its rank before the process group exists, its SLURM job, its Hydra sweep job.

flx runs as one process (``python train.py``), as N processes that Lightning starts itself (``trainer=ddp``), as N
SLURM tasks (``srun python train.py``, ``scripts/slurm/*.sbatch``) or as one job of a Hydra ``-m`` sweep, in this
process or on SLURM through submitit (``hydra/launcher=slurm``). These helpers give every launch the same answers:
which process writes the outputs (rank zero), which job of a sweep this is, and whether a requeued job must resume.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

# what Lightning's launcher exports for the processes it starts (lightning.fabric's subprocess launcher), and the thread
# count it exports for this process (keep_threads)
DDP_STRATEGIES = ("ddp", "flx_ddp")  # trainer.strategy values that run one process per device (flx.loop's DDP)
DDP_STARTS = ("auto", "fork", "spawn")  # how the other ranks of a one-machine DDP run start (prelaunch)
DDP_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS")


def process_rank() -> int:
    """This process's global rank, read from the environment so that it is known before the process group exists:
    ``RANK`` (torchrun), else ``SLURM_PROCID`` when the job step runs several tasks (``srun``), else ``LOCAL_RANK``
    (Lightning's child processes) on node ``NODE_RANK`` (Lightning's own multi-node environment; ``GROUP_RANK`` where
    that is unset, as Lightning reads it), else 0.

    On node ``n > 0`` Lightning numbers the processes ``n * trainer.devices + LOCAL_RANK``; the environment holds the
    processes per node only as ``LOCAL_WORLD_SIZE``, and without it this is ``n + LOCAL_RANK``: a lower bound, never 0,
    which is what the callers ask (whether this process writes the run's outputs)."""
    if os.environ.get("RANK"):
        return int(os.environ["RANK"])
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and os.environ.get("SLURM_PROCID"):
        return int(os.environ["SLURM_PROCID"])
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    node = int(os.environ.get("NODE_RANK") or os.environ.get("GROUP_RANK") or 0)
    return node * int(os.environ.get("LOCAL_WORLD_SIZE") or 1) + local


def first_on_console() -> bool:
    """Whether this process prints the lines every rank would print alike (a bad value, a stop on a signal): the first
    process of each console. In a SLURM job step that is global rank zero (``srun`` gathers every task's output into
    the job's one file); elsewhere the first process of each node (``LOCAL_RANK`` 0: torchrun, and Lightning, show a
    node's processes on the console of the command started on that node), so every node's console says why it
    stopped."""
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return process_rank() == 0
    return int(os.environ.get("LOCAL_RANK", "0") or 0) == 0


def run_name(timestamp: str) -> str:
    """The name of a single run's folder (``hydra.run.dir``, resolver ``flx_run_name``): :func:`shared_run_name` where
    the launch gives every process one, else ``timestamp``."""
    return shared_run_name() or timestamp


def shared_run_name() -> str | None:
    """The run folder's name that every process of a launch computes alike, where each would otherwise read its own
    clock (on its own node) and could name another folder: ``slurm-<job>.<step>`` in a SLURM job step of several tasks
    (``srun python train.py``; a requeued job computes it again, so it finds its checkpoints), ``torchrun-<run id>``
    for the processes torchrun started with a rendezvous id (``torchrun --standalone``, or ``--rdzv-id=<job id>`` on
    every node: ``TORCHELASTIC_RUN_ID``); None otherwise (torchrun's static rendezvous has the id ``none``: give every
    node the same ``hydra.run.dir``)."""
    job, step = slurm_job_id(), os.environ.get("SLURM_STEP_ID")
    if job is not None and step is not None and int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1:
        return f"slurm-{job}.{step}"
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic not in ("", "none") and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return f"torchrun-{elastic}"
    return None


def slurm_job_id() -> str | None:
    """The job id ``scontrol requeue`` takes (``<array job>_<task>`` for array jobs), or None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def slurm_restarts() -> int:
    """How often SLURM has requeued this job (``SLURM_RESTART_COUNT``; 0 outside SLURM or on the first start)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) if slurm_job_id() is not None else 0


def in_submitit_job() -> bool:
    """Whether this process is a job started by submitit (``hydra/launcher=slurm``): its failures must fail the job."""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def sweep_job() -> tuple[int, list[str]] | None:
    """``(job number, the job's overrides)`` for a job of a Hydra ``-m`` sweep, None for a single run."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return int(hc.job.num), list(hc.overrides.task)


def varying(overrides: list[str], sweep_dir: str) -> list[str]:
    """The overrides whose keys the sweep's command line sweeps over (``a=1,2``, ``range(...)``, ...; read from the
    ``multirun.yaml`` Hydra writes in the sweep folder); all of them if that is not known."""
    swept = swept_keys(os.path.join(sweep_dir, "multirun.yaml"))
    return [o for o in overrides if not swept or o.split("=", 1)[0].lstrip("+~") in swept]


def swept_keys(multirun_yaml: str) -> set[str]:
    """The keys a sweep's command line sweeps over, from the ``multirun.yaml`` Hydra writes in the sweep folder."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    if not os.path.isfile(multirun_yaml):
        return set()
    command_line = OmegaConf.select(OmegaConf.load(multirun_yaml), "hydra.overrides.task", default=[]) or []
    parsed = OverridesParser.create().parse_overrides(list(command_line))
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


_failed: list[tuple[str, int]] = []  # (job label, exit status) of the sweep jobs that failed, in this process


def record_failure(label: str, status: int) -> None:
    """Notes that a sweep job failed; the sweep goes on and the process exits with the worst status at the end."""
    _failed.append((label, status))


def failures() -> list[tuple[str, int]]:
    """The sweep jobs recorded as failed so far (:func:`record_failure`)."""
    return list(_failed)


def job_label() -> str:
    """``job 3 (algo.lr=0.1 seed=2)`` for a sweep job (its values of the swept keys), else the empty string: says
    which result is which."""
    from hydra.core.hydra_config import HydraConfig

    job = sweep_job()
    if job is None:
        return ""
    return f"job {job[0]} ({' '.join(varying(job[1], str(HydraConfig.get().sweep.dir)))})"


@contextmanager
def as_single_run() -> Iterator[None]:
    """Inside a sweep job, makes the process look like the single run of that job while it trains.

    Lightning starts the other ranks of ``trainer=ddp`` by re-running this script with ``sys.argv`` and Hydra's
    ``hydra.run.dir``. In a sweep job those are the whole sweep's command line (``-m`` and every value) and the run
    folder of a single run, so each child would run the whole sweep again, in new folders. Here ``sys.argv`` becomes
    this job's overrides and ``hydra.run.dir`` this job's output folder, so the children join this job. The
    variables Lightning sets for its children (``LOCAL_RANK``, ``MASTER_PORT``, ...) are removed after the job: left
    over, they would make the next job believe its processes were started by someone else, and wait for them."""
    job = sweep_job()
    if job is None:
        yield
        return
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict, read_write

    hc = HydraConfig.get()
    argv, run_dir, env = sys.argv, hc.run.dir, {k: os.environ.get(k) for k in DDP_ENV}
    with read_write(hc), open_dict(hc):
        hc.run.dir = hc.runtime.output_dir
    sys.argv = [argv[0], *job[1]]
    try:
        yield
    finally:
        sys.argv = argv
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        with read_write(hc), open_dict(hc):
            hc.run.dir = run_dir


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In a child process (``preexec_fn``): SIGKILL when the launching process dies (Linux), so a killed run leaves
    no rank waiting in a collective for ever."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_children: list = []
PRELAUNCHED = "FLX_PRELAUNCHED"  # "1" in the ranks prelaunch starts: rank 0 has checked their command line


def prelaunched() -> bool:
    """Whether this process is a rank that :func:`prelaunch` started: its command line passed rank 0's config check
    (``flx.config.compose_run`` with its checks), which it skips (~0.1-0.3 s, which rank 0 would otherwise wait for
    in ``init_process_group``)."""
    return os.environ.get(PRELAUNCHED) == "1"


def prelaunch(trainer: Mapping[str, Any], folder: str, start: str = "auto") -> None:
    """Starts, or plans, the other ranks of a one-machine ``trainer=ddp`` run; this process becomes rank 0
    (``LOCAL_RANK=0``), so Lightning finds the processes started and launches none. Every rank writes into the run
    folder ``folder``. Lightning's own launcher would start the other ranks at ``trainer.fit``, each then importing
    torch and Lightning and loading the data after this process has done so: seconds later, twice the work.

    ``start`` (``ddp_start``):

    * ``fork``: :func:`fork_ranks` forks them from this process once it has imported and loaded (``flx.run.train``,
      just before ``trainer.fit``). They start with everything loaded and share its memory pages (the dataset is
      in memory once), and this process loads the data beside its imports on the cores they have not taken yet
      (``flx.datamodules.prefetch``). CPU only: a process that has used CUDA cannot fork.
    * ``spawn``: started now, before this process imports anything heavy: each child re-runs this command with
      ``LOCAL_RANK=i`` as Lightning's launcher would, and every rank's start-up runs at once.
    * ``auto``: ``fork`` when the run is on the CPU (``trainer.accelerator=cpu``, or ``auto`` on a machine that shows
      no GPU device), else ``spawn``.

    Nothing happens for one device, several nodes, a SLURM job (SLURM starts the tasks), a process that was itself
    launched (``LOCAL_RANK`` / ``RANK`` set) or a sweep. The children die with this process, and this process exits
    with a child's failure status: at once, by a watcher thread, when a child fails while this process runs (the
    ranks left would otherwise wait in a collective for its timeout, 30 minutes), or when it succeeded itself
    (:func:`join_children`).
    """
    devices, strategy = trainer.get("devices"), trainer.get("strategy")
    if strategy not in DDP_STRATEGIES or not isinstance(devices, int) or devices < 2:
        return
    if int(trainer.get("num_nodes") or 1) != 1 or slurm_job_id() is not None:
        return
    if any(os.environ.get(k) for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")):
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NODE_RANK="0", WORLD_SIZE=str(devices))
    args = [a for a in sys.argv[1:] if not a.startswith("hydra.run.dir=")]
    if _forks(trainer, start):
        _fork_plan[:] = range(1, devices)
    else:
        import subprocess

        command = [sys.executable, os.path.abspath(sys.argv[0]), *args, f"hydra.run.dir={folder}"]
        for rank in range(1, devices):
            env = {**os.environ, "LOCAL_RANK": str(rank), PRELAUNCHED: "1"}
            _children.append(subprocess.Popen(command, env=env, preexec_fn=_die_with_parent))
        threading.Thread(target=_watch, args=(_children,), name="flx-rank-watch", daemon=True).start()
    os.environ["LOCAL_RANK"] = "0"
    sys.argv = [sys.argv[0], *args, f"hydra.run.dir={folder}"]


_fork_plan: list[int] = []  # the ranks fork_ranks starts from this process (prelaunch with start=fork)


def _forks(trainer: Mapping[str, Any], start: str) -> bool:
    """Whether ``start`` (``ddp_start``) means forking the ranks for this trainer config."""
    if start != "auto":
        return start == "fork"
    accelerator = str(trainer.get("accelerator") or "auto")
    if accelerator != "auto":
        return accelerator == "cpu"
    import glob  # a GPU this process could use: NVIDIA's or AMD's device nodes (without importing torch)

    return not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd"))


def forking() -> bool:
    """Whether :func:`fork_ranks` will fork the run's other ranks from this process: until then it is the run's only
    process, with every core of the machine to itself."""
    return bool(_fork_plan)


def threads_until_fork(num_threads: int | None) -> int | None:
    """The torch threads (``num_threads``) this process runs on until :func:`fork_ranks`: 1 while it is to fork the
    other ranks (OpenMP threads that have run are not forked: a child would hang at its first parallel op), else
    ``num_threads`` (None: torch's default). :func:`fork_ranks` gives every rank ``num_threads`` (or torch's default
    as found at the first call) once it has forked."""
    if not forking():
        return num_threads
    if not _threads_after_fork:
        import torch  # imported by then: the callers set torch's threads

        _threads_after_fork.append(int(num_threads or torch.get_num_threads()))
    return 1


_threads_after_fork: list[int] = []


def set_threads(threads: int) -> None:
    """Runs torch on ``threads``: from now on, or, while this process is to fork the other ranks, in every rank once
    :func:`fork_ranks` has forked them (until then it keeps one thread)."""
    if forking() and _threads_after_fork:
        _threads_after_fork[0] = threads
        return
    import torch

    torch.set_num_threads(threads)


def run_threads() -> int:
    """The torch threads each rank of this run trains on: what :func:`fork_ranks` will give the forked ranks while
    this process is to fork them (it holds 1 until then), else this process's current count."""
    if forking() and _threads_after_fork:
        return _threads_after_fork[0]
    import torch

    return torch.get_num_threads()


class _Forked:
    """A rank :func:`fork_ranks` forked, with the part of ``subprocess.Popen``'s interface the watcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:  # the watcher thread and join_children may ask at once: one of them reaps the child
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.02)
        return int(self.returncode)  # type: ignore[arg-type]


def fork_ranks() -> int:
    """Forks the ranks :func:`prelaunch` planned (``start=fork``) and returns this process's rank: 0 here, ``i`` in the
    child that continues from here as rank ``i`` (``LOCAL_RANK=i``; it dies with this process). Call it once the
    run's start-up is done and before any thread other than the caller's runs (a forked child has only the forking
    thread) and before torch has run on more than one thread (OpenMP's threads are not forked: a child that used
    them would hang)."""
    if not _fork_plan:
        return process_rank()
    ranks, _fork_plan[:] = list(_fork_plan), []
    import gc

    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    # the objects made so far (torch's and Lightning's modules, the run) are left out of every later collection: a
    # collection would otherwise write to each of them and copy every page rank 0 and its children share
    gc.freeze()
    for rank in ranks:
        pid = os.fork()
        if pid == 0:
            _children.clear()
            os.environ.update({"LOCAL_RANK": str(rank), PRELAUNCHED: "1"})
            _die_with_parent()
            if os.getppid() != parent:  # rank 0 died before the line above took effect
                os._exit(1)
            _set_threads()
            return rank
        _children.append(_Forked(pid))
    threading.Thread(target=_watch, args=(_children,), name="flx-rank-watch", daemon=True).start()
    _set_threads()
    return 0


def keep_threads(num_threads: int | None) -> None:
    """Exports ``num_threads`` (when set) as ``OMP_NUM_THREADS``, so that Lightning keeps it: its DDP launcher sets
    ``torch.set_num_threads(cores // processes on this node)`` at ``trainer.fit`` unless that variable is set
    (``lightning.fabric.utilities.distributed._set_num_threads_if_needed``). It replaced ``num_threads`` on every DDP
    run, silently, and made the run's floating-point sums depend on how the ranks were laid out over machines: on one
    2-core machine 1 node x 2 processes ran 1 thread a process and 2 "nodes" x 1 process 2, and the two ended with
    global models 1 ulp apart (``tests/test_multinode.py``). ``null`` leaves the choice to Lightning, as before.
    Called for DDP runs only (``flx.run.build_trainer``): a single process has no launcher, and the variable would
    outlive a run called in-process (a sweep job restores it, :func:`as_single_run`)."""
    if num_threads:
        os.environ["OMP_NUM_THREADS"] = str(int(num_threads))


def _set_threads() -> None:
    """After the fork: the torch threads :func:`threads_until_fork` held back."""
    if _threads_after_fork:
        import torch

        torch.set_num_threads(_threads_after_fork[0])


def exit_status(code: int) -> int:
    """A child's ``returncode`` as an exit status: the code itself, or ``128 + N`` for a child killed by signal N."""
    return 128 - code if code < 0 else code


_expected: list[int] = []  # the exit status of the other ranks that is not a failure (expect_exit)


def expect_exit(status: int) -> None:
    """Notes that the other ranks exit with ``status`` because they stop where this process stops: a signal every
    rank took at one round boundary (:func:`flx.signals.stopping`, called on rank 0 before any rank can exit)."""
    _expected[:] = [status]


def _watch(children: list, interval: float = 0.5) -> None:
    """Rank 0's watcher (a daemon thread): ends this process with the status of the first child that fails, with one
    line; returns once :func:`join_children` has taken the children. A child that exits with the status of the signal
    this process stops on stopped with it at the same round boundary (:func:`expect_exit`): not a failure."""
    while children:
        for rank, child in enumerate(list(children), start=1):
            code = child.poll()
            if code and exit_status(code) not in _expected:
                print(f"flx: error: rank {rank} exited with status {exit_status(code)}; the run stops", file=sys.stderr)
                sys.stderr.flush()
                os._exit(exit_status(code))
        time.sleep(interval)


def join_children() -> int:
    """Waits for the ranks :func:`prelaunch` started (this process succeeded): 0, or the first failing child's exit
    status."""
    codes = [child.wait() for child in _children]
    _children.clear()
    return next((exit_status(code) for code in codes if code), 0)


def run_composed(cfg: Any, task: Callable[[Any], Any], config_dir: str) -> Any:
    """Runs ``task`` on ``cfg`` (``flx.config.compose_run``'s config of a single run, Hydra's node included) as
    ``hydra.main`` runs a single run, and returns what ``task`` returned (raises what it raised).

    The same steps as Hydra's own runner (``hydra._internal.hydra.Hydra.run``): Hydra's logging
    (``hydra/hydra_logging``, ``hydra.verbose``), Hydra's callbacks (``hydra.callbacks``), then
    ``hydra.core.utils.run_job``, which sets ``HydraConfig``, creates the run folder, configures the job's logging and
    ``hydra.job.env_set`` and calls ``task`` with the config less Hydra's node. What it saves is the composition:
    ``hydra.main`` composes the command line twice (once for the run mode, once for the run), ~0.15 s each after the
    config check composed it already (``tests/test_launch.py`` compares the two runs).
    """
    from hydra import initialize_config_dir
    from hydra._internal.callbacks import Callbacks  # what Hydra's runner builds from hydra.callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext

    with initialize_config_dir(config_dir=config_dir, version_base="1.3", job_name=cfg.hydra.job.name):
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)  # as hydra.main's composition does
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name=cfg.hydra.job.config_name)
        context = HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=callbacks)
        ret = run_job(task, cfg, job_dir_key="hydra.run.dir", job_subdir_key=None, hydra_context=context)
        callbacks.on_run_end(config=cfg, config_name=cfg.hydra.job.config_name, job_return=ret)
    return ret.return_value
