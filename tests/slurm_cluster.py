"""A one-node SLURM cluster on localhost for tests: installs Debian's slurm-wlm and
munge if missing, starts munged, slurmctld and slurmd with a config in a temporary folder, and stops what it started.
Any step that cannot be done here (not root, no package, a daemon that does not come up) skips the test with the
reason."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CONF = """ClusterName=flxtest
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={t}/state
SlurmdSpoolDir={t}/spool
SlurmctldPidFile={t}/slurmctld.pid
SlurmdPidFile={t}/slurmd.pid
SlurmctldLogFile={t}/log/slurmctld.log
SlurmdLogFile={t}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
NodeName={host} CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _run(*cmd: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)


def _install() -> None:
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if os.geteuid() != 0:
        pytest.skip("SLURM is not installed and installing it needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if _run("apt-get", "update", "-qq", env=env).returncode != 0:
        pytest.skip("apt-get update failed: cannot install slurm-wlm")
    proc = _run("apt-get", "install", "-y", "-qq", "slurm-wlm", "munge", env=env)
    if proc.returncode != 0:
        pytest.skip(f"apt-get install slurm-wlm munge failed: {proc.stderr.strip()[-300:]}")


def _start_munge() -> bool:
    """Starts munged unless one answers already; returns whether this call started it."""
    if _run("sh", "-c", "munge -n | unmunge").returncode == 0:
        return False
    for folder in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
        os.makedirs(folder, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    if not os.path.exists("/etc/munge/munge.key"):
        _run("mungekey", "--create")
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    _run("runuser", "-u", "munge", "--", "/usr/sbin/munged")
    for _ in range(50):
        if _run("sh", "-c", "munge -n | unmunge").returncode == 0:
            return True
        time.sleep(0.1)
    pytest.skip("munged did not start")


PORTS = (16817, 16818)
"""The controller's and the node daemon's ports: fixed, so one test cluster runs on a machine at a time."""


def _taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def slurm_cluster(tmp: Path) -> Iterator[dict[str, str]]:
    """Yields the environment (``SLURM_CONF``) of a running one-node cluster; stops it afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root")
    _install()
    taken = [port for port in PORTS if _taken(port)]
    if taken:  # another test cluster (a second test run on this machine): its controller would answer our commands
        pytest.skip(f"port {taken[0]} is taken: another SLURM cluster runs on this machine (a second test run?)")
    started_munge = _start_munge()
    for sub in ("state", "spool", "log"):
        (tmp / sub).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    (tmp / "slurm.conf").write_text(
        CONF.format(host=host, t=tmp, cpus=os.cpu_count() or 1, ctld_port=PORTS[0], d_port=PORTS[1])
    )
    env = {**os.environ, "SLURM_CONF": str(tmp / "slurm.conf")}
    logs = [open(tmp / "log" / name, "w") for name in ("ctld.stdout", "slurmd.stdout")]
    daemons = [
        subprocess.Popen(["/usr/sbin/slurmctld", "-D", "-i"], env=env, stdout=logs[0], stderr=subprocess.STDOUT),
        subprocess.Popen(["/usr/sbin/slurmd", "-D"], env=env, stdout=logs[1], stderr=subprocess.STDOUT),
    ]
    try:
        for _ in range(120):
            if "idle" in _run("sinfo", "-h", "-o", "%T", env=env).stdout:
                break
            time.sleep(0.5)
        else:
            pytest.skip(f"the local SLURM cluster did not come up: {(tmp / 'log' / 'ctld.stdout').read_text()[-300:]}")
        yield env
    finally:
        _run("scancel", "--user=root", env=env)
        for daemon in reversed(daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
        for log in logs:
            log.close()
        if started_munge and os.path.exists("/run/munge/munged.pid"):
            _run("sh", "-c", "kill $(cat /run/munge/munged.pid)")
