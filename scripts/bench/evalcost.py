"""Evaluation cost: one evaluation pass against one training round, ``eval_every`` 1 against 5, 2 processes against 1.

Per workload (``WORKLOADS``, flx's defaults otherwise: progress lines, CSV logger, round checkpoints):

* ``eval pass``: the validation loop of one validated round, per-client metrics included (median over the rounds,
  from ``on_validation_start`` to ``on_validation_end``); ``round``: the rest of a round (median); their ratio;
* ``fit e=1`` / ``fit e=5``: ``trainer.fit`` with ``eval_every=1`` and ``eval_every=5`` (built before, not timed);
* ``pass 1p`` / ``pass 2p``: the evaluation pass of ``python train.py`` on 1 process and on 2 (``trainer=ddp``, CPU
  gloo, one torch thread each), rank 0's clock from a barrier at the pass's start (the ranks' rounds end apart) to
  its end (after the metrics' all-reduce, so it waits for the slower rank).

Usage: ``python scripts/bench/evalcost.py [--quick]``; :func:`eval_report` returns the same as a dict.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
_OUT = tempfile.TemporaryDirectory(prefix="flx-evalcost-")  # every run's output folder, removed at exit

WORKLOADS: dict[str, tuple[str, ...]] = {
    # `python train.py` as shipped: digits, MLP 200-200, 20 Dirichlet clients, 10 a round, 10 local steps
    "default": (),
    # many clients that each hold every label of the validation split: 200 iid clients, 10,000 validation rows
    "200 clients": (
        "data=synthetic",
        "data.loader.num_samples=40000",
        "data.val_fraction=0.25",
        "data.loader.input_shape=[64]",
        "data.loader.test_samples=2000",
        "partition=iid",
        "partition.num_clients=200",
        "algo.clients_per_round=20",
        "algo.local_steps=5",
    ),
}


class EvalTimer(pl.Callback):
    """Wall-clock of each round and of each validation pass inside ``fit`` (sanity checks excluded); with ``path``,
    rank 0 writes ``{"rounds": [...], "passes": [...]}`` (seconds) there at the end of fit."""

    def __init__(self, path: str | None = None) -> None:
        self.path, self.rounds, self.passes = path, [], []
        self._round = self._pass = None

    def _close_round(self) -> None:
        if self._round is not None:
            self.rounds.append(time.perf_counter() - self._round)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_round()
        self._round = time.perf_counter()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.barrier()  # N processes: the ranks' rounds end apart; time the pass from a common start
        self._pass = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.passes.append(time.perf_counter() - self._pass)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_round()
        if self.path and trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"rounds": self.rounds, "passes": self.passes}))


def _fit(overrides: list[str]) -> tuple[float, EvalTimer]:
    """``trainer.fit`` of a built run (not timed: the build) with an :class:`EvalTimer`; its seconds and the timer."""
    from flx.config import precheck
    from flx.run import build

    cfg = precheck([*overrides, f"paths.output_dir={tempfile.mkdtemp(dir=_OUT.name)}"])
    dm, module, trainer = build(cfg)
    timer = EvalTimer()
    trainer.callbacks.append(timer)
    with contextlib.redirect_stdout(io.StringIO()):  # the console's round lines (a default, kept), not the table
        start = time.perf_counter()
        trainer.fit(module, datamodule=dm)
        return time.perf_counter() - start, timer


def _pass_in_processes(overrides: list[str], devices: int) -> float:
    """Median evaluation pass of ``python train.py`` on ``devices`` CPU processes (DDP with 2)."""
    out = Path(tempfile.mkdtemp(dir=_OUT.name))
    ddp = ["trainer=ddp", f"trainer.devices={devices}"] if devices > 1 else []
    timer = ["+callbacks.eval_timer._target_=evalcost.EvalTimer", f"+callbacks.eval_timer.path={out / 'timer.json'}"]
    cmd = [sys.executable, "train.py", *overrides, *ddp, *timer, f"hydra.run.dir={out}", "trainer.accelerator=cpu"]
    path = os.pathsep.join([str(HERE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return statistics.median(json.loads((out / "timer.json").read_text())["passes"])


def measure(name: str, rounds: int, processes: bool) -> dict[str, Any]:
    """The row of workload ``name``: its evaluation pass, round and fit times (seconds), and with ``processes`` the
    pass on 1 and 2 processes."""
    base = [*WORKLOADS[name], f"algo.rounds={rounds}", "trainer.accelerator=cpu"]
    fit_every_1, timer = _fit([*base, "eval_every=1"])
    fit_every_5, _ = _fit([*base, "eval_every=5"])
    eval_pass = statistics.median(timer.passes)
    train_round = statistics.median(r - p for r, p in zip(timer.rounds, timer.passes))
    row = {"workload": name, "rounds": rounds, "eval_pass_s": eval_pass, "round_s": train_round}
    row |= {"pass_per_round": eval_pass / train_round, "fit_eval_every_1_s": fit_every_1}
    row |= {"fit_eval_every_5_s": fit_every_5}
    if processes:
        single, double = (_pass_in_processes([*base, "eval_every=1"], n) for n in (1, 2))
        row |= {"pass_1p_s": single, "pass_2p_s": double, "pass_2p_over_1p": double / single}
    return row


def eval_report(quick: bool = False) -> dict[str, Any]:
    """The evaluation-cost table as a dict: ``rows`` (one per workload measured), ``load`` (the 1-minute load average
    before the runs) and ``quick``. Quick: the default workload only, 5 rounds (~30 s); else both, 10 rounds."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):  # info lines: no timed work in them
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    load = os.getloadavg()[0]
    names = ["default"] if quick else list(WORKLOADS)
    rounds = 5 if quick else 10
    rows = [measure(name, rounds, processes=name == names[-1]) for name in names]
    return {"rows": rows, "load": load, "quick": quick}


def table(report: dict[str, Any]) -> str:
    cols = ("eval pass", "round", "pass/round", "fit e=1", "fit e=5", "pass 1p", "pass 2p", "2p/1p")
    lines = [f"{'workload':<12}" + "".join(f"{c:>11}" for c in cols)]
    for r in report["rows"]:
        ms = [r["eval_pass_s"] * 1e3, r["round_s"] * 1e3]
        cells = [f"{ms[0]:9.1f}ms", f"{ms[1]:9.1f}ms", f"{r['pass_per_round']:11.2f}"]
        cells += [f"{r['fit_eval_every_1_s']:10.2f}s", f"{r['fit_eval_every_5_s']:10.2f}s"]
        if "pass_1p_s" in r:
            cells += [
                f"{r['pass_1p_s'] * 1e3:9.1f}ms",
                f"{r['pass_2p_s'] * 1e3:9.1f}ms",
                f"{r['pass_2p_over_1p']:11.2f}",
            ]
        lines.append(f"{r['workload']:<12}" + "".join(cells))
    return "\n".join(lines) + f"\n{report['rows'][0]['rounds']} rounds a fit; load average before: {report['load']:.2f}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the default workload only, 5 rounds (~30 s)")
    print(table(eval_report(parser.parse_args().quick)))
