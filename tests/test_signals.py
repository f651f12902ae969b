"""Signals and the exit status a scheduler reads (:mod:`flx.signals`; docs/state_and_resume.md, "Signals").

* the status of each caught signal is 128 + N (SIGINT 130, SIGTERM 143, SIGUSR1 138, SIGUSR2 140), and each way of
  stopping has its one line;
* the handler notes the first signal only; a second SIGINT / SIGTERM ends the process at once with one line and its
  status; after a requeue, SLURM's SIGTERM ends it at once and silently; importing the module loads no third-party
  package (``train.py`` installs the handlers before its imports);
* Lightning's signal connector is switched off, so its SIGTERM handler never replaces flx's;
* rank 0's watcher does not count a rank that exits with the run's agreed signal status as a failure;
* outside a run (the launcher of a SLURM sweep) a signal stops the process at once;
* slow: SIGTERM, SIGINT and SIGUSR1 (outside SLURM) in the middle of round 5 finish the round, save it, print one
  line and exit with their status; the resumed run ends with the uninterrupted model, bitwise; without checkpoints
  the run stops at the same boundary and says nothing was saved. A SIGTERM during the start-up writes nothing
  (pre-existing files unchanged). A SIGUSR1 at fit start inside a SLURM job requeues at once (a stub ``scontrol``)
  and the new start ends with the uninterrupted model. A SIGTERM sent to rank 0 of a 2-rank run stops both ranks at
  the same round with one line.
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import ENV, QUIET, ROOT, assert_same_model, ckpt, flx_lines, run, wait_for

from flx import launch, signals

KILL = ["+callbacks.kill._target_=helpers.KillMidRound", "+callbacks.kill.round=4"]
SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "flx", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
SLURM_ENV |= {"SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}


def test_status_of_each_caught_signal() -> None:
    assert signals.CAUGHT == (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    assert [signals.status(s) for s in signals.CAUGHT] == [143, 130, 138, 140]
    assert signals.requeues(signal.SIGUSR1, True, signal.SIGUSR1)
    assert not signals.requeues(signal.SIGUSR1, False, signal.SIGUSR1)
    assert not signals.requeues(signal.SIGTERM, True, signal.SIGUSR1)


def test_one_line_for_each_way_of_stopping() -> None:
    term, usr1 = signal.SIGTERM, signal.SIGUSR1
    assert signals.Stop(term).line() == (
        "flx: stopped by SIGTERM during start-up, before the first round; nothing to save; exit status 143"
    )
    assert signals.Stop(signal.SIGINT, rounds=5, saved="/r/checkpoints/last.ckpt").line() == (
        "flx: stopped by SIGINT after round 5, saved in /r/checkpoints/last.ckpt (resume with ckpt_path=auto); "
        "exit status 130"
    )
    assert signals.Stop(term, rounds=5).line() == (
        "flx: stopped by SIGTERM after round 5; no checkpoint (checkpoint=null); exit status 143"
    )
    assert signals.Stop(usr1, rounds=5, saved="x", requeued=True).line() == (
        "flx: requeued after round 5 (SIGUSR1); the job resumes from checkpoints/last.ckpt; exit status 138"
    )
    assert signals.Stop(term, rounds=2, saved="c").line("job 1 (a=1)") == (
        "flx: job 1 (a=1): stopped by SIGTERM after round 2, saved in c (resume with ckpt_path=auto); exit status 143"
    )
    assert signals.Stop(usr1, requeued=True).line() == (
        "flx: requeued during start-up, before the first round (SIGUSR1); the job starts again; exit status 138"
    )


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


def test_handler_keeps_the_first_signal_and_a_second_stops_at_once() -> None:
    """SIGUSR1 is noted; SIGUSR2 after it changes nothing; a SIGTERM then ends the process at once: one line, 143.
    No third-party package is loaded by the module that ``train.py`` imports first."""
    proc = _python(
        "import os, signal, sys\n"
        "from flx import signals\n"
        "assert not {m.split('.')[0] for m in sys.modules} & {'torch', 'lightning', 'hydra', 'omegaconf'}\n"
        "signals.install()\n"
        "os.kill(os.getpid(), signal.SIGUSR1); os.kill(os.getpid(), signal.SIGUSR2)\n"
        "print(signals.pending(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('not reached')\n"
    )
    assert proc.returncode == 143 and proc.stdout == "10\n", proc.stderr
    assert proc.stderr == (
        "flx: stopped at once by a second signal (SIGTERM after SIGUSR1); the newest complete checkpoint is kept "
        "(resume with ckpt_path=auto); exit status 143\n"
    )


def test_a_second_signal_on_a_rank_other_than_zero_ends_it_silently() -> None:
    """In a SLURM job step of two tasks, task 1 still importing when task 0 requeues the job gets SLURM's SIGTERM
    after its own SIGUSR1: it exits 143 without a second line (rank 0 said what happened); task 0 would print it."""
    code = (
        "import os, signal\n"
        "from flx import signals\n"
        "signals.install()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('not reached')\n"
    )
    for procid, said in (("1", ""), ("0", "flx: stopped at once by a second signal (SIGTERM after SIGUSR1)")):
        env = {**os.environ, **ENV, "SLURM_NTASKS": "2", "SLURM_PROCID": procid}
        env.pop("RANK", None)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert (proc.returncode, proc.stdout, proc.stderr[: len(said)]) == (143, "", said), proc.stderr
        assert proc.stderr.count("\n") == bool(said)


def test_after_a_requeue_slurms_sigterm_ends_the_process_silently() -> None:
    proc = _python(
        "import os, signal\n"
        "from flx import signals\n"
        "signals.install()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "signals.stopping(signals.Stop(signal.SIGUSR1, rounds=3, requeued=True))\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('not reached')\n"
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (138, "", "")


def test_outside_a_run_a_signal_stops_at_once() -> None:
    """``at_once`` (the launching process of a sweep on SLURM, which runs no round): Ctrl-C stops it at once with
    one line and 130, as Python's KeyboardInterrupt did before, not noted for a round that never comes."""
    proc = _python(
        "import os, signal\n"
        "from flx import signals\n"
        "signals.install()\n"
        "with signals.at_once():\n"
        "    with signals.deferred():\n"
        "        os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    print(signals.pending(), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "print('not reached')\n"
    )
    assert (proc.returncode, proc.stdout) == (130, "10\n")
    assert proc.stderr == "flx: stopped by SIGINT, no run in progress; exit status 130\n"


def test_lightning_signal_handling_is_switched_off() -> None:
    """Lightning registers its SIGTERM handler at every fit / test; flx's connector leaves flx's handler in place."""
    import lightning.pytorch as pl

    from flx import loop

    trainer = loop.install(pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False))
    assert isinstance(trainer._signal_connector, loop.NoSignals)
    before = signal.getsignal(signal.SIGTERM)
    try:
        signals.install((signal.SIGTERM,))
        trainer._signal_connector.register_signal_handlers()
        assert signals.installed(signal.SIGTERM) and not trainer.received_sigterm
        trainer._signal_connector.teardown()
        assert signals.installed(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)


class _Child:
    """A rank as the watcher sees it: exits with ``code`` and, on its second poll, leaves the watched list."""

    def __init__(self, code: int, children: list) -> None:
        self.code, self.children, self.polls = code, children, 0

    def poll(self) -> int:
        self.polls += 1
        if self.polls == 2:
            self.children.clear()
        return self.code


def test_watcher_leaves_a_rank_that_stopped_on_the_agreed_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 received SIGTERM: a rank exiting with 143 stopped at the same round boundary (not a failure); one
    exiting with 1 failed and ends rank 0 with its status."""

    def exit_(code: int) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(launch, "_expected", [])
    monkeypatch.setattr(signals, "_stop", [])
    signals.stopping(signals.Stop(signal.SIGTERM, rounds=3))  # rank 0 took SIGTERM at round 3's end
    monkeypatch.setattr(launch.os, "_exit", exit_)
    children: list = []
    children.append(_Child(143, children))
    launch._watch(children, interval=0.0)  # returns once the child has left the list: no exit
    children.append(_Child(1, children))
    with pytest.raises(SystemExit) as exited:
        launch._watch(children, interval=0.0)
    assert exited.value.code == 1


# ---------------------------------------------------------------- runs of train.py (subprocesses)
@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [("SIGTERM", 143), ("SIGINT", 130), ("SIGUSR1", 138)])
def test_signal_mid_round_saves_the_round_and_resumes_bitwise(default_run, tmp_path: Path, sig: str, code: int) -> None:
    """The signal arrives in the middle of round 5 (outside SLURM): the round finishes and is saved, one line, the
    signal's status, no test; ``ckpt_path=auto`` resumes and ends with the uninterrupted model, bitwise."""
    out = tmp_path / "run"
    first = run(out, *KILL, f"+callbacks.kill.signal={sig}")
    assert first.returncode == code, first.stderr[-3000:]
    assert flx_lines(first.stderr) == [
        f"flx: stopped by {sig} after round 5, saved in {out}/checkpoints/last.ckpt (resume with ckpt_path=auto); "
        f"exit status {code}"
    ]
    assert "final test_acc" not in first.stdout and ckpt(out / "checkpoints" / "last.ckpt")["flx"]["round"] == 5
    second = run(out, "ckpt_path=auto")
    assert second.returncode == 0 and flx_lines(second.stderr) == [], second.stderr[-3000:]
    assert_same_model(ckpt(default_run[0] / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))


@pytest.mark.slow
def test_signal_without_checkpoints_stops_at_the_round_boundary(tmp_path: Path) -> None:
    """``checkpoint=null``: the fit loop alone stops the run after round 5, one line saying nothing was saved, 143."""
    proc = run(tmp_path / "run", *KILL, "+callbacks.kill.signal=SIGTERM", "checkpoint=null")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert flx_lines(proc.stderr) == [
        "flx: stopped by SIGTERM after round 5; no checkpoint (checkpoint=null); exit status 143"
    ]
    assert "final test_acc" not in proc.stdout and not (tmp_path / "run" / "checkpoints").exists()


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``SigCgt`` in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (FileNotFoundError, StopIteration):
        return False
    return bool(mask >> (signum - 1) & 1)


def _sha256(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")}


@pytest.mark.slow
def test_sigterm_during_start_up_writes_nothing(tmp_path: Path) -> None:
    """SIGTERM as soon as ``train.py`` catches it (its first statements, before torch is imported): exit 143, one
    line, no final line, and the run folder holds exactly what it held before, byte for byte. The folder holds a file
    and the run continues it (``ckpt_path=auto``: a fresh run would stop at the run-folder guard instead)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("written before the run\n")
    before = _sha256(out)
    cmd = [sys.executable, "train.py", *QUIET, "ckpt_path=auto", f"hydra.run.dir={out}"]
    env = {**os.environ, **ENV}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _catches(proc.pid, signal.SIGTERM), 30, "train.py to catch SIGTERM")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    assert flx_lines(stderr) == [
        "flx: stopped by SIGTERM during start-up, before the first round; nothing to save; exit status 143"
    ]
    assert "final test_acc" not in stdout and _sha256(out) == before


@pytest.mark.slow
def test_usr1_at_fit_start_in_slurm_requeues_at_once_and_the_new_start_is_fresh(default_run, tmp_path: Path) -> None:
    """SIGUSR1 after the start-up's checks, before round 1, in a SLURM job (a stub ``scontrol``): `scontrol requeue
    4242` at once, one line, exit 138, no round checkpoint; the requeued start (``ckpt_path=auto``) begins afresh and
    ends with the uninterrupted model, bitwise."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(stat.S_IRWXU)
    slurm = {**SLURM_ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = tmp_path / "run"
    signal_at_start = ["+callbacks.sig._target_=helpers.SignalAtFitStart", "+callbacks.sig.signal=SIGUSR1"]
    first = run(out, *signal_at_start, "ckpt_path=auto", env=slurm)
    assert first.returncode == 138, first.stderr[-3000:]
    assert flx_lines(first.stderr) == [
        "flx: requeued during start-up, before the first round (SIGUSR1); the job starts again; exit status 138"
    ]
    assert calls.read_text().split() == ["requeue", "4242"] and not list(out.glob("checkpoints/*.ckpt"))
    second = run(out, "ckpt_path=auto", env=slurm)
    assert second.returncode == 0, second.stderr[-3000:]
    assert_same_model(ckpt(default_run[0] / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))


@pytest.mark.slow
def test_sigterm_to_rank_zero_stops_both_ranks_at_one_round(tmp_path: Path) -> None:
    """``trainer=ddp trainer.devices=2`` (rank 1 forked from rank 0); SIGTERM to rank 0 alone after round 3's
    checkpoint: both ranks stop at the round rank 0 chose (its checkpoint is saved), one line, exit 143 (rank 1's own
    exit with 143 is not reported as a failure)."""
    out = tmp_path / "run"
    slow = ["+callbacks.slow._target_=helpers.SleepPerRound", "+callbacks.slow.seconds=0.3"]
    cmd = [sys.executable, "train.py", *QUIET, "trainer=ddp", "trainer.devices=2", *slow, f"hydra.run.dir={out}"]
    env = {**os.environ, **ENV}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (out / "checkpoints" / "round_00003.ckpt").exists(), 120, "round 3's checkpoint")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    rounds = ckpt(out / "checkpoints" / "last.ckpt")["flx"]["round"]
    assert proc.returncode == 143 and rounds >= 3, stderr[-3000:]
    assert flx_lines(stderr) == [
        f"flx: stopped by SIGTERM after round {rounds}, saved in {out}/checkpoints/last.ckpt (resume with "
        "ckpt_path=auto); exit status 143"
    ]
    assert "final test_acc" not in stdout
    time.sleep(0.5)
    assert not [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p).endswith(f"hydra.run.dir={out}")]


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
