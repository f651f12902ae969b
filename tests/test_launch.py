"""How flx is launched (flx.launch): ranks and run folders from the environment, resume of a requeued job, Hydra
sweeps with DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from runs import ENV, ROOT, flx_lines

from flx import launch
from flx.config import precheck
from flx.launch import prelaunch, process_rank, run_name, slurm_restarts
from flx.run import resume_path, train

TINY = ["model=logreg", "partition.num_clients=4", "algo.clients_per_round=2", "algo.local_steps=2", "algo.rounds=1"]
QUIET = ["callbacks=none", "trainer.enable_progress_bar=false", "logger=none"]
RANK_ENV = (
    "RANK",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
    "SLURM_RESTART_COUNT",
    "SLURM_STEP_ID",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in RANK_ENV:
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("env", "rank"),
    [
        ({}, 0),
        ({"RANK": "3", "LOCAL_RANK": "1"}, 3),  # torchrun
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "2"}, 2),  # srun, 4 tasks
        ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "LOCAL_RANK": "1"}, 1),  # Lightning's child in a 1-task job
        ({"LOCAL_RANK": "1"}, 1),  # Lightning's child on a workstation
        ({"NODE_RANK": "1"}, 1),  # node 1 of trainer.num_nodes=2 trainer.devices=1, started by hand
        ({"NODE_RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}, 1),  # its processes per node unknown: not 0
        ({"NODE_RANK": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, 9),  # 2 * 4 + 1
        ({"RANK": "5", "GROUP_RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, 5),  # torchrun: RANK
    ],
)
def test_process_rank_before_the_process_group_exists(clean_env, env: dict[str, str], rank: int) -> None:
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert process_rank() == rank


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({}, "2026-11-23_10-00-00"),
        ({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}, "2026-11-23_10-00-00"),  # one task
        ({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "2"}, "2026-11-23_10-00-00"),  # the batch shell, not a step
        ({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "3", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}, "slurm-42.3"),
        ({"TORCHELASTIC_RUN_ID": "job7", "WORLD_SIZE": "4", "RANK": "3"}, "torchrun-job7"),  # --rdzv-id, standalone
        ({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "4", "RANK": "3"}, "2026-11-23_10-00-00"),  # static: no id
        ({"TORCHELASTIC_RUN_ID": "job7", "WORLD_SIZE": "1", "RANK": "0"}, "2026-11-23_10-00-00"),  # one process
    ],
)
def test_every_task_of_a_slurm_step_names_the_same_run_folder(clean_env, env: dict[str, str], name: str) -> None:
    """Each task resolves hydra.run.dir itself: in a step of several tasks, or among the processes torchrun started
    with a rendezvous id, the name cannot come from the clock."""
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert run_name("2026-11-23_10-00-00") == name


def test_a_requeued_slurm_job_resumes_from_its_last_checkpoint(clean_env, tmp_path: Path) -> None:
    """ckpt_path=null in a job SLURM has restarted (a submitit sweep job after preemption) means auto: the run
    folder's last.ckpt; on the first start, or outside SLURM, a fresh start."""
    cfg = precheck([*TINY, *QUIET, f"paths.output_dir={tmp_path}"])
    train(cfg)
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.exists() and cfg.ckpt_path is None
    assert resume_path(cfg) is None
    clean_env.setenv("SLURM_JOB_ID", "7")
    assert slurm_restarts() == 0 and resume_path(cfg) is None
    clean_env.setenv("SLURM_RESTART_COUNT", "1")
    assert slurm_restarts() == 1 and resume_path(cfg) == str(last)


@pytest.mark.slow
def test_sweep_with_ddp_writes_only_its_job_folders_and_survives_a_bad_value(tmp_path: Path) -> None:
    """``-m`` with ``trainer=ddp``: each job's second process joins that job (not a new sweep in new folders), every
    job writes one config; a bad value fails its own job with one line, the others run, the exit status is 2."""
    sweep, logs = tmp_path / "sweep", tmp_path / "logs"
    cmd = [sys.executable, "train.py", "-m", "trainer=ddp", *TINY, *QUIET, "algo.lr=0.05,-1,0.1"]
    cmd += [f"hydra.sweep.dir={sweep}", f"paths.log_dir={logs}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = flx_lines(proc.stderr)
    assert lines == [
        "flx: error: job 1 (algo.lr=-1): algo.lr=-1: must be > 0",
        "flx: error: 1 sweep job(s) failed: job 1 (algo.lr=-1)",
    ]
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "2", "multirun.yaml"]
    for job, lr in (("0", 0.05), ("2", 0.1)):
        assert (sweep / job / "checkpoints" / "last.ckpt").exists()
        (config,) = (sweep / job / ".hydra").glob("config*.yaml")
        assert OmegaConf.load(config).algo.lr == lr
    assert not list((sweep / "1").rglob("*.ckpt")) and not logs.exists()  # no folders of a second sweep


def test_a_slurm_sweep_without_sbatch_gives_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", "algo.lr=0.05,0.1", f"hydra.sweep.dir={tmp_path}"]
    env = {**os.environ, **ENV, "PATH": str(tmp_path)}  # no sbatch there
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and flx_lines(proc.stderr) == [
        "flx: error: hydra/launcher='slurm': needs SLURM's sbatch on the PATH (run the sweep on a login node)"
    ], proc.stderr[-3000:]
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_ddp_ranks_start_together(tmp_path: Path, start: str) -> None:
    """``trainer=ddp trainer.devices=2`` on one machine: the second rank is not started by Lightning at
    ``trainer.fit``, once this process has imported torch and Lightning and loaded the data, to do all that again.
    ``ddp_start=spawn``: ``flx.launch.prelaunch`` starts it right after the config check, so the two start-ups
    overlap: rank 1 exists within the first half of rank 0's start-up. ``ddp_start=fork`` (the CPU default):
    ``fork_ranks`` forks it from rank 0 once that is loaded, so it starts at the fit at once. Both ranks write into
    one run folder and the run ends with status 0. In each rank the garbage collector is on again at the fit, with
    the start-up's objects (torch's and Lightning's modules) frozen out of its collections (``train.py``)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    out = tmp_path / "run"
    cmd = [sys.executable, "train.py", "trainer=ddp", f"ddp_start={start}", *TINY, *QUIET, f"hydra.run.dir={out}"]
    cmd += ["+callbacks.start_times._target_=helpers.StartTimes", f"+callbacks.start_times.out={marks}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((marks / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["global_rank"], r1["global_rank"]) == (0, 1)
    assert all(r["gc_enabled"] and r["gc_frozen"] > 100_000 for r in (r0, r1)), (r0, r1)
    startup = r0["fit_start"] - r0["created"]
    if start == "spawn":
        assert r1["created"] - r0["created"] < 0.5 * startup
    else:  # forked at the end of rank 0's start-up, and at the fit as soon as rank 0
        assert r1["created"] - r0["created"] > 0.5 * startup and r1["fit_start"] - r0["fit_start"] < 0.2 * startup
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["checkpoints"]
    assert (out / ".hydra" / "config.yaml").is_file() and not list(tmp_path.glob("*/logs"))


def test_a_composed_run_is_the_run_hydra_main_makes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train.py composes a single run once (``compose_run``) and runs it with ``run_composed`` instead of handing the
    command line to ``hydra.main``, which composes it twice more. The task gets the same config, Hydra's node
    (``HydraConfig``) is the same, the run folder is created, the return value comes back, and an error in the task
    is raised as it was raised."""
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from flx.config import CONFIG_DIR, compose_run
    from flx.launch import run_composed

    seen: list[tuple[str, str]] = []

    def task(cfg: object) -> int:
        assert (tmp_path / "run").is_dir()
        assert "hydra" not in cfg  # type: ignore[operator]
        seen.append((OmegaConf.to_yaml(HydraConfig.get()), OmegaConf.to_yaml(cfg)))
        return len(seen)

    overrides = ["model=mlp", "algo.rounds=3", "+trainer.max_time=null", f"hydra.run.dir={tmp_path / 'run'}"]
    cfg = compose_run(overrides, job_name="test_launch")  # Hydra names the job after the task's module
    assert "hydra" in cfg and cfg.algo.rounds == 3
    assert run_composed(cfg, task, CONFIG_DIR) == 1
    assert not HydraConfig.initialized()  # as after hydra.main: the run's Hydra config is gone
    monkeypatch.setattr(sys, "argv", ["test_launch.py", *overrides])
    hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")(task)()
    (ours, our_cfg), (hydras, hydra_cfg) = seen
    assert our_cfg == hydra_cfg
    assert ours == hydras

    def fails(cfg: object) -> None:
        raise ValueError("the task's own error")

    with pytest.raises(ValueError, match="the task's own error"):
        run_composed(compose_run(overrides, job_name="test_launch"), fails, CONFIG_DIR)


def test_the_config_check_imports_neither_torch_nor_lightning() -> None:
    """What runs before ``prelaunch`` starts the other ranks (and before a bad value's one-line error) stays light:
    ``precheck`` of a DDP run, partition included, imports no torch (~1.5 s) and no Lightning. A torch import at the
    top of the partition code once delayed rank 1 by ~2.5 s, which the start-time test above did not catch."""
    code = (
        "import sys; from flx.config import precheck; "
        "precheck(['trainer=ddp', 'trainer.devices=2', 'partition=iid', 'partition.num_clients=50']); "
        "print(sorted(m for m in ('torch', 'lightning') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("trainer", "env"),
    [
        ({"strategy": "ddp", "devices": 1}, {}),
        ({"strategy": "auto", "devices": 2}, {}),
        ({"strategy": "ddp", "devices": 2, "num_nodes": 2}, {}),
        ({"strategy": "ddp", "devices": 2}, {"SLURM_JOB_ID": "7"}),
        ({"strategy": "ddp", "devices": 2}, {"LOCAL_RANK": "1"}),
        ({"strategy": "ddp", "devices": "auto"}, {}),
    ],
)
def test_prelaunch_leaves_other_launches_alone(clean_env: pytest.MonkeyPatch, trainer: dict, env: dict) -> None:
    """One device, no DDP, several nodes, a SLURM job, an already launched rank, a device count Lightning resolves
    itself: prelaunch starts nothing and changes neither the environment nor the command line."""
    for key, value in env.items():
        clean_env.setenv(key, value)
    before, argv = dict(os.environ), list(sys.argv)
    prelaunch(trainer, "/tmp/run-folder", "fork")
    prelaunch(trainer, "/tmp/run-folder", "spawn")
    assert dict(os.environ) == before and sys.argv == argv and not launch.forking()


def test_prelaunched_ranks_skip_the_config_check(clean_env: pytest.MonkeyPatch) -> None:
    """prelaunch starts rank 1 with the same command line, its rank, and the mark that rank 0 has checked the config:
    that rank composes its command line without the checks (train.py), and a process nobody started this way does
    not."""
    started: list[tuple[list[str], dict[str, str]]] = []

    class FakePopen:
        def __init__(self, command: list[str], env: dict[str, str], **kwargs: object) -> None:
            started.append((command, env))

        def poll(self) -> int | None:  # still running (prelaunch's watcher asks)
            return None

        def wait(self) -> int:
            return 0

    clean_env.setattr(subprocess, "Popen", FakePopen)
    clean_env.setattr(os, "environ", dict(os.environ))
    clean_env.setattr(sys, "argv", ["train.py", "trainer=ddp", "algo.rounds=1"])
    assert not launch.prelaunched()
    try:
        prelaunch({"strategy": "ddp", "devices": 2}, "/tmp/run-folder", "spawn")
    finally:
        assert launch.join_children() == 0  # forgets the (fake) child
    [(command, env)] = started
    assert command[-3:] == ["trainer=ddp", "algo.rounds=1", "hydra.run.dir=/tmp/run-folder"]
    assert env["LOCAL_RANK"] == "1" and env[launch.PRELAUNCHED] == "1"
    assert os.environ["LOCAL_RANK"] == "0" and not launch.prelaunched()  # this process is rank 0: it checked
    clean_env.setattr(os, "environ", env)
    assert launch.prelaunched()


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_a_rank_that_fails_stops_the_run_at_once(tmp_path: Path, start: str) -> None:
    """A rank that dies (here at once, status 3) ends rank 0 within seconds with its status and one line, instead of
    leaving it waiting in init_process_group for the 30-minute timeout: a started one and a forked one alike."""
    script = tmp_path / "rank.py"
    script.write_text("import sys\nsys.exit(3)\n")
    code = (
        f"import os, sys, time; sys.argv = [{str(script)!r}]; from flx import launch; "
        f"launch.prelaunch({{'strategy': 'ddp', 'devices': 2}}, {str(tmp_path / 'run')!r}, {start!r}); "
        "rank = launch.fork_ranks(); rank and sys.exit(3); time.sleep(120)"
    )
    env = {k: v for k, v in os.environ.items() if k not in (*RANK_ENV, "WORLD_SIZE", "MASTER_PORT")}
    start_time = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert time.monotonic() - start_time < 60
    assert flx_lines(proc.stderr) == ["flx: error: rank 1 exited with status 3; the run stops"]


def test_a_forked_rank_dies_with_rank_zero(tmp_path: Path) -> None:
    """Rank 0 killed (SIGKILL, as the OOM killer would): the rank it forked does not live on in a collective."""
    pid_file = tmp_path / "child"
    code = (
        "import os, sys, time; from flx import launch; "
        "launch.prelaunch({'strategy': 'ddp', 'devices': 2, 'accelerator': 'cpu'}, '/tmp/unused'); "
        f"rank = launch.fork_ranks(); rank and open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    env = {k: v for k, v in os.environ.items() if k not in (*RANK_ENV, "WORLD_SIZE", "MASTER_PORT")}
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _alive(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the forked rank outlived rank 0"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("trainer", "start", "gpu", "forks"),
    [
        ({}, "auto", False, True),
        ({}, "auto", True, False),
        ({"accelerator": "cpu"}, "auto", True, True),
        ({"accelerator": "gpu"}, "auto", False, False),
        ({"accelerator": "gpu"}, "fork", True, True),
        ({"accelerator": "cpu"}, "spawn", False, False),
    ],
)
def test_ddp_start_auto_forks_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, trainer: dict, start: str, gpu: bool, forks: bool
) -> None:
    """``ddp_start=auto`` forks the ranks of a CPU run (``trainer.accelerator=cpu``, or ``auto`` on a machine without
    a GPU device node) and spawns them otherwise (a process that used CUDA cannot fork); fork and spawn are taken as
    said."""
    import glob

    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/nvidia0"] if gpu and "nvidia" in pattern else [])
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    assert launch._forks(trainer, start) is forks


def test_forking_rank_zero_runs_one_thread_until_the_fork_then_every_rank_num_threads() -> None:
    """Until the fork torch runs on one thread (a child of a process that had used OpenMP's threads hangs at its first
    parallel op); after it every rank runs on ``num_threads`` and a multi-threaded matmul completes on both."""
    code = (
        "import torch; from flx import launch; "
        "launch.prelaunch({'strategy': 'ddp', 'devices': 2, 'accelerator': 'cpu'}, '/tmp/unused'); "
        "torch.set_num_threads(launch.threads_until_fork(3)); before = torch.get_num_threads(); "
        "x = torch.randn(600, 600); x @ x; rank = launch.fork_ranks(); y = x @ x; "
        # one write per rank: the two ranks print at once into one pipe
        "import os; os.write(1, f'{rank} {before} {torch.get_num_threads()}\\n'.encode()); "
        "rank or launch.join_children()"
    )
    env = {k: v for k, v in os.environ.items() if k not in (*RANK_ENV, "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(proc.stdout.split("\n")[:2]) == ["0 1 3", "1 1 3"]
