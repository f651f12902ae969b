"""Where the flx time goes: a low-overhead split of one ``trainer.fit`` and a cProfile listing.

:func:`split_flx_time` wraps a built run's federation and module methods (on the instances, no flx file is
touched) with ``perf_counter`` accumulators, one timer pair per call (about a microsecond), and reports

* ``fit``: the whole ``trainer.fit``;
* ``startup`` / ``teardown``: from fit start to the first round start, from the last round end to fit end;
* ``begin_round`` / ``end_round``: sampling + snapshot, reduce + server step;
* ``training_step``: Lightning's call of our step, split into ``train_client`` and the rest (``self.log``);
* ``on_train_epoch_end``: our per-round ``fl/*`` logging;
* ``train_client`` split into ``make_client`` (seeding), ``load_global``, ``local_steps`` and the rest
  (aggregation update, parts);
* ``lightning_loop``: fit minus all of the above, i.e. Lightning's per-batch and per-epoch machinery.
"""

from __future__ import annotations

import cProfile
import functools
import pstats
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import FlxBuild

_WRAPPED = {
    "federation": ("begin_round", "end_round", "train_client", "make_client", "load_global", "_local_steps"),
    "module": ("training_step", "on_train_epoch_end"),
}


def _wrap(obj: Any, name: str, totals: dict[str, float], counts: dict[str, int], marks: dict[str, float]) -> None:
    fn: Callable[..., Any] = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        marks.setdefault("first_" + name, start)
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            totals[name] += end - start
            counts[name] += 1
            marks["last_" + name] = end

    setattr(obj, name, timed)


def split_flx_time(b: FlxBuild) -> dict[str, float]:
    """Runs ``trainer.fit`` once with method timers; returns seconds per part (see the module docstring)."""
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    marks: dict[str, float] = {}
    fed = b.module.federation
    for name in _WRAPPED["federation"]:
        _wrap(fed, name, totals, counts, marks)
    for name in _WRAPPED["module"]:
        _wrap(b.module, name, totals, counts, marks)
    start = time.perf_counter()
    b.trainer.fit(b.module, datamodule=b.dm)
    fit = time.perf_counter() - start
    t = dict(totals)
    inner = t["make_client"] + t["load_global"] + t["_local_steps"]
    split = {
        "fit": fit,
        "startup": marks["first_begin_round"] - start,
        "teardown": start + fit - marks["last_end_round"],
        "begin_round": t["begin_round"],
        "end_round": t["end_round"],
        "training_step_minus_train_client": t["training_step"] - t["train_client"],
        "on_train_epoch_end": t["on_train_epoch_end"],
        "train_client": t["train_client"],
        "make_client": t["make_client"],
        "load_global": t["load_global"],
        "local_steps": t["_local_steps"],
        "train_client_rest": t["train_client"] - inner,
    }
    accounted = split["startup"] + split["teardown"] + t["begin_round"] + t["end_round"] + t["training_step"]
    accounted += t["on_train_epoch_end"]
    split["lightning_loop"] = fit - accounted
    split["clients"] = float(counts["train_client"])
    split["rounds"] = float(counts["end_round"])
    return split


def print_split(key: str, split: dict[str, float]) -> None:
    """Prints the split as seconds, percent of fit and microseconds per client."""
    fit, clients = split["fit"], max(split["clients"], 1.0)
    print(f"  [{key}] flx time split ({int(split['rounds'])} rounds, {int(clients)} clients):")
    for name, sec in split.items():
        if name in ("clients", "rounds"):
            continue
        print(f"      {name:<34}{sec:>8.3f}s {100 * sec / fit:>6.1f}%  {1e6 * sec / clients:>9.0f} us/client")


def cprofile_flx(b: FlxBuild, out_dir: Path, key: str, top: int = 30) -> None:
    """cProfile of one ``trainer.fit``: prints the top functions by own and by cumulative time, saves the stats."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"profile_{key}.prof"
    prof = cProfile.Profile()
    prof.runcall(b.trainer.fit, b.module, datamodule=b.dm)
    prof.dump_stats(str(path))
    stats = pstats.Stats(str(path))
    for order in ("tottime", "cumulative"):
        print(f"  [{key}] cProfile of one flx fit, by {order} (stats in {path}):")
        stats.sort_stats(order).print_stats(top)
