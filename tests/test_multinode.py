"""Multi-node launch without two machines: 2 "nodes" x 1 process on localhost end with the model of 1 node x 2.

Each flavour starts two processes as a two-node job would, through the environment its launcher sets:

* ``torchrun``: the real launcher, once per node (``torchrun --nnodes=2 --node-rank=<n> --nproc-per-node=1
  --master-addr/--master-port --rdzv-id=<job>``), which sets ``RANK``, ``GROUP_RANK``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ... (Lightning's ``TorchElasticEnvironment``);
  no ``hydra.run.dir``: both name ``torchrun-<job>`` (``flx.launch.shared_run_name``);
* ``slurm``: what ``srun`` sets for a 2-node, 1-task-per-node step (``SLURM_NTASKS``, ``SLURM_PROCID``,
  ``SLURM_NODEID``, ``SLURM_NNODES``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_JOB_ID``, ``SLURM_STEP_ID``, ...), without a
  SLURM controller (Lightning's ``SLURMEnvironment``, flx's SLURM code); no ``hydra.run.dir``: both name
  ``slurm-<job>.<step>``;
* ``lightning``: ``NODE_RANK`` with ``MASTER_ADDR`` / ``MASTER_PORT`` (Lightning's own environment, what a cluster
  without a scheduler uses), with one ``hydra.run.dir`` given to both.

All three run ``trainer=ddp trainer.devices=1 trainer.num_nodes=2`` and share one run folder, as the nodes of a
cluster share one over a network file system. Each must end with the global model (bitwise) and the metrics rows
(every value) of the same run as ``trainer=ddp trainer.devices=2`` on one machine, with one config, one data split
and one partition written (by global rank zero), no lock left behind, the final line printed once and no flx line
on stderr. ``num_threads=1`` is given: the thread count changes the order of the sums inside a matmul (2 threads a
process gave global models 1 ulp apart), and on one machine two "nodes" share its cores, which a default that
counts the ranks per node would not see.

Started by hand on each node without one ``hydra.run.dir``, the nodes would name their run folders after their own
clocks, and a SLURM task whose ``trainer.devices`` / ``trainer.num_nodes`` are not the job's layout would fail at the
fit: each stops with one line before anything is written.
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from runs import ENV, QUIET, ROOT, assert_same_model, ckpt, flx_lines, wait_for

RUN = [
    *QUIET,
    "trainer.accelerator=cpu",
    "model=logreg",
    "partition.num_clients=6",
    "algo.clients_per_round=3",
    "algo.local_steps=3",
    "algo.rounds=2",
    "num_threads=1",
    "trainer=ddp",
]
# what a launcher in the test's own environment (a CI job inside SLURM or torchrun) would leave for the runs
LAUNCH_ENV = ("SLURM_", "TORCHELASTIC_", "MASTER_", "RANK", "LOCAL_", "WORLD_SIZE", "NODE_RANK", "GROUP_", "ROLE_")
JOB = "4242"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_ENV) and k != "OMP_NUM_THREADS"}
    env.pop("WANDB_SERVICE", None)  # a run is a program of its own, not a client of the test's W&B service
    return {**env, **ENV, **extra}


def _node_commands(flavour: str, tmp: Path) -> tuple[list[tuple[list[str], dict[str, str]]], Path]:
    """The two nodes' ``(command, environment)`` and the run folder they share."""
    port, nodes = _free_port(), []
    args = [*RUN, "trainer.devices=1", "trainer.num_nodes=2", f"paths.log_dir={tmp / 'logs'}"]
    runs = tmp / "logs" / "train" / "runs"
    for node in (0, 1):
        if flavour == "torchrun":
            launcher = ["-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1"]
            launcher += ["--master-addr=127.0.0.1", f"--master-port={port}", f"--rdzv-id={JOB}"]
            nodes.append(([sys.executable, *launcher, "train.py", *args], _env({})))
        elif flavour == "slurm":
            slurm = {"SLURM_JOB_ID": JOB, "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}
            slurm |= {"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "localhost"}
            slurm |= {"SLURM_PROCID": str(node), "SLURM_NODEID": str(node), "SLURM_LOCALID": "0"}
            # Lightning takes the port from the job id (15000 + its last 4 digits): a free one here instead
            nodes.append(([sys.executable, "train.py", *args], _env({**slurm, "MASTER_PORT": str(port)})))
        else:
            folder = ["hydra.run.dir=" + str(runs / "shared")]
            lightning = {"NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            nodes.append(([sys.executable, "train.py", *args, *folder], _env(lightning)))
    name = {"torchrun": f"torchrun-{JOB}", "slurm": f"slurm-{JOB}.0", "lightning": "shared"}[flavour]
    return nodes, runs / name


def _run_nodes(
    nodes: list[tuple[list[str], dict[str, str]]], after: Path | None, logs: Path
) -> list[subprocess.CompletedProcess]:
    """Runs the nodes' commands, node 1 once node 0 has written ``after`` (None: at once), their output in files under
    ``logs``. A node that fails ends the other (which would wait for it in a collective), as does a limit of 5
    minutes: each with its whole process group (torchrun's agent and its worker)."""
    procs: list[subprocess.Popen] = []
    try:
        for k, (cmd, env) in enumerate(nodes):
            if procs and after is not None:
                wait_for(lambda: after.exists() or procs[0].poll() is not None, 120, str(after))
            out, err = (open(logs / f"node{k}.{name}", "w") for name in ("out", "err"))
            with out, err:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True))
        wait_for(lambda: all(p.poll() is not None for p in procs) or any(p.poll() for p in procs), 300, "the nodes")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    read = [((logs / f"node{k}.out").read_text(), (logs / f"node{k}.err").read_text()) for k in range(len(procs))]
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, read)]


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _rows(folder: Path) -> list[dict[str, str]]:
    with open(folder / "csv" / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("node", ["0", "1"])
def test_several_nodes_without_one_run_folder_give_one_line(tmp_path: Path, node: str) -> None:
    """``trainer.num_nodes=2`` started by hand on each node (``NODE_RANK``) without ``hydra.run.dir``: each node would
    name the run folder after its own clock, so the config check stops with one line, on every node's console, exit
    status 2, before anything is written (srun and torchrun with a rendezvous id name one folder themselves: above)."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, "train.py", *RUN, "trainer.devices=1", "trainer.num_nodes=2", f"paths.log_dir={logs}"]
    env = _env({"NODE_RANK": node, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [
        "flx: error: trainer.num_nodes=2: every node must write into one run folder: give all nodes the same "
        "hydra.run.dir=<a folder they share> (srun, and torchrun with --rdzv-id=<job id>, name one themselves)"
    ]
    assert not logs.exists()


@pytest.mark.parametrize(
    ("layout", "line"),
    [
        (
            ("trainer.devices=2", "trainer.num_nodes=2"),
            "trainer.devices=2: must be the SLURM job's tasks per node (--ntasks-per-node=1): one process per task",
        ),
        (
            ("trainer.devices=1", "trainer.num_nodes=1"),
            "trainer.num_nodes=1: must be the SLURM job's nodes (--nodes=2): one process per task",
        ),
    ],
    ids=["devices", "num_nodes"],
)
def test_a_layout_other_than_the_slurm_jobs_gives_one_line(tmp_path: Path, layout: tuple[str, ...], line: str) -> None:
    """A task of a 2-node, 1-task-per-node SLURM step whose ``trainer.devices`` / ``trainer.num_nodes`` say otherwise
    (Lightning found it only at the fit: a traceback, after the run had written its config): one line, exit status 2,
    nothing written."""
    out = tmp_path / "run"
    slurm = {"SLURM_JOB_ID": JOB, "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}
    slurm |= {"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_NODEID": "0"}
    cmd = [sys.executable, "train.py", *RUN, *layout, f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(slurm), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert [text for text in proc.stderr.splitlines() if text.strip()] == [f"flx: error: {line}"]
    assert not out.exists()


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.CompletedProcess]]:
    """The run on 1 node x 2 processes (``trainer.devices=2``; rank 1 forked from rank 0, ``ddp_start=auto``)."""
    out = tmp_path_factory.mktemp("one_node") / "run"
    cmd = [sys.executable, "train.py", *RUN, "trainer.devices=2", f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env({}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield out, proc


@pytest.mark.slow
@pytest.mark.parametrize("flavour", ["torchrun", "slurm", "lightning"])
def test_two_nodes_equal_one_node_with_two_processes(one_node, tmp_path: Path, flavour: str) -> None:
    """2 nodes x 1 process of ``flavour`` == 1 node x 2 processes: the model, the metrics, the files, the final line."""
    reference, ref_proc = one_node
    nodes, folder = _node_commands(flavour, tmp_path)
    # node 1 starts once node 0 has written the run's config (torchrun's agents start their workers together): a
    # process of node 1 that took itself for rank zero would then write config.1.yaml beside it
    after = None if flavour == "torchrun" else folder / ".hydra" / "config.yaml"
    done = _run_nodes(nodes, after, tmp_path)
    assert [p.returncode for p in done] == [0, 0], "\n".join(p.stderr[-3000:] for p in done)
    node0, node1 = done
    assert_same_model(ckpt(reference / "checkpoints" / "last.ckpt"), ckpt(folder / "checkpoints" / "last.ckpt"))
    rows = _rows(folder)
    assert rows == _rows(reference) and len(rows) == 2 * 2 + 1  # per round a validation and a training row; a test row
    # global rank zero wrote every file, once (no config.1.yaml of a node that took itself for rank zero), and the
    # run lock is gone; the other node wrote nothing, not even a folder of its own
    assert _files(folder) == _files(reference)
    assert {".hydra/config.yaml", ".hydra/partition.json"} <= set(_files(folder)) and ".flx.lock" not in _files(folder)
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]
    final = [line for line in ref_proc.stdout.splitlines() if line.startswith("final test_acc=")]
    assert len(final) == 1
    assert [line for line in node0.stdout.splitlines() if line.startswith("final ")] == final
    assert not [line for line in node1.stdout.splitlines() if line.startswith("final ")]
    assert flx_lines(node0.stderr) == flx_lines(node1.stderr) == []
