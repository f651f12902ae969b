"""Hydra entry point: ``python train.py algo=fedprox data=cifar10 model=resnet18 partition.alpha=0.1``."""

from __future__ import annotations

import atexit
import gc
import os
import sys

# the status the process ends with: 1 (an uncaught error) unless the run returns or exits with its own (__main__)
_STATUS = [1]


def _exit_without_teardown() -> None:
    """Ends the process once every other exit handler has run (this one is registered before any import, so it runs
    last), skipping the interpreter's teardown of every module: with torch and Lightning loaded it takes ~1 s and
    writes nothing (the run's files are complete and closed when ``main`` returns)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_STATUS[0])


# whether __main__ turned the garbage collector off for the start-up (turned back on by _start_collecting)
_GC_PAUSED = [False]


def _start_collecting() -> None:
    """Turns the garbage collector back on once torch, Lightning and flx are imported, after moving what the start-up
    made (~800,000 objects, almost all module-level and alive to the end) into the permanent generation
    (``gc.freeze``), which no later collection scans. ``__main__`` turns collection off before its first import (the
    pattern of Python's ``gc.freeze`` documentation): the imports alone triggered ~7 full collections of that growing
    heap, the start-up's largest cost beyond the imports themselves (measured: docs/performance.md, "Start-up and the
    garbage collector"). What the imports left unreachable is frozen with the rest, once. Once per
    process, and only where ``__main__`` paused it: the next job of a sweep, or a caller that imported this module,
    finds nothing to do."""
    if _GC_PAUSED[0]:
        _GC_PAUSED[0] = False
        gc.freeze()
        gc.enable()


if __name__ == "__main__":
    from flx import signals as _signals  # the standard library only

    _signals.install()  # first: a signal during the start-up is noted, and acted on at the next safe point
    from flx.threads import short_wait  # the standard library only

    short_wait()  # GOMP_SPINCOUNT / OMP_WAIT_POLICY unless set: read when torch loads OpenMP, so before import torch
    atexit.register(_exit_without_teardown)
    gc.disable()  # until _start_collecting
    _GC_PAUSED[0] = True

import errno  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
from hydra.errors import InstantiationException  # noqa: E402
from omegaconf import DictConfig, OmegaConf, read_write  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from flx.checks import check_output_dir  # noqa: E402
from flx.config import CONFIG_DIR, compose_run  # noqa: E402
from flx.errors import ConfigError, one_line  # noqa: E402
from flx.signals import at_once, deferred, say, stop_if_signalled, stopped  # noqa: E402

JOB = os.path.splitext(os.path.basename(__file__))[0]  # Hydra's job name (hydra.job.name): the script's

# errors of the file system under the run folder: reported as bad input (exit 2), files already written are kept
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.ENOTDIR)


def _fail(err: BaseException, status: int = 2, say: bool = True) -> dict[str, Any]:
    """One line on stderr (from the first process of each console only: under DDP every rank fails alike; ``say``
    false: the run printed it already) and exit ``status``.

    In a ``-m`` sweep the line names the job and the sweep goes on: the job returns ``{"status": status, ...}``
    (a submitit job to the launching process, which reports it), and the process that ran the sweep exits with the
    worst status once every job has run."""
    from flx.launch import first_on_console, in_submitit_job, job_label, record_failure, sweep_job

    label = job_label()
    line = f"flx: error: {label + ': ' if label else ''}{err}"
    if say and first_on_console():
        print(line, file=sys.stderr, flush=True)
    if sweep_job() is None:
        sys.exit(status)
    if not in_submitit_job():
        record_failure(label, status)
    return {"status": status, "job": label, "error": str(err)}


def run(cfg: DictConfig) -> dict[str, Any]:
    """One run (or one job of a ``-m`` sweep); returns its status, its folder and its final test metrics.

    The run folder is claimed first (:func:`flx.run_folder.claim`: never clobbered, one run at a time), before
    anything is written into it; the claim is held until the run returns."""
    from flx.run_folder import claim

    with ExitStack() as held:
        try:
            check_output_dir(cfg.paths.output_dir)
            held.enter_context(claim(str(cfg.paths.output_dir), cfg))
            if cfg.state_store.backend == "disk":
                check_output_dir(cfg.state_store.dir, "state_store.dir")
        except ConfigError as err:
            return _fail(err)
        return _run_claimed(cfg)


def _run_claimed(cfg: DictConfig) -> dict[str, Any]:
    """:func:`run` once the run folder is claimed: the data load, the imports, the run, its errors as one line."""
    from flx.datamodules import prefetch

    prefetch.start(cfg)  # the data load runs while the next line imports torch, Lightning and flx (~4 s)
    from flx.faults import RunFailure
    from flx.hooks import RoundRefused
    from flx.launch import as_single_run
    from flx.run import train  # after Hydra has parsed the command line: keeps `--help` fast

    _start_collecting()
    stop_if_signalled(cfg.get("checkpoint"))  # a signal during the imports: stop (or requeue) before any write

    try:
        with as_single_run():
            metrics = train(cfg)
    except ConfigError as err:
        return _fail(err)
    except (InstantiationException, OmegaConfBaseException) as err:  # a config value a target rejected
        return _fail(ConfigError(one_line(err)))
    except RunFailure as err:  # diverged, or a client fault with fault.policy=stop: not a result
        return _fail(err, status=3)
    except RoundRefused as refusal:  # a spent privacy budget: tested and reported; its line printed when it stopped
        return _fail(refusal, status=refusal.status, say=False)
    except OSError as err:
        if err.errno not in DISK_ERRORS:
            raise
        where = f" {err.filename}" if err.filename else ""
        return _fail(
            ConfigError(
                f"cannot write{where}: {err.strerror}; files already written are kept (resume with "
                "ckpt_path=<run folder>/checkpoints/last.ckpt once there is room)"
            )
        )
    if stopped() is not None:
        _stopped()
    from flx.launch import job_label

    return {"status": 0, "job": job_label(), "output_dir": str(cfg.paths.output_dir), **metrics}


def _stopped() -> None:
    """The run stopped on a signal at a round boundary (:mod:`flx.signals`): its one line (unless a requeue printed
    it already), the other ranks joined (they stopped at the same round), the signal's exit status. A sweep ends
    here too: the signal asked the whole process to stop."""
    from flx.launch import job_label, join_children
    from flx.signals import status

    stop = stopped()
    if not stop.requeued:
        say(stop, job_label())
    join_children()
    sys.exit(status(stop.signum))


def _job(cfg: DictConfig) -> dict[str, Any]:
    """:func:`run` as a job of a sweep Hydra runs in this process: a signal waits for the job's round boundary
    (:func:`flx.signals.deferred`), while the sweep around it stops at once (``at_once`` in ``_run_command_line``)."""
    with deferred():
        return run(cfg)


# the command lines Hydra runs itself (-m sweeps, --cfg, --help, ...)
main = hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")(_job)


def _names_folder() -> bool:
    """Whether this process names the run's time-stamped folder (``hydra.run.dir``'s default): the first process of a
    run, not a task of a SLURM step of several tasks nor a rank torchrun started with a rendezvous id
    (``flx.launch.shared_run_name``: they share one name) nor a rank that ``prelaunch`` started (given rank 0's
    folder)."""
    from flx.launch import prelaunched, process_rank, shared_run_name

    several = int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 or shared_run_name() is not None
    return not (several or prelaunched() or process_rank() != 0)


def _run_command_line() -> None:
    """``python train.py ...``: the config check, the other DDP ranks, the run or the sweep, the exit status.

    A single run is composed once, checked and run as Hydra would run it (:func:`flx.launch.run_composed`); what
    ``compose_run`` leaves to Hydra (a sweep, Hydra's flags) goes through ``hydra.main``."""
    from flx.launch import failures, join_children, prelaunch, prelaunched, run_composed

    try:  # a rank that prelaunch started composes its command line unchecked: rank 0 checked it
        cfg = compose_run(sys.argv[1:], job_name=JOB, check=not prelaunched())
    except ConfigError as err:
        _fail(err)
    if cfg is not None:  # a signal while the command line was read: stop (or requeue) before the other ranks start
        stop_if_signalled(cfg.get("checkpoint"))
    if cfg is None:
        with at_once():  # Hydra's command lines: a sweep's jobs defer in run(); its waiting launcher stops at once
            main()
    else:
        stamped = "${now:" in str(OmegaConf.to_container(cfg.hydra.run, resolve=False).get("dir"))
        folder = str(cfg.hydra.run.dir)  # resolved now (its time stamp): every rank's folder
        if stamped and _names_folder():  # runs started in the same second get their own folders
            from flx.run_folder import new_folder

            folder = new_folder(folder)
        with read_write(cfg.hydra):
            cfg.hydra.run.dir = folder
        prelaunch(cfg.trainer, folder, cfg.get("ddp_start", "auto"))  # trainer=ddp on one machine: the other ranks
        run_composed(cfg, run, CONFIG_DIR)
    status = join_children()  # the ranks prelaunch started: a failure of theirs is the run's
    if status:
        sys.exit(status)
    if failures():  # a sweep: every job ran; say which failed
        failed = ", ".join(job for job, _ in failures())
        print(f"flx: error: {len(failures())} sweep job(s) failed: {failed}", file=sys.stderr)
        sys.exit(max(status for _, status in failures()))


if __name__ == "__main__":
    try:
        _run_command_line()
    except SystemExit as exit_:
        _STATUS[0] = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        raise
    except KeyboardInterrupt:
        _STATUS[0] = 130
        raise
    _STATUS[0] = 0
