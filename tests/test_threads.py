"""``num_threads: auto`` (flx.threads): the cores a process may use, its share per rank, the short OpenMP wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from flx import threads
from flx.config import precheck
from flx.threads import auto_threads, cgroup_cpus, node_ranks, physical_cores, resolve, short_wait, usable_cores

ROOT = Path(__file__).resolve().parents[1]


class ThreadProbe(pl.Callback):
    """Test-only callback: each rank writes its torch threads and OpenMP wait policy to ``<out>/threads.<rank>.json``
    when its training starts (after :func:`flx.launch.fork_ranks`)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seen = {
            "threads": torch.get_num_threads(),
            "policy": os.environ.get("OMP_WAIT_POLICY"),
            "spin": os.environ.get("GOMP_SPINCOUNT"),
        }
        Path(self.out, f"threads.{trainer.global_rank}.json").write_text(json.dumps(seen))


def _tree(root: Path, files: dict[str, str]) -> Path:
    """Writes ``files`` (relative path: text) under ``root``; returns ``root``."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


# ------------------------------------------------------------------------------------------- the cores, the quota
@pytest.mark.parametrize(
    ("affinity", "quota", "cores"),
    [(6, None, 6), (6, 2.5, 2), (6, 8.0, 6), (6, 0.5, 1), (1, None, 1)],
)
def test_usable_cores_are_the_affinity_mask_capped_by_the_quota_rounded_down(
    affinity: int, quota: float | None, cores: int
) -> None:
    """min(|affinity|, floor(quota)), at least 1: a quota of 2.5 CPUs runs 2 threads (a third would be throttled)."""
    assert usable_cores(affinity, quota) == cores


def test_usable_cores_reads_the_affinity_mask(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(threads, "cgroup_cpus", lambda: None)
    monkeypatch.setattr(threads, "CPU_SYSFS", tmp_path)  # no topology: each CPU counts
    assert usable_cores() == 3


@pytest.mark.parametrize(("cpus", "cores"), [({0, 1, 2, 3}, 2), ({0, 2}, 1), ({0, 1}, 2), ({0, 1, 7}, 3)])
def test_hyper_threads_of_one_core_count_once(tmp_path: Path, cpus: set[int], cores: int) -> None:
    """4 logical CPUs on 2 cores (siblings 0,2 and 1,3, as Linux numbers them); cpu7's topology is not there."""
    siblings = {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}
    _tree(tmp_path, {f"cpu{c}/topology/thread_siblings_list": f"{s}\n" for c, s in siblings.items()})
    assert physical_cores(cpus, tmp_path) == cores


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        ({"user.slice/job/cpu.max": "250000 100000\n", "user.slice/cpu.max": "max 100000\n"}, 2.5),
        ({"user.slice/job/cpu.max": "max 100000\n", "user.slice/cpu.max": "100000 100000\n"}, 1.0),  # the parent's
        ({"user.slice/job/cpu.max": "max 100000\n", "user.slice/cpu.max": "max 100000\n"}, None),
        ({"user.slice/job/cpu.weight": "100\n"}, None),  # no cpu.max anywhere
    ],
)
def test_cgroup_v2_quota_is_the_smallest_over_the_cgroup_and_its_ancestors(
    tmp_path: Path, files: dict[str, str], cpus: float | None
) -> None:
    root = _tree(tmp_path / "cgroup", files)
    membership = _tree(tmp_path, {"self_cgroup": "0::/user.slice/job\n"}) / "self_cgroup"
    assert cgroup_cpus(root, membership) == cpus


def test_cgroup_v2_in_a_container_reads_the_mount_s_own_quota(tmp_path: Path) -> None:
    """A container mounts its own cgroup as the root; /proc/self/cgroup still names the host's path."""
    root = _tree(tmp_path / "cgroup", {"cpu.max": "150000 100000\n"})
    membership = _tree(tmp_path, {"self_cgroup": "0::/docker/0123abcd\n"}) / "self_cgroup"
    assert cgroup_cpus(root, membership) == 1.5


def test_cgroup_v2_on_a_hybrid_host_is_under_unified(tmp_path: Path) -> None:
    root = _tree(tmp_path / "cgroup", {"unified/job/cpu.max": "300000 100000\n"})
    membership = _tree(tmp_path, {"self_cgroup": "1:cpu:/\n0::/job\n"}) / "self_cgroup"
    assert cgroup_cpus(root, membership) == 3.0


@pytest.mark.parametrize(
    ("lines", "files", "cpus"),
    [
        (  # SLURM's cgroup v1 plugin: cpu,cpuacct co-mounted
            "5:cpu,cpuacct:/slurm/uid_1/job_7\n4:memory:/slurm/uid_1/job_7\n",
            {
                "cpu,cpuacct/slurm/uid_1/job_7/cpu.cfs_quota_us": "400000\n",
                "cpu,cpuacct/slurm/uid_1/job_7/cpu.cfs_period_us": "100000\n",
            },  # fmt: skip
            4.0,
        ),
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # no quota
        (
            "1:cpu:/a\n",
            {
                "cpu/a/cpu.cfs_quota_us": "-1\n",
                "cpu/a/cpu.cfs_period_us": "100000\n",
                "cpu/cpu.cfs_quota_us": "50000\n",
                "cpu/cpu.cfs_period_us": "100000\n",
            },
            0.5,
        ),  # fmt: skip
    ],
)
def test_cgroup_v1_quota_is_cfs_quota_over_period(
    tmp_path: Path, lines: str, files: dict[str, str], cpus: float | None
) -> None:
    root = _tree(tmp_path / "cgroup", files)
    membership = _tree(tmp_path, {"self_cgroup": lines}) / "self_cgroup"
    assert cgroup_cpus(root, membership) == cpus


def test_no_cgroup_file_system_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpus(tmp_path / "nothing", tmp_path / "no_self_cgroup") is None


# ------------------------------------------------------------------------------------------- the share per rank
@pytest.mark.parametrize(
    ("trainer", "env", "ranks"),
    [
        ({"devices": 1}, {}, 1),
        ({"devices": 2, "strategy": "ddp"}, {}, 2),
        ({"devices": [0, 1, 3]}, {}, 3),
        ({"devices": "0,1"}, {}, 2),
        ({"devices": "auto"}, {}, 1),
        ({"devices": 2}, {"LOCAL_WORLD_SIZE": "4"}, 4),  # torchrun's count wins
        ({"devices": 2}, {"SLURM_NTASKS_PER_NODE": "8"}, 8),
        ({"devices": 2}, {"LOCAL_WORLD_SIZE": ""}, 2),
    ],
)
def test_ranks_on_this_node(trainer: dict, env: dict[str, str], ranks: int) -> None:
    assert node_ranks(trainer, env) == ranks


@pytest.mark.parametrize(
    ("trainer", "env", "cores", "expected"),
    [
        ({"devices": 1}, {}, 32, 32),  # one process: every core it may use
        ({"devices": 2}, {}, 32, 16),  # trainer=ddp: each rank its share
        ({"devices": 4}, {}, 2, 1),  # more ranks than cores: 1 each, never 0
        ({"devices": 3}, {}, 8, 2),  # rounded down: 3 x 2 threads on 8 cores
        ({"devices": 1}, {"LOCAL_WORLD_SIZE": "4"}, 16, 4),
        ({"devices": 2}, {"SLURM_CPUS_PER_TASK": "6"}, 32, 6),  # --cpus-per-task is one rank's share already
        ({"devices": 2}, {"SLURM_CPUS_PER_TASK": "6", "SLURM_NTASKS_PER_NODE": "2"}, 4, 4),  # capped by the cores
    ],
)
def test_auto_is_the_share_of_the_usable_cores_per_rank(
    trainer: dict, env: dict[str, str], cores: int, expected: int
) -> None:
    assert auto_threads(trainer, env, cores) == expected


def test_resolve_keeps_integers_and_null(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "usable_cores", lambda: 6)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    assert [resolve("auto", {"devices": 2}), resolve(3, {"devices": 2}), resolve(None, {"devices": 2})] == [3, 3, None]


def test_the_config_check_takes_auto_null_and_integers() -> None:
    for value in ("auto", "null", "1", str(4 * (os.cpu_count() or 1))):
        assert str(precheck([f"num_threads={value}"]).num_threads) in (value, "None")


CNN = ["model=cnn", "data=synthetic", "data.loader.num_samples=400", "data.loader.input_shape=[3,32,32]"]


@pytest.mark.parametrize(("model", "expected"), [(["model=logreg"], 1), (CNN, 3)])
def test_build_runs_auto_s_count_or_one_thread_for_a_small_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: list[str], expected: int
) -> None:
    """``flx.run.build`` runs torch on ``auto``'s count (here 3 usable cores, one process) for the CNN (~1e9 FLOPs a
    step of 32 rows), on 1 thread for logistic regression on digits (3 x 2 x 64 x 10 x 32 ~ 1.2e5 FLOPs)."""
    from flx.run import build

    monkeypatch.setattr(threads, "usable_cores", lambda: 3)
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    try:
        build(precheck([*model, "logger=none", "callbacks=none", f"paths.output_dir={tmp_path}"]))
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(before)


def test_step_flops_are_three_forwards_of_the_batch() -> None:
    """A linear layer 64 -> 10 without bias: 2 x 64 x 10 FLOPs a row forward; a step of 32 rows is 3x that x 32."""
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10, bias=False)).train()
    assert threads.step_flops(net, (1, 8, 8), 32) == 3 * 2 * 64 * 10 * 32 and net.training
    assert threads.step_flops(torch.nn.Embedding(5, 2), (3,), 32) == float("inf")  # float zeros: not countable
    assert [threads.by_work(4, 0.99e8), threads.by_work(4, 1e8)] == [1, 4]


# ------------------------------------------------------------------------------------------- the wait policy
def test_the_short_wait_is_set_only_where_the_user_set_neither_variable() -> None:
    env: dict[str, str] = {}
    short_wait(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"}
    for mine in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        kept = dict(mine)
        short_wait(kept)
        assert kept == mine


def _idle_cpu_seconds(env: dict[str, str]) -> float:
    """CPU seconds a process uses while its main thread sleeps 0.5 s right after a parallel matmul on 2 threads."""
    code = (
        "import resource, time, torch\n"
        "torch.set_num_threads(2); x = torch.randn(512, 512); x @ x\n"
        "use = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])\n"
        "before = use(); time.sleep(0.5); print(use() - before)\n"
    )
    mine = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    cmd = [sys.executable, "-c", code]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**mine, **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stdout)


@pytest.mark.slow
def test_torch_s_thread_pool_honours_the_wait_settings() -> None:
    """With the passive policy torch's OpenMP worker sleeps once the parallel op is done, with ``ACTIVE`` it spins
    through the main thread's sleep (on a busy machine it gets less than a core, but some). On GNU libgomp (torch's
    PyPI wheels) ``GOMP_SPINCOUNT`` takes precedence over the policy: what ``short_wait`` relies on, so an endless
    spin count with ``PASSIVE`` spins, and the short one (~10 us) sleeps within the main thread's 0.5 s."""
    passive = _idle_cpu_seconds({"OMP_WAIT_POLICY": "PASSIVE"})
    active = _idle_cpu_seconds({"OMP_WAIT_POLICY": "ACTIVE"})
    assert passive < 0.02 < active, (passive, active)
    maps = Path("/proc/self/maps")  # this process has torch loaded: its OpenMP runtime is mapped
    if not maps.exists() or "libgomp" not in maps.read_text():
        pytest.skip("torch's OpenMP runtime here is not GNU libgomp (or /proc/self/maps is missing)")
    endless = _idle_cpu_seconds({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "INFINITE"})
    short: dict[str, str] = {}
    short_wait(short)
    assert _idle_cpu_seconds(short) < 0.02 < endless, (short, endless)


# ------------------------------------------------------------------------------------------- a 2-rank run
@pytest.mark.slow
def test_each_rank_of_a_two_process_run_gets_its_share(tmp_path: Path) -> None:
    """``trainer=ddp devices=2`` (the ranks forked, as on the CPU by default; the CNN, a large step): each rank runs
    torch on ``max(1, usable cores // 2)`` threads with the short wait ``train.py`` set, and the run says so once."""
    cores = usable_cores()
    share = max(1, cores // 2)
    unset = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "SLURM_CPUS_PER_TASK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env |= {"PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT / "src")])}
    env.pop("WANDB_SERVICE", None)
    cmd = [
        sys.executable, "train.py", *CNN, "partition.num_clients=4", "algo.clients_per_round=2", "algo.batch_size=8",
        "algo.rounds=1", "algo.local_steps=1", "logger=none", "checkpoint=null", "trainer=ddp", "trainer.devices=2",
        "callbacks.progress_bar=null", "trainer.enable_progress_bar=false",
        "+callbacks.probe._target_=test_threads.ThreadProbe", f"+callbacks.probe.out={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"threads.{rank}.json").read_text()) for rank in (0, 1)]
    assert seen == [{"threads": share, "policy": "PASSIVE", "spin": "1000"}] * 2
    line = f"CPU threads: {share} per process (num_threads=auto: {cores} usable core{'s' * (cores > 1)} / 2 processes"
    assert [x for x in proc.stdout.splitlines() if x.startswith("CPU threads:")] == [f"{line} on this node)"]
