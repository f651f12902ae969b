"""CPU threads per process: what ``num_threads: auto`` (the default) resolves to, and OpenMP's wait policy.

``auto`` is this process's share of the cores it may use:

* the cores: the physical cores of the CPU affinity mask (``os.sched_getaffinity``: ``taskset``, ``numactl``, a
  SLURM step's binding; the hyper-threads of one core count once, as torch's default count on its MKL builds), capped
  by the cgroup CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``, the smallest over the
  process's cgroup and its ancestors: Docker's ``--cpus``, Kubernetes limits), rounded down (a quota of 2.5 CPUs
  gives 2 threads: a third thread would be throttled by the quota);
* the share: divided by the run's ranks on this node (``LOCAL_WORLD_SIZE`` of torchrun, SLURM's
  ``SLURM_NTASKS_PER_NODE``, else ``trainer.devices``: every rank of ``trainer=ddp``, forked or spawned, gets its own);
  under SLURM with ``--cpus-per-task`` the share is ``SLURM_CPUS_PER_TASK`` itself (capped by the cores above);
* at least 1;
* and 1 thread for a model whose local step is under :data:`SMALL_STEP_FLOPS` (:func:`by_work`, applied by
  ``flx.run.build`` once the net is built): ops that small gain nothing from a second thread and pay its wake-ups.

It is never the machine's load: the count depends only on what the process was given, so a seeded run gives the
same model each time on the same allocation (torch's reductions can round differently with another thread count).
The load is met instead by a short OpenMP wait, which ``train.py`` sets before torch starts its thread pool
(:func:`short_wait`): with the default policy a waiting thread spins (libgomp: 300,000 iterations, ~3 ms) before it
sleeps, so two processes whose threads outnumber the cores spin against each other's work; sleeping at once (the
passive policy) makes every parallel op of an idle machine wait for a thread to wake. A short spin keeps both:
the idle speed of the default and the busy speed of the passive policy (docs/configs.md#cpu-threads; the
measurements: docs/performance.md). This module imports neither torch nor Lightning: the config check uses it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

AUTO = "auto"
WAIT_POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
# spins of a waiting libgomp thread before it sleeps: ~10 us at libgomp's own estimate of 100,000 spins a millisecond,
# long enough to catch the next parallel op of the same step on an idle machine, too short to hold a core that another
# job needs (spin counts compared: docs/performance.md#cpu-threads-and-the-openmp-wait)
SHORT_SPIN = "1000"
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
CPU_SYSFS = Path("/sys/devices/system/cpu")


def short_wait(env: dict[str, str] | os._Environ = os.environ) -> None:
    """Makes a waiting OpenMP thread spin briefly, then sleep: ``GOMP_SPINCOUNT`` = :data:`SHORT_SPIN` for GNU libgomp
    (torch's PyPI wheels; it takes precedence over the policy there) and ``OMP_WAIT_POLICY=PASSIVE`` for any other
    runtime, unless the user set either. Read once, when torch loads its OpenMP runtime: call it before
    ``import torch``."""
    if WAIT_POLICY in env or SPIN_COUNT in env:
        return
    env[WAIT_POLICY] = "PASSIVE"
    env[SPIN_COUNT] = SHORT_SPIN


def affinity_cores(sysfs: Path | None = None) -> int:
    """The physical cores in this process's CPU affinity mask (:func:`physical_cores` under ``sysfs``, default
    :data:`CPU_SYSFS`; ``os.cpu_count()`` where the platform has no masks)."""
    if hasattr(os, "sched_getaffinity"):
        return physical_cores(os.sched_getaffinity(0), sysfs or CPU_SYSFS)
    return os.cpu_count() or 1


def physical_cores(cpus: Iterable[int], sysfs: Path = CPU_SYSFS) -> int:
    """The physical cores among the logical CPUs ``cpus``: SMT siblings (hyper-threads; ``cpu<i>/topology/
    thread_siblings_list`` under ``sysfs``) count once, as in torch's default count on its MKL builds (siblings share
    one core's vector units, which dense kernels keep busy); a CPU whose topology cannot be read counts alone."""
    groups = set()
    for cpu in cpus:
        try:
            groups.add((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            groups.add(f"cpu{cpu}")
    return len(groups)


def cgroup_cpus(root: Path = CGROUP_ROOT, membership: Path = PROC_CGROUP) -> float | None:
    """The CPU quota, in CPUs, of this process's cgroup (``membership``: ``/proc/self/cgroup``) under the cgroup file
    system at ``root``: the smallest over the cgroup and its ancestors, v2 and v1; None without a quota."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "-", "")
        if controllers == "":  # v2 (unified); under root itself, or root/unified on a hybrid v1 + v2 host
            quotas += [q for mount in (root, root / "unified") for q in _quotas(mount, path, _v2_quota)]
        elif "cpu" in controllers.split(","):  # v1: mounted as root/cpu,cpuacct or root/cpu
            quotas += [q for mount in {root / controllers, root / "cpu"} for q in _quotas(mount, path, _v1_quota)]
    return min(quotas, default=None)


def _quotas(mount: Path, path: str, read: Any) -> list[float]:
    """The quotas ``read`` finds in the cgroup's folder under ``mount`` and its ancestors' up to the mount. Where the
    cgroup's path is not there (a container that mounts its own cgroup as the root) only the mount's own."""
    parts = [p for p in path.strip().strip("/").split("/") if p]
    if not mount.joinpath(*parts).is_dir():
        parts = []
    folders = [mount.joinpath(*parts[:k]) for k in range(len(parts), -1, -1)]
    return [q for q in map(read, folders) if q is not None]


def _v2_quota(folder: Path) -> float | None:
    """``cpu.max`` (``"<quota> <period>"`` in microseconds, quota ``max``: none) as CPUs."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    """``cpu.cfs_quota_us / cpu.cfs_period_us`` (quota -1: none) as CPUs."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores(affinity: int | None = None, quota: float | None = None) -> int:
    """The cores this process may use: ``affinity`` capped by the cgroup ``quota`` rounded down, at least 1 (None:
    read them, :func:`affinity_cores` and :func:`cgroup_cpus`)."""
    cores = affinity_cores() if affinity is None else affinity
    quota = cgroup_cpus() if quota is None else quota
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


def node_ranks(trainer: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> int:
    """The run's processes on this node: ``LOCAL_WORLD_SIZE`` (torchrun), ``SLURM_NTASKS_PER_NODE`` (a SLURM job),
    else ``trainer.devices`` (an integer, or a list of device ids; ``auto`` and ``-1`` count as 1)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if _positive(env.get(key)):
            return int(env[key])
    devices = trainer.get("devices")
    if isinstance(devices, bool):
        return 1
    if isinstance(devices, int):
        return max(1, devices)
    if isinstance(devices, str) and "," in devices:  # Lightning's "0,1": device ids
        return len([d for d in devices.split(",") if d.strip()])
    if hasattr(devices, "__len__") and not isinstance(devices, str):  # a list of device ids
        return max(1, len(devices))
    return 1


def _positive(value: str | None) -> bool:
    return value is not None and value.strip().isdigit() and int(value) > 0


def auto_threads(trainer: Mapping[str, Any], env: Mapping[str, str] = os.environ, cores: int | None = None) -> int:
    """``num_threads: auto``: SLURM's ``SLURM_CPUS_PER_TASK`` (one rank's share already) capped by the ``cores`` this
    process may use, else ``cores`` divided by the ranks on this node (:func:`node_ranks`); at least 1. ``cores``
    None: :func:`usable_cores`."""
    cores = usable_cores() if cores is None else cores
    if _positive(env.get("SLURM_CPUS_PER_TASK")):
        return max(1, min(cores, int(env["SLURM_CPUS_PER_TASK"])))
    return max(1, cores // node_ranks(trainer, env))


SMALL_STEP_FLOPS = 1e8
"""A local step under this many floating-point operations runs on 1 thread with ``auto``: its ops are too small to
split, and each one would pay a sleeping thread's wake-up (``make train``'s MLP, ~1e7 a step, is under it; workload
(a)'s CNN, ~1e9, above; docs/performance.md#cpu-threads-and-the-openmp-wait)."""


def step_flops(net: Any, input_shape: Any, batch_size: int) -> float:
    """The floating-point operations of one local step of ``net`` on ``batch_size`` rows: 3x a forward (forward,
    and a backward of about twice its cost), counted by torch's ``FlopCounterMode`` on one zero row in eval mode (no
    random draw, no running statistic changes). A net it cannot count (integer inputs, ...) counts as large."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    training = net.training
    try:
        net.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            net(torch.zeros(1, *input_shape))
        return 3.0 * counter.get_total_flops() * batch_size
    except Exception:  # noqa: BLE001 -- a net that needs other inputs: the cores' share, as without the count
        return math.inf
    finally:
        net.train(training)


def by_work(share: int, flops: float) -> int:
    """``auto``'s threads once the net is known: 1 for a step under :data:`SMALL_STEP_FLOPS`, else ``share``."""
    return 1 if flops < SMALL_STEP_FLOPS else share


def resolve(num_threads: int | str | None, trainer: Mapping[str, Any]) -> int | None:
    """The torch threads per process that ``num_threads`` asks for: ``auto`` resolved (:func:`auto_threads`), an
    integer as given, None (torch's default) as None."""
    if num_threads == AUTO:
        return auto_threads(trainer)
    return None if num_threads is None else int(num_threads)


def startup_line(num_threads: int | str | None, trainer: Mapping[str, Any], used: int) -> str:
    """The line a run prints at start-up: the torch threads each process ``used`` and where the number comes from."""
    if num_threads == AUTO:
        slurm = os.environ.get("SLURM_CPUS_PER_TASK")
        why = (
            f"SLURM_CPUS_PER_TASK={slurm}"
            if _positive(slurm)
            else f"{_count(usable_cores(), 'usable core')} / {_count(node_ranks(trainer), 'process')} on this node"
        )
        small = f"; 1 thread: a local step under {SMALL_STEP_FLOPS:.0e} FLOPs" if used < auto_threads(trainer) else ""
        return f"CPU threads: {used} per process (num_threads=auto: {why}{small})"
    source = "torch's default" if num_threads is None else "as set"
    return f"CPU threads: {used} per process (num_threads={'null' if num_threads is None else num_threads}: {source})"


def _count(n: int, noun: str) -> str:
    """``1 process``, ``2 processes``, ``2 usable cores``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"
