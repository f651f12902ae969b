"""flx on a real SLURM cluster: slurmctld + slurmd on localhost (tests/slurm_cluster.py), one per module.

* ``scripts/slurm/train.sbatch`` submitted with 2 CPU tasks (``srun``, DDP over gloo) ends with the final line and
  the global model of the same run launched directly (``trainer=ddp trainer.devices=2``), bitwise; its log is plain
  lines (no progress-bar redraws) and its run folder holds one config and one W&B run, written by rank zero;
* ``srun --ntasks-per-node=2 python train.py trainer=ddp`` without a run folder: both tasks write to one folder
  (``srun -n 2``, which Lightning cannot read, gives one line);
* the same job sent its pre-timeout signal (SIGUSR1, what ``#SBATCH --signal=USR1@120`` sends) after round 3 finishes
  the round, checkpoints and requeues itself; SLURM restarts it (``SLURM_RESTART_COUNT=1``), it resumes from the
  last round checkpoint and ends with the uninterrupted run's model, bitwise;
* the same job sent SIGUSR1 2 s after it starts (flx is importing torch: before the first round) requeues itself at
  once (one line); SLURM restarts it, it starts afresh and ends with the uninterrupted run's model, bitwise;
* a Hydra ``-m`` sweep through ``hydra/launcher=slurm`` (submitit) runs one SLURM job per point: the default point's
  model equals the direct default run, bitwise; a bad value fails only its own job (one line); the launching process
  names every job's result and exits with status 2;
* a sweep job requeued from outside (preemption) restarts and resumes from its last round checkpoint, with
  ``ckpt_path`` left null, and ends with the default run's model, bitwise.

All runs use the default config (``make train``'s). Without root, or where slurmd cannot start, the tests skip with
the reason. The daemons are stopped, and every job cancelled, when the module ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runs import ENV, ROOT, assert_same_model, ckpt, flx_lines, run, wait_for
from slurm_cluster import slurm_cluster

from flx.wandb_files import load_run

pytestmark = pytest.mark.slow
SBATCH = ["sbatch", "--parsable", "--gres=none", "--ntasks-per-node=2", "--cpus-per-task=1"]
SLOW = ["+callbacks.slow._target_=helpers.SleepPerRound", "+callbacks.slow.seconds=0.4"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield {**env, **ENV, "FLX_PYTHON": sys.executable}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default run on 2 processes that Lightning starts itself: what a 2-task SLURM job must reproduce."""
    out = tmp_path_factory.mktemp("two")
    proc = run(out, "trainer=ddp", "trainer.devices=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def submit(env: dict[str, str], log: Path, *args: str) -> str:
    proc = subprocess.run(
        [*SBATCH, f"--output={log}", "scripts/slurm/train.sbatch", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def finished(env: dict[str, str], job: str) -> bool:
    return not subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip()


def test_train_sbatch_with_two_tasks_equals_the_direct_run(cluster, two_processes: Path, tmp_path: Path) -> None:
    log, out = tmp_path / "job.out", tmp_path / "run"
    job = submit(cluster, log, f"hydra.run.dir={out}", "logger=[csv,wandb]")  # W&B offline (tests/conftest.py)
    wait_for(lambda: finished(cluster, job), 300, f"job {job}")
    text = log.read_text()
    assert "1 node(s) x 2 task(s), start 0" in text and "final test_acc=" in text, text[-3000:]
    direct = (two_processes / "csv" / "metrics.csv").read_text()
    assert (out / "csv" / "metrics.csv").read_text() == direct  # every round's metrics, as the direct run logged them
    assert_same_model(ckpt(two_processes / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))
    assert "\r" not in text  # a log file gets lines, not progress-bar redraws
    assert sorted(p.name for p in (out / ".hydra").glob("config*.yaml")) == ["config.yaml"]  # rank zero wrote it
    (wandb_run,) = (out / "wandb").glob("offline-run-*")  # one W&B run, from rank zero, with the whole config
    config = load_run(wandb_run).config
    assert config["trainer"]["devices"] == 2 and config["algo"]["name"] == "fedavg" and config["seed"] == 0


def test_srun_without_a_run_dir_gives_every_task_one_folder(cluster, tmp_path: Path) -> None:
    """``srun --ntasks-per-node=2 python train.py trainer=ddp`` with the default run folder: both tasks name it
    slurm-<job>.<step> (not each its own clock's second), so the run has one folder holding one config."""
    cmd = [sys.executable, "train.py", "trainer=ddp", "algo.rounds=2", f"paths.log_dir={tmp_path}"]
    srun = ["srun", "--ntasks-per-node=2", *cmd]
    proc = subprocess.run(srun, cwd=ROOT, env=cluster, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.count("final test_acc=") == 1, proc.stderr[-3000:]
    (folder,) = (tmp_path / "train" / "runs").iterdir()
    assert folder.name.startswith("slurm-") and folder.name.endswith(".0"), folder.name
    assert sorted(p.name for p in (folder / ".hydra").glob("config*.yaml")) == ["config.yaml"]
    # `srun -n 2` is a layout Lightning cannot read (it counts tasks per node): one line, exit status 2
    proc = subprocess.run(["srun", "-n", "2", *cmd], cwd=ROOT, env=cluster, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and flx_lines(proc.stderr) == [
        "flx: error: SLURM: You set `--ntasks=2` in your SLURM bash script, but this variable is not supported. HINT: "
        "Use `--ntasks-per-node=2` instead"
    ], proc.stderr[-3000:]


def test_requeued_job_resumes_and_ends_with_the_uninterrupted_model(cluster, two_processes, tmp_path: Path) -> None:
    log, out = tmp_path / "job.out", tmp_path / "run"
    job = submit(cluster, log, f"hydra.run.dir={out}", *SLOW)
    wait_for(lambda: (out / "checkpoints" / "round_00003.ckpt").exists(), 240, "round 3's checkpoint")
    subprocess.run(["scancel", "--signal=USR1", job], env=cluster, check=True)  # what --signal=USR1@120 sends
    wait_for(lambda: log.exists() and "final test_acc" in log.read_text(), 300, "the requeued job to finish")
    text = log.read_text()
    assert "start 0" in text and "start 1" in text, text[-3000:]
    assert text.count("flx: requeued after round") == 1, text[-3000:]
    assert "(SIGUSR1); the job resumes from checkpoints/last.ckpt; exit status 138" in text, text[-3000:]
    assert_same_model(ckpt(two_processes / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))


def test_usr1_in_the_start_up_requeues_and_the_job_completes_bitwise(cluster, two_processes, tmp_path: Path) -> None:
    """SIGUSR1 (what ``--signal=USR1@120`` sends, early for a short time limit) 2 s after the job starts, while the
    tasks import torch: the job is requeued at once, not killed (before flx caught signals from the process start it
    died with status 138 here), restarts, and ends with the uninterrupted model, bitwise."""
    log, out = tmp_path / "job.out", tmp_path / "run"
    job = submit(cluster, log, f"hydra.run.dir={out}")
    wait_for(lambda: state(cluster, job) == "RUNNING", 120, f"job {job} to start")
    started = time.monotonic()
    wait_for(lambda: bool(steps(cluster, job)), 60, f"job {job}'s srun step")  # scancel --signal reaches steps
    stepped = time.monotonic()
    time.sleep(max(started + 2.0, stepped + 1.0) - time.monotonic())
    subprocess.run(["scancel", "--signal=USR1", job], env=cluster, check=True)
    wait_for(lambda: log.exists() and "final test_acc" in log.read_text(), 300, "the requeued job to finish")
    text = log.read_text()
    assert "start 0" in text and "start 1" in text, text[-3000:]
    line = "flx: requeued during start-up, before the first round (SIGUSR1); the job starts again; exit status 138"
    said = [x for x in text.splitlines() if x.startswith("flx: ") and not x.startswith("flx: job ")]  # not sbatch's
    assert said == [line], text[-3000:]
    assert_same_model(ckpt(two_processes / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))


def state(env: dict[str, str], job: str) -> str:
    listed = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
    return listed.stdout.strip()


def steps(env: dict[str, str], job: str) -> list[str]:
    """The job's running steps (``<job>.0`` for its srun), batch and extern steps left out."""
    listed = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], env=env, capture_output=True, text=True)
    return [s for s in listed.stdout.split() if s.split(".")[-1].isdigit()]


def test_sweep_through_the_submitit_launcher(cluster, default_run, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", "algo.lr=0.05,0.1,-1", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=cluster, capture_output=True, text=True, timeout=600, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("flx: job")]
    assert proc.returncode == 2 and len(lines) == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert lines[0].startswith("flx: job 0 (algo.lr=0.05): final test_acc=") and lines[0].endswith(f"({sweep / '0'})")
    assert lines[1].startswith("flx: job 1 (algo.lr=0.1): final test_acc=")
    assert lines[2] == "flx: job 2 (algo.lr=-1): failed (exit status 2): algo.lr=-1: must be > 0"
    assert flx_lines(proc.stderr)[-1] == "flx: error: 1 sweep job(s) failed: job 2 (algo.lr=-1)"
    assert_same_model(
        ckpt(default_run[0] / "checkpoints" / "last.ckpt"), ckpt(sweep / "0" / "checkpoints" / "last.ckpt")
    )
    assert not (sweep / "2" / "checkpoints").exists()  # bad input: nothing trained, nothing written
    logs = {p.parent.name: p.read_text() for p in sweep.glob(".submitit/*_*/*_log.out")}
    assert len(logs) == 3 and sum("final test_acc=" in text for text in logs.values()) == 2, logs.keys()
    assert os.path.getsize(sweep / "1" / "csv" / "metrics.csv") > 0


def test_preempted_sweep_job_resumes_from_its_last_checkpoint(cluster, default_run, tmp_path: Path) -> None:
    """A sweep job requeued from outside after round 3 (what preemption with requeue does) restarts with
    SLURM_RESTART_COUNT=1; with ckpt_path left null it resumes from its folder's last.ckpt (not from round 0) and ends
    with the default run's model, bitwise."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "train.py", "-m", "hydra/launcher=slurm", "seed=0", *SLOW, f"hydra.sweep.dir={sweep}"]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=cluster, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (sweep / "0" / "checkpoints" / "round_00003.ckpt").exists(), 240, "round 3's checkpoint")
        job = subprocess.run(["squeue", "-h", "-o", "%i"], env=cluster, capture_output=True, text=True).stdout.split()
        subprocess.run(["scontrol", "requeue", job[0]], env=cluster, check=True)
        stdout, stderr = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0 and "flx: job 0 (seed=0" in stdout, stdout[-3000:] + stderr[-3000:]
    (console,) = sweep.glob(".submitit/*/*_log.out")
    text = console.read_text()
    assert "Restoring states from the checkpoint path" in text and text.count("final test_acc=") == 1, text[-3000:]
    assert_same_model(
        ckpt(default_run[0] / "checkpoints" / "last.ckpt"), ckpt(sweep / "0" / "checkpoints" / "last.ckpt")
    )
