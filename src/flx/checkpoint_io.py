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
