"""The run folder: never clobbered, used by one run at a time.

A run writes its config, data split, partition, checkpoints, metrics and cached artefacts into one folder
(``hydra.run.dir``; by default a new time-stamped folder each time). Reusing a folder is how a run continues
(``ckpt_path=auto``, a requeued SLURM job), and only that:

- :func:`check_fresh`: a fresh run (no ``ckpt_path``) into a folder that already holds files stops with one line
  naming the folder and the ways on: ``ckpt_path=auto`` to continue that run, another folder, or ``run.overwrite=true``,
  which moves the old outputs aside into ``<folder>/previous-<k>`` (:func:`move_aside`; nothing is deleted). It moves
  only a folder flx recognises as a run's (its ``.hydra/config.yaml``) holding nothing but what flx writes
  (:data:`WRITTEN`): a checkout or a home folder named as ``hydra.run.dir`` is refused (:func:`check_movable`).
- :func:`check_elsewhere`: the same for a fresh run's ``checkpoint.dirpath`` and disk client store where they lie
  outside the run folder (no ``run.overwrite`` there).
- :func:`check_continued`: a continuing run into a folder whose saved config (``.hydra/config.yaml``) is another run's
  (:func:`flx.resume.fingerprint` differs) stops with one line; the checkpoint itself is checked by
  :func:`flx.resume.check_ckpt`.
- :class:`RunLock`: an OS lock (``fcntl.flock``) on ``<folder>/.flx.lock``, held by the run's first process for the
  life of the run. A second run in the same folder stops with one line. The kernel releases the lock when the process
  dies, so ``kill -9`` never leaves a stale lock; a clean exit also removes the file.
- :func:`new_folder`: the default, time-stamped folder of a run started in the same second as another gets a
  ``_<k>`` suffix instead of tripping the guard.

Only the standard library and ``omegaconf`` at import time: this runs before torch is imported.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig, OmegaConf

from flx.errors import ConfigError, bad_value

LOCK = ".flx.lock"
PREVIOUS = "previous-"  # run.overwrite=true moves the outputs into <folder>/previous-<k>
SAVED_CONFIG = os.path.join(".hydra", "config.yaml")
WRITTEN = frozenset(
    (".hydra", "checkpoints", "client_state", "csv", "tensorboard", "wandb", "curves.json", "curves.png")
    + ("pm.pt", "pm.pt.json", "whale.json", "lambda.json")
)
"""The top-level entries flx writes into a run folder with its configs' paths: Hydra's config, the round checkpoints,
the disk client store, the loggers' folders, the curves, AugFL's cached PM, the WHALE and DRFA reports."""


def _own(name: str) -> bool:
    """Whether a top-level entry of the folder is the guard's own (the lock, a folder of moved-aside outputs)."""
    return name == LOCK or (name.startswith(PREVIOUS) and name[len(PREVIOUS) :].isdigit())


def outputs(folder: str) -> list[str]:
    """The top-level entries of ``folder`` that hold at least one file (empty folders hold nothing to clobber),
    sorted; the guard's own entries are left out. ``[]`` for a missing folder."""
    if not os.path.isdir(folder):
        return []
    return sorted(name for name in os.listdir(folder) if not _own(name) and _holds_file(os.path.join(folder, name)))


def _holds_file(path: str) -> bool:
    if not os.path.isdir(path) or os.path.islink(path):
        return True
    return any(files for _, _, files in os.walk(path))


def continuing(cfg: DictConfig) -> bool:
    """Whether the run continues an earlier one in its folder: ``ckpt_path`` set (``auto`` or a file), or a SLURM job
    that was requeued (:func:`flx.launch.slurm_restarts`: it resumes with ``ckpt_path=auto``)."""
    from flx.launch import slurm_restarts

    return cfg.get("ckpt_path") is not None or slurm_restarts() > 0


def overwrite(cfg: DictConfig) -> bool:
    """``run.overwrite`` (false when the config has no ``run`` node); a one-line error unless it is a boolean."""
    value = OmegaConf.select(cfg, "run.overwrite", default=False)
    if not isinstance(value, bool):
        raise bad_value("run.overwrite", value, "must be true or false")
    if value and cfg.get("ckpt_path") is not None:
        raise bad_value("run.overwrite", value, f"is for a fresh run: not with ckpt_path={cfg.ckpt_path}")
    return value


def check_fresh(folder: str, allow_overwrite: bool) -> None:
    """A fresh run may start in ``folder`` only when it holds no files (see :func:`outputs`), or with
    ``allow_overwrite`` (the caller then :func:`move_aside`\\ s them). Raises one line otherwise."""
    found = outputs(folder)
    if found and allow_overwrite:
        check_movable(folder, found)
    if not found or allow_overwrite:
        return
    raise ConfigError(
        f"hydra.run.dir={folder}: already holds a run's outputs ({_shown(found)}); continue that run with "
        "ckpt_path=auto, start this one in a new folder, or set run.overwrite=true to move the old outputs aside "
        "(never deleted)"
    )


def _shown(names: list[str]) -> str:
    """``a, b, c, d and 2 more``: the first four names of a list, for a one-line message."""
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_movable(folder: str, found: list[str]) -> None:
    """``run.overwrite=true`` moves the entries ``found`` of ``folder`` only when the folder is a flx run's (it holds
    ``.hydra/config.yaml``) and each of them is one flx writes (:data:`WRITTEN`): an empty ``hydra.run.dir`` (the
    current folder), a checkout or a home folder must never be moved. Raises one line otherwise."""
    why = "is not a flx run folder (no .hydra/config.yaml)"
    if os.path.isfile(os.path.join(folder, SAVED_CONFIG)):
        foreign = [name for name in found if name not in WRITTEN]
        if not foreign:
            return
        why = f"also holds files flx did not write ({_shown(foreign)})"
    raise ConfigError(
        f"hydra.run.dir={folder}: {why}; run.overwrite=true moves only a flx run's own outputs: start this run in a "
        "new folder"
    )


ELSEWHERE = ("checkpoint.dirpath", "state_store.dir")  # folders a run writes that may lie outside its run folder


def check_elsewhere(folder: str, cfg: DictConfig) -> None:
    """A fresh run's checkpoint folder and disk client store, where they lie outside its run folder (a shared place),
    must hold no files yet: a run's ``round_*.ckpt`` or client files would be replaced. Raises one line otherwise."""
    inside = os.path.abspath(folder) + os.sep
    for key in ELSEWHERE:
        path = OmegaConf.select(cfg, key, default=None)
        if key == "state_store.dir" and OmegaConf.select(cfg, "state_store.backend") != "disk":
            continue
        if path is None or (os.path.abspath(str(path)) + os.sep).startswith(inside):
            continue
        found = outputs(str(path))
        if found:
            why = f"already holds another run's files ({_shown(found)}); a fresh run needs an empty folder there"
            raise bad_value(key, str(path), f"{why}, or continue that run with ckpt_path=auto")


def move_aside(folder: str) -> str | None:
    """Moves every entry of :func:`outputs` into ``<folder>/previous-<k>`` (the first free ``k`` from 1), by renames
    within the folder (no copy, nothing deleted). Returns that folder, or None when there was nothing to move."""
    found = outputs(folder)
    if not found:
        return None
    k = 1
    while os.path.lexists(os.path.join(folder, f"{PREVIOUS}{k}")):
        k += 1
    target = os.path.join(folder, f"{PREVIOUS}{k}")
    os.mkdir(target)
    for name in found:
        os.rename(os.path.join(folder, name), os.path.join(target, name))
    return target


def check_continued(folder: str, cfg: DictConfig) -> None:
    """A continuing run may use ``folder`` when it holds no saved config, or one of the same run (the same
    :func:`flx.resume.fingerprint`: model, algorithm and parts, data, partition, seed, ...). Covers a folder whose run
    was killed before its first checkpoint. Raises one line naming the first difference otherwise."""
    from flx.resume import fingerprint, flatten

    saved_path = os.path.join(folder, SAVED_CONFIG)
    if not os.path.isfile(saved_path):
        return
    try:
        theirs = flatten(fingerprint(OmegaConf.load(saved_path)))
    except Exception:  # noqa: BLE001 -- a config that no longer resolves here: the checkpoint check still applies
        return
    mine = flatten(fingerprint(cfg))
    diff = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if diff:
        key = diff[0]
        raise ConfigError(
            f"hydra.run.dir={folder}: holds another run ({key} is {theirs.get(key)!r} there, {mine.get(key)!r} here); "
            "continue it with its own settings, or start this run in a new folder"
        )


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<folder>/.flx.lock`` for the life of a run (see the module docstring).

    The file holds the owner's pid (for the message a second run prints). :meth:`release` removes the file and then
    unlocks, only in the process that took the lock (a rank forked from it shares the open file, and must not drop the
    lock when it exits). A process that opened the file just before it was removed would lock a file no one else can
    see: :meth:`acquire` checks that the name still refers to the file it locked, and tries again otherwise.
    """

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK)
        self._fd: int | None = None
        self._pid = os.getpid()

    def acquire(self) -> None:
        """Takes the lock, or raises one line naming the folder and the process that holds it."""
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                folder = os.path.dirname(self.path)
                raise ConfigError(
                    f"hydra.run.dir={folder}: another run (pid {holder}) is running in this folder; wait for it to "
                    "end, or start this run in a new folder"
                ) from None
            if self._same_file(fd):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                self._fd = fd
            else:  # removed (and maybe recreated) by the run that held it, between our open and our lock
                os.close(fd)

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        """Removes the lock file and unlocks (only in the process that acquired it; idempotent)."""
        if self._fd is None or os.getpid() != self._pid:
            return
        fd, self._fd = self._fd, None
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass
        os.close(fd)  # closing the last descriptor of this open file releases the flock


def new_folder(path: str) -> str:
    """Creates ``path`` as a new, empty folder, or, when it exists (another run started in the same second: the
    default run folder is named by the start time), the first free ``<path>_<k>`` (``k`` = 1, 2, ...). ``os.mkdir`` is
    atomic: of several runs started at once each gets its own folder. Returns the folder created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    candidate, k = path, 0
    while True:
        try:
            os.mkdir(candidate)
            return candidate
        except FileExistsError:
            k += 1
            candidate = f"{path}_{k}"


def _is_first_process() -> bool:
    """Whether this process is the run's first (global rank 0, on the first node): the one that guards and locks.
    DDP's other ranks (started by ``flx.launch.prelaunch``, Lightning, ``srun`` or torchrun, on any node) join its
    folder."""
    from flx.launch import process_rank

    return process_rank() == 0


@contextmanager
def claim(folder: str, cfg: DictConfig) -> Iterator[None]:
    """The run folder's guard and lock for the life of the block (a run, or one job of a sweep).

    On the first process: takes the :class:`RunLock`, then checks the folder (:func:`check_fresh` or, for a continuing
    run, :func:`check_continued`) and with ``run.overwrite=true`` moves the old outputs aside, saying where on stderr.
    Other ranks do nothing. Raises :class:`ConfigError` (one line) before anything in the folder changes.
    """
    allow = overwrite(cfg)
    if not _is_first_process():
        yield
        return
    os.makedirs(folder, exist_ok=True)
    lock = RunLock(folder)
    lock.acquire()
    try:
        if continuing(cfg):
            check_continued(folder, cfg)
        else:
            check_fresh(folder, allow)
            check_elsewhere(folder, cfg)
            moved = move_aside(folder) if allow else None
            if moved is not None:
                print(f"flx: run.overwrite=true: moved the earlier outputs of {folder} to {moved}", file=sys.stderr)
        yield
    finally:
        lock.release()
