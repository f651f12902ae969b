"""The signals a run obeys, and the exit status each gives: one place for a scheduler's view of a stopped run.

``train.py`` installs :func:`record` for SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 (:data:`CAUGHT`) as its first
statements, before torch or Lightning is imported, in every process of the run: forked ranks inherit the handlers,
spawned ranks and SLURM tasks run ``train.py`` themselves. The handler only notes the signal; what it means is
decided where the run can act without leaving anything half-written:

* **before the first round** (the config is checked, the imports are done, the data is loaded, the Trainer is
  built; :func:`stop_if_signalled`): nothing has been trained, so there is nothing to save. Inside a SLURM job with
  requeue on (``checkpoint.requeue``), the requeue signal (``checkpoint.requeue_signal``, SIGUSR1) requeues the job at
  once (``scontrol requeue``; the new start finds no checkpoint and begins with ``ckpt_path=auto``); any other signal
  stops the run. Files already written are kept.
* **at a round boundary** (:class:`flx.loop.FederatedFitLoop`): rank 0's signal is agreed on by every rank, the
  round just finished is checkpointed (:class:`flx.callbacks.checkpoint.RoundCheckpoint`), then the job is requeued
  (the requeue signal in a SLURM job, as above) or the run stops. A resume with ``ckpt_path=auto`` ends with the
  uninterrupted run's model. A signal between the last start-up check and the first round is taken at fit start the
  same way, with nothing to save.
* **outside a run** (:func:`at_once`: the launching process of a sweep on SLURM, which runs no round): at once.

Either way rank 0 prints one line on stderr and every rank exits with :func:`status`: ``128 + N`` for signal ``N``,
the status a shell reports for a process that signal ended, so a scheduler never records success:

============  ======  =====================================================================
signal        status  what the run does
============  ======  =====================================================================
SIGINT        130     Ctrl-C: checkpoint the round in progress once it ends, stop
SIGTERM       143     ``kill``, ``scancel``, Kubernetes, a SLURM time limit: the same
SIGUSR1       138     requeue signal in a SLURM job (``--signal=USR1@120``): checkpoint, ``scontrol requeue``;
                      elsewhere: as SIGTERM
SIGUSR2       140     as SIGUSR1 when it is ``checkpoint.requeue_signal``, else as SIGTERM
============  ======  =====================================================================

A second SIGINT or SIGTERM before the run has stopped ends the process at once, with ``128 + N`` of that signal and
one line from the first process of each console (:func:`flx.launch.first_on_console`; the other ranks exit silently:
in a SLURM job a rank still in its start-up when rank 0 requeues the job gets the requeue's SIGTERM after its own
SIGUSR1, and has nothing to add to rank 0's line). Checkpoint files are written atomically (:mod:`flx.checkpoint_io`):
the newest one completely on disk stays ``last.ckpt``. After a requeue, the SIGTERM with which SLURM ends the job
ends the process at once, silently (the checkpoint and the line are out).

Only the standard library (and :mod:`flx.launch`, which imports no more) is imported here: ``train.py`` imports this
module before anything else.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

# the standard library only, like this module
from flx.launch import expect_exit, first_on_console, process_rank, slurm_job_id

CAUGHT = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
IMMEDIATE = (signal.SIGTERM, signal.SIGINT)  # a second one of these stops the process at once


def status(signum: int) -> int:
    """The exit status of a run stopped by signal ``signum``: ``128 + signum`` (130 SIGINT, 143 SIGTERM, 138 SIGUSR1,
    140 SIGUSR2).

    >>> status(signal.SIGTERM), status(signal.SIGINT), status(signal.SIGUSR1), status(signal.SIGUSR2)
    (143, 130, 138, 140)
    """
    return 128 + int(signum)


def name(signum: int) -> str:
    """``SIGTERM`` for 15."""
    return signal.Signals(signum).name


@dataclass
class Stop:
    """How the run stopped on a signal: ``rounds`` done when it stopped (None: during the start-up, before fit),
    ``saved`` the checkpoint that holds them (None: none written for the stop), ``requeued``: SLURM was asked to
    requeue the job (its line is printed then)."""

    signum: int
    rounds: int | None = None
    saved: str | None = None
    requeued: bool = False

    def line(self, label: str = "") -> str:
        """The one line rank 0 prints on stderr; ``label`` names the job of a sweep (``job 0 (seed=0)``)."""
        sig = name(self.signum)
        if self.requeued:
            when = "during start-up, before the first round" if self.rounds is None else f"after round {self.rounds}"
            then = "starts again" if self.rounds is None else "resumes from checkpoints/last.ckpt"
            what = f"requeued {when} ({sig}); the job {then}"
        elif self.rounds is None:
            what = f"stopped by {sig} during start-up, before the first round; nothing to save"
        elif self.saved is None:
            what = f"stopped by {sig} after round {self.rounds}; no checkpoint (checkpoint=null)"
        else:
            what = f"stopped by {sig} after round {self.rounds}, saved in {self.saved} (resume with ckpt_path=auto)"
        return f"flx: {label + ': ' if label else ''}{what}; exit status {status(self.signum)}"


_pending: list[int] = []  # the first signal received, until the run acts on it
_stop: list[Stop] = []  # set once the run has acted on it
_defer = [True]  # whether a signal waits for the run to act on it (deferred) or stops the process at once (at_once)


def record(signum: int, frame: FrameType | None = None) -> None:
    """The signal handler: notes the first signal; a second SIGINT / SIGTERM ends the process at once (module
    docstring), as does any signal outside a run (:func:`at_once`). Async-signal-safe where it exits: ``os.write``
    and ``os._exit`` only."""
    if not _defer[0]:
        _exit_at_once(f"flx: stopped by {name(signum)}, no run in progress; exit status {status(signum)}", signum)
    if not _pending:
        _pending.append(int(signum))
        return
    if signum not in IMMEDIATE:
        return
    if _stop and _stop[0].requeued:  # SLURM ends the requeued job: everything is on disk and said
        os._exit(status(_stop[0].signum))
    if not first_on_console():  # every rank gets the signal alike; one line per console, as for any stop
        os._exit(status(signum))
    line = (
        f"flx: stopped at once by a second signal ({name(signum)} after {name(_pending[0])}); the newest complete "
        f"checkpoint is kept (resume with ckpt_path=auto); exit status {status(signum)}"
    )
    _exit_at_once(line, signum)


def _exit_at_once(line: str, signum: int) -> None:
    os.write(2, (line + "\n").encode())
    os._exit(status(signum))


@contextmanager
def at_once() -> Iterator[None]:
    """Within the body a signal stops the process at once, with one line and :func:`status` (the process runs no
    round there: the launching process of a sweep on SLURM, which only waits for its jobs); a signal noted before
    does so on entry. :func:`deferred` inside it (each job a sweep runs in this process) defers again."""
    stop_if_signalled(None)
    _defer[0] = False
    try:
        yield
    finally:
        _defer[0] = True


@contextmanager
def deferred() -> Iterator[None]:
    """Within the body a signal is noted and acted on by the run (the default from :func:`install` on)."""
    before, _defer[0] = _defer[0], True
    try:
        yield
    finally:
        _defer[0] = before


def install(signums: tuple[int, ...] = CAUGHT) -> None:
    """Makes :func:`record` the handler of ``signums`` (the main thread only, as Python requires)."""
    for signum in signums:
        if signal.getsignal(signum) is not record:
            signal.signal(signum, record)


def installed(signum: int) -> bool:
    """Whether :func:`record` handles ``signum`` in this process."""
    return signal.getsignal(signum) is record


def pending() -> int:
    """The signal this process received and has not acted on yet (the first one), or 0."""
    return _pending[0] if _pending else 0


def stopping(stop: Stop) -> None:
    """Records how the run acts on its signal (read by ``train.py`` for the line and the exit status); the other
    ranks exit with the same status, which rank 0's watcher then does not report as a failure."""
    _stop[:] = [stop]
    expect_exit(status(stop.signum))


def stopped() -> Stop | None:
    """How the run stopped on a signal, or None."""
    return _stop[0] if _stop else None


def requeues(signum: int, requeue: bool, requeue_signal: int) -> bool:
    """Whether ``signum`` requeues the SLURM job: requeue is on and it is the requeue signal."""
    return requeue and int(signum) == int(requeue_signal)


def requeue_job(job: str | None) -> None:
    """``scontrol requeue <job>`` (nothing outside SLURM); a failure is one warning line, the run stops anyway."""
    if job is None:
        return
    import subprocess

    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        print(f"flx: warning: scontrol requeue {job} failed: {result.stderr.strip()}", file=sys.stderr, flush=True)


def say(stop: Stop, label: str = "") -> None:
    """Prints ``stop``'s line on stderr, from the first process of each console only (every rank stops alike)."""
    if first_on_console():
        print(stop.line(label), file=sys.stderr, flush=True)


def stop_if_signalled(checkpoint: Mapping[str, Any] | None) -> None:
    """Start-up (before the first round): if a signal came, requeue the SLURM job (the requeue signal, requeue on)
    or stop, with one line from rank 0 and :func:`status`; nothing is written. ``checkpoint`` is the run's
    ``checkpoint`` config (None: checkpoints off, so no requeue)."""
    signum = pending()
    if not signum:
        return
    job = slurm_job_id()
    requeue = str(checkpoint.get("requeue", "auto")).lower() if checkpoint is not None else "false"
    on = job is not None if requeue == "auto" else requeue == "true"
    requeue_signal = getattr(signal, str(checkpoint.get("requeue_signal", "SIGUSR1"))) if checkpoint else 0
    stop = Stop(signum, requeued=requeues(signum, on, requeue_signal))
    stopping(stop)
    say(stop)
    if stop.requeued and process_rank() == 0:
        requeue_job(job)
    sys.exit(status(signum))
