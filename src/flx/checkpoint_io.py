"""Checkpoint files that are never half-written, loaded with weights-only semantics.

A checkpoint is serialised in memory, written to a temporary file in the target folder, flushed and
``fsync``-ed, then renamed over the target (``os.replace`` is atomic on POSIX file systems). A process killed
at any instant (SIGKILL, node failure) leaves either the previous file or the new one, never a truncated
one; a full disk fails the write before the rename, so the previous checkpoint survives and the temporary
file is removed.

:class:`AtomicCheckpointIO` (Lightning's checkpoint IO of every flx Trainer) serialises a checkpoint in the calling
thread, so the state written is the state of that instant, and writes the file in one background thread: the training
goes on while the bytes reach the disk (about half of a round checkpoint's cost). Jobs run in submission order (the
file, then what follows it: ``last.ckpt``, old files removed); at most one checkpoint is in flight, so a new save
first waits for the previous one, and an error of the writer (a full disk) is raised in the training thread at the
next save, at :meth:`AtomicCheckpointIO.wait` or at teardown. ``checkpoint.background=false`` writes in the calling
thread.

Loading uses ``torch.load(weights_only=True)``: tensors, numbers, strings and containers only, no pickled
code. Everything flx and its parts put in a checkpoint is of these types.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from flx.state import fsync

LAST = "last.ckpt"  # the newest round checkpoint of a run folder (a hard link; flx.callbacks.checkpoint)
PARTIAL_WRITE = re.compile(r"\..+\.tmp-\d+")  # the name of a write in progress, or one a kill cut short


def _temporary(path: str) -> str:
    """The file a write to ``path`` goes through: hidden, in the same folder, named after this process."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")


def atomic_write_bytes(data: bytes, path: str) -> None:
    """Writes ``data`` to ``path`` via a temporary file in the same folder and an atomic rename."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync(folder)  # the rename itself


def atomic_link(src: str, dst: str) -> None:
    """Makes ``dst`` name the same file as ``src`` (a hard link, or a copy where links fail), atomically."""
    tmp = _temporary(dst)
    if os.path.exists(tmp):
        os.remove(tmp)
    try:
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        with open(src, "rb") as f:
            atomic_write_bytes(f.read(), dst)


def load(path: str, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint on the CPU, weights-only (``mmap`` reads lazily: cheap for peeking at small entries)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint IO with atomic writes, in a background thread, and weights-only loads (installed by
    ``flx.run``; see the module docstring).

    Args:
        background: write files in a background thread (True) or in the calling one.
    """

    def __init__(self, background: bool = True) -> None:
        super().__init__()
        self.background = background
        self._writer: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn(*args)`` after the writes submitted before it (in the background thread, or now)."""
        if not self.background:
            fn(*args)
            return
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flx-checkpoint")
        self._pending.append(self._writer.submit(fn, *args))

    def wait(self) -> None:
        """Blocks until every submitted write is on disk; raises the first error of the writer."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.wait()  # at most one checkpoint in flight: bounded memory, and the previous one's errors surface here
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        self.submit(atomic_write_bytes, buffer.getbuffer(), str(path))

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        self.wait()
        return torch.load(str(path), map_location=map_location or "cpu", weights_only=True)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.wait()
        super().remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        try:
            self.wait()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None


# ---------------------------------------------------------------- a run folder's round files
ROUND_FILE = re.compile(r"round_(\d+)\.ckpt")


def round_file(rounds: int) -> str:
    """The file name of the checkpoint holding the state after ``rounds`` rounds."""
    return f"round_{rounds:05d}.ckpt"


def after_write(checkpoint_io: Any, fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` once the files saved so far through ``checkpoint_io`` are on disk: queued behind them by an
    :class:`AtomicCheckpointIO`, or now with another checkpoint IO."""
    if isinstance(checkpoint_io, AtomicCheckpointIO):
        checkpoint_io.submit(fn, *args)
    else:
        fn(*args)


def wait_for_writes(checkpoint_io: Any) -> None:
    """Blocks until the files saved through ``checkpoint_io`` are on disk (nothing to wait for with another IO)."""
    if isinstance(checkpoint_io, AtomicCheckpointIO):
        checkpoint_io.wait()


def remove_files(files: list[str]) -> None:
    """Removes ``files``; one already gone is no error."""
    for file in files:
        try:
            os.remove(file)
        except FileNotFoundError:
            pass


class RoundFiles:
    """The round files (``round_NNNNN.ckpt``) a run keeps in ``dirpath``: the newest ``keep_last`` (None: all), the
    newest also as ``last.ckpt``.

    ``saved`` lists the kept files in the order written (a resumed run's list, from its checkpoint, may name files of
    another folder: they are never removed from here).
    """

    def __init__(self, dirpath: str, keep_last: int | None) -> None:
        self.dirpath, self.keep_last = dirpath, keep_last
        self.saved: list[str] = []

    def add(self, rounds: int) -> str:
        """Records the file of the state after ``rounds`` rounds and returns its path."""
        path = os.path.join(self.dirpath, round_file(rounds))
        if path not in self.saved:
            self.saved.append(path)
        return path

    def prune(self) -> list[str]:
        """Drops the files beyond ``keep_last`` from :attr:`saved` and returns them, to be removed once the newest file
        is written (:meth:`publish`); only this folder's files, never others."""
        if self.keep_last is None:
            return []
        mine = [p for p in self.saved if os.path.dirname(p) == self.dirpath]
        old = mine[: max(0, len(mine) - self.keep_last)]
        self.saved = [p for p in self.saved if p not in old]
        return old

    def publish(self, path: str, old: list[str]) -> None:
        """After ``path`` is on disk: ``last.ckpt`` names it, and the ``old`` files are removed."""
        atomic_link(path, os.path.join(self.dirpath, LAST))
        remove_files(old)

    def rounds(self) -> set[int]:
        """The rounds whose state the kept round files hold."""
        return {int(m.group(1)) for p in self.saved if (m := ROUND_FILE.fullmatch(os.path.basename(p)))}

    def remove_partial_writes(self) -> list[str]:
        """Removes the temporary files of writes cut short by a kill (``.NAME.tmp-PID``): never read, each as large as
        a checkpoint, and a resumed run (another pid) would not overwrite them. Returns their names."""
        if not os.path.isdir(self.dirpath):
            return []
        partial = sorted(f for f in os.listdir(self.dirpath) if PARTIAL_WRITE.fullmatch(f))
        for name in partial:
            os.remove(os.path.join(self.dirpath, name))
        return partial
