"""The run's data, loaded while the process imports Lightning: two parts of the start-up at once.

``python train.py`` first imports torch, Lightning and flx (seconds of Python byte code that holds the GIL), then loads
its data (drawing, reading and copying tensors, which mostly runs outside the GIL; the start-up's parts:
docs/performance.md#start-up-and-the-garbage-collector). ``train.py`` calls :func:`start` as soon as the configuration
is known, which runs the data protocol (:func:`flx.datamodules.protocol.load` of ``data.loader``) in a background
thread; ``flx.run.build`` then :func:`take`\\ s the result for the run's datamodule instead of loading it again, waiting
for the thread if it is not done.

The data are the same tensors either way: loaders draw only from their own seeded generators, never from the global
random state (``tests/datamodules/test_prefetch.py`` compares a prefetched run with a loaded one bitwise).
:func:`start` imports torch, sets the run's ``num_threads`` (as ``build`` does before it loads) and starts the thread.
A loading error (a missing file, a bad value) is raised by :func:`take`, in the run's thread, as the load itself would
have raised it. A configuration whose ``data`` node differs from the one prefetched (a test building its own run) is
loaded as before.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flx.datamodules.protocol import data_protocol
from flx.errors import instantiate
from flx.launch import forking, threads_until_fork
from flx.threads import resolve as resolve_threads


class _Load:
    """One background load of ``cfg.data`` (a daemon thread: a process that ends does not wait for it).

    torch, the protocol and the loader's module are imported here, in the calling thread: imports hold the GIL, so
    importing them in the thread would overlap nothing, and two threads importing torch's modules at once could meet
    on their import locks. The thread only loads.
    """

    def __init__(self, cfg: DictConfig) -> None:
        import torch

        from flx.datamodules.protocol import load

        self.key = key(cfg)
        self.data: Any = None
        self.error: BaseException | None = None
        own = OmegaConf.create({"data": OmegaConf.to_container(cfg.data, resolve=True)})  # the thread's own copy
        threads = threads_until_fork(resolve_threads(cfg.get("num_threads"), cfg.trainer))
        if threads:  # as flx.run.build sets it before its load
            torch.set_num_threads(int(threads))
        loader, protocol = instantiate(own.data.loader), data_protocol(own)
        self._thread = threading.Thread(
            target=self._run, args=(load, loader, protocol), name="flx-data-prefetch", daemon=True
        )
        self._thread.start()

    def _run(self, load: Any, loader: Any, protocol: Any) -> None:
        try:
            self.data = load(loader, protocol)
        except BaseException as err:  # noqa: BLE001 -- raised in the run's thread by take()
            self.error = err

    def result(self) -> Any:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.data


_pending: _Load | None = None


def key(cfg: DictConfig) -> str:
    """What the loaded data depend on: the resolved ``data`` node (the loader and the protocol) and ``num_threads``."""
    return OmegaConf.to_yaml({"data": cfg.data, "num_threads": cfg.get("num_threads")}, resolve=True)


def spare_core() -> bool:
    """Whether this process has a core for the load beside its imports: at least two usable cores per process of the
    run (``WORLD_SIZE`` / ``SLURM_NTASKS``, counted as if all on this machine). Two ranks on two cores would each run
    the load against the other rank's imports: nothing to gain (the 2-rank start-up measured alike either way)."""
    # ranks that flx.launch.fork_ranks forks later do not exist yet: this process loads and imports alone
    processes = 1 if forking() else max(int(os.environ.get(k) or 1) for k in ("WORLD_SIZE", "SLURM_NTASKS"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores >= 2 * processes


def start(cfg: DictConfig) -> None:
    """Starts loading ``cfg``'s data in a background thread (replacing a load started before and not taken), when
    there is a :func:`spare_core` for it. A ``data`` node that cannot be resolved starts nothing: the run's own load
    reports it."""
    global _pending
    _pending = None
    if not spare_core():
        return
    try:
        _pending = _Load(cfg)
    except Exception:  # noqa: BLE001 -- the same error comes from flx.run.build's own load, as one line
        _pending = None


def take(cfg: DictConfig) -> Any:
    """The data :func:`start` loaded for a configuration with the same ``data`` node as ``cfg`` (waiting for it), or
    None when none was started for it. Raises what the load raised. The data are handed over once."""
    global _pending
    pending, _pending = _pending, None
    if pending is None or pending.key != key(cfg):
        return None
    return pending.result()
