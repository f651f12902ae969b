"""Sections (c) and (d) of ``scripts/gpu_check.py``: runs of ``train.py`` in subprocesses.

(c) 1 process against 2: both processes started as one node each of a 2-node job (torchrun's environment), so that
on one GPU both use ``cuda:0`` with gloo; NCCL with Lightning's own launcher where 2+ GPUs exist. (d) ``kill -9`` in
the middle of round 5 (``tests/helpers.py``'s ``KillMidRound``, as ``tests/test_crash_safety.py`` uses it), then
``ckpt_path=auto``, with ``trainer.deterministic=true``: bitwise the uninterrupted model.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from gpu_check_common import MODEL_TOL, QUIET, ROOT, Row, Setup, timed_row

KILL = ("+callbacks.kill._target_=helpers.KillMidRound", "+callbacks.kill.round=4")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A subprocess's environment: flx's sources and the test helpers first on the path (whatever the path held
    stays after them: the carried wheels on the GPU machine), warnings off, no W&B service of this process."""
    path = [str(ROOT / "tests"), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(path), **(extra or {})}
    env.pop("WANDB_SERVICE", None)
    return env


def _command(out: Path, args: Sequence[str]) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *QUIET, *args, f"hydra.run.dir={out}"]


def train_py(out: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python train.py <args>`` in a subprocess writing to ``out``."""
    return subprocess.run(_command(out, args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env())


def must(proc: subprocess.CompletedProcess, status: int = 0) -> None:
    if proc.returncode != status:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise RuntimeError(f"train.py exited {proc.returncode} (expected {status}): {tail[0][:300]}")


def state(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def model_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, bool]:
    """``(max |a - b| over the float tensors, bitwise equal)``; different keys give inf."""
    if a.keys() != b.keys():
        return math.inf, False
    diffs = [float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point() and a[k].numel()]
    return max(diffs, default=0.0), all(torch.equal(a[k], b[k]) for k in a)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_nodes(out: Path, args: Sequence[str], timeout: float = 300) -> list[int]:
    """Two processes of one job, each started as one node of 2 with one device (torchrun's environment): on one GPU
    both use ``cuda:0``. Returns their exit statuses."""
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    job |= {"LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "gpu-check"}
    nodes = ["trainer.strategy=ddp", "trainer.devices=1", "trainer.num_nodes=2", "trainer.process_group_backend=gloo"]
    procs = [
        subprocess.Popen(
            _command(out, [*args, *nodes]), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=_env({**job, "RANK": str(r), "GROUP_RANK": str(r), "NODE_RANK": str(r)}),
        )
        for r in range(2)
    ]  # fmt: skip
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        codes.append(p.returncode)
    return codes


def _ranks(s: Setup, name: str, run: Callable[[Path], None]) -> Row:
    args = ["algo.rounds=3", f"trainer.accelerator={s.device}"]
    one = s.work / "c-one"
    if not (one / "checkpoints" / "last.ckpt").is_file():
        must(train_py(one, *args))
    two = s.work / f"c-{name}"
    run(two)
    diff, same = model_diff(state(one), state(two))
    return Row(
        "c", f"2 processes ({name}) vs 1 on {s.device}, 3 rounds", "passed" if diff <= MODEL_TOL else "FAILED",
        value=f"max abs param diff {diff:.2e}{' (bitwise)' if same else ''}", limit=f"<= {MODEL_TOL:g}",
        detail={"max_abs_diff": diff, "bitwise": same},
    )  # fmt: skip


def _gloo(s: Setup, out: Path) -> None:
    codes = two_nodes(out, ["algo.rounds=3", f"trainer.accelerator={s.device}"])
    if codes != [0, 0]:
        raise RuntimeError(f"the 2 processes exited {codes}")


def _nccl(s: Setup, out: Path) -> None:
    must(train_py(out, "algo.rounds=3", "trainer=ddp", "trainer.accelerator=cuda", "trainer.devices=2"))


def ranks_rows(s: Setup) -> list[Row]:
    """Section (c): 1 process == 2 processes, gloo on one device, NCCL on two GPUs."""
    rows = [timed_row("c", "2 processes (gloo)", lambda: _ranks(s, "gloo", lambda out: _gloo(s, out)))]
    if s.device != "cuda":
        rows.append(Row("c", "2 processes (nccl)", "skipped: no CUDA (NCCL runs on GPUs only)"))
    elif torch.cuda.device_count() < 2:
        rows.append(Row("c", "2 processes (nccl)", "skipped: 1 GPU (NCCL needs one GPU per process)"))
    else:
        rows.append(timed_row("c", "2 processes (nccl)", lambda: _ranks(s, "nccl", lambda out: _nccl(s, out))))
    return rows


def _resume(s: Setup) -> Row:
    # every round checkpointed (checkpoint.min_seconds=0): a fast device finishes the rounds before the kill inside
    # the default throttle's 5 s, and the check would then have no checkpoint to resume from
    args = ["algo.rounds=6", "trainer.deterministic=true", f"trainer.accelerator={s.device}"]
    args.append("checkpoint.min_seconds=0")
    full, out = s.work / "d-full", s.work / "d-killed"
    must(train_py(full, *args))
    must(train_py(out, *args, *KILL), -signal.SIGKILL)
    at = torch.load(out / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["flx"]["round"]
    resumed = train_py(out, *args, "ckpt_path=auto")
    must(resumed)
    diff, same = model_diff(state(full), state(out))
    return Row(
        "d", f"kill -9 in round 5, resume (deterministic) on {s.device}", "passed" if same else "FAILED",
        value=f"resumed from round {at}; {'bitwise equal' if same else f'max abs param diff {diff:.2e}'}",
        limit="bitwise equal",
    )  # fmt: skip


def resume_rows(s: Setup) -> list[Row]:
    """Section (d): kill -9 in the middle of a round, resume: bitwise the uninterrupted model."""
    return [timed_row("d", "kill -9 and resume", lambda: _resume(s))]
