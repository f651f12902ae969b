"""Builds and times the two sides of a workload: ``trainer.fit`` of an flx run and the plain FedAvg loop.

Both sides get the same data tensors (the flx datamodule's store and client index views), the same model
class and initial weights, the same hyper-parameters (read from the one composed config) and the same torch
thread settings. Every run counts its local steps as the training forwards of its net (a forward pre-hook on the
net: the same tiny cost on both sides; flx's evaluation forwards, e.g. the divergence rule's loss of the initial model,
run in eval mode and are not counted), so the script can assert that both sides did the same number of local
steps. (Not ``torch.optim`` step hooks: flx's plain-SGD step does not go through ``torch.optim``.)
"""

from __future__ import annotations

import gc
import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig
from plain import FedAvgSpec, FlxRandomness, OwnRandomness, fedavg
from torch import Tensor, nn
from workloads import Workload

from flx.config import precheck
from flx.datamodules.datamodule import FederatedDataModule
from flx.module import FederatedModule
from flx.run import build, build_net

_OUTPUT_DIR = tempfile.TemporaryDirectory(prefix="flx-bench-")  # paths.output_dir of every run, removed at exit

# the plain loop evaluates nothing, so flx's validation is off in both settings (eval_every = rounds, no batches)
NO_EVAL = ("++trainer.limit_val_batches=0",)
SETTINGS = {
    # what a user gets: the progress bar / console lines, the CSV logger, round checkpoints, the default callbacks
    "defaults": NO_EVAL,
    # everything around the rounds switched off: the floor of flx's own round machinery
    "lean": (
        "logger=none",
        "callbacks=none",
        "++trainer.enable_progress_bar=false",
        "++trainer.enable_checkpointing=false",
        "++trainer.enable_model_summary=false",
        *NO_EVAL,
    ),
}
settings = "defaults"  # which of SETTINGS the runs use (run.py --settings)
DIFF_TOLERANCE = 1e-4  # flx vs plain on the same cohorts and batches: identical maths, fp32 summation order


@dataclass
class Run:
    """One timed run of one side."""

    seconds: float
    steps: int
    params: list[Tensor] = field(repr=False)


@dataclass
class FlxBuild:
    """A built flx run (data, module, trainer) and the initial global weights of its net."""

    cfg: DictConfig
    dm: FederatedDataModule
    module: FederatedModule
    trainer: object
    init: dict[str, Tensor]


def quiet() -> None:
    """Silences Lightning's info lines and known warnings (nothing of them is timed work)."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def overrides(w: Workload, rounds: int, accelerator: str, out_dir: str, threads: int | None = None) -> list[str]:
    """The full flx command line of a workload run: validation off, the rest as :data:`settings` says."""
    return [
        *w.overrides,
        f"algo.rounds={rounds}",
        f"eval_every={rounds}",
        f"trainer.accelerator={accelerator}",
        f"paths.output_dir={out_dir}",
        *([f"num_threads={threads}"] if threads else []),
        *SETTINGS[settings],
    ]


def compose(w: Workload, rounds: int, accelerator: str, threads: int | None = None) -> DictConfig:
    """The composed, validated config (``flx.config.precheck``), as ``train.py`` would build it."""
    return precheck(overrides(w, rounds, accelerator, _OUTPUT_DIR.name, threads))


def build_flx(cfg: DictConfig) -> FlxBuild:
    dm, module, trainer = build(cfg)
    init = {k: v.detach().clone() for k, v in module.net.state_dict().items()}
    return FlxBuild(cfg, dm, module, trainer, init)


def spec(cfg: DictConfig) -> FedAvgSpec:
    """The plain loop's hyper-parameters, from the config the flx run was built from."""
    a = cfg.algo
    if a.momentum or a.weight_decay or a.weighting != "num_samples" or a.server.name != "sgd" or a.server.lr != 1:
        raise ValueError("the plain loop implements FedAvg only: SGD without momentum, n_i weights, server lr 1")
    return FedAvgSpec(
        rounds=a.rounds,
        clients_per_round=a.clients_per_round,
        batch_size=a.batch_size,
        lr=float(a.lr),
        local_steps=a.local_steps,
        local_epochs=a.get("local_epochs"),
        seed=cfg.seed,
    )


@contextmanager
def count_steps(net: nn.Module) -> Iterator[list[int]]:
    """Counts the training-mode calls of ``net`` (its forwards) inside the block: one per local step of either side
    (flx's evaluation forwards, e.g. the divergence rule's loss of the initial model, run in eval mode)."""
    counter = [0]

    def hook(module: nn.Module, args: object) -> None:
        counter[0] += module.training

    handle = net.register_forward_pre_hook(hook)
    try:
        yield counter
    finally:
        handle.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, net: nn.Module) -> tuple[float, int]:
    """Wall-clock seconds of ``fn()`` (after a garbage collection) and the local steps it made with ``net``."""
    gc.collect()
    threads = torch.get_num_threads()
    with count_steps(net) as steps:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        seconds = time.perf_counter() - start
    if torch.get_num_threads() != threads:
        raise RuntimeError(f"the run changed torch's thread count ({threads} -> {torch.get_num_threads()})")
    return seconds, steps[0]


def _params(net: nn.Module) -> list[Tensor]:
    return [p.detach().cpu().clone() for p in net.parameters()]


def run_flx(b: FlxBuild) -> Run:
    """Times ``trainer.fit`` (the whole federated training) of a built run."""
    seconds, steps = timed(
        lambda: b.trainer.fit(b.module, datamodule=b.dm), b.trainer.strategy.root_device, b.module.net
    )
    done = b.module.federation.server.round
    if done != b.cfg.algo.rounds:
        raise RuntimeError(f"flx ran {done} rounds, expected {b.cfg.algo.rounds}")
    return Run(seconds, steps, _params(b.module.net))


def run_plain(b: FlxBuild, matched: bool) -> Run:
    """Times the plain loop on the build's data, model class and initial weights.

    Args:
        b: the flx build whose data, model config and initial weights are used (its trainer is not touched).
        matched: draw flx's cohorts and minibatches (for the equivalence check) instead of the loop's own.
    """
    device = b.trainer.strategy.root_device
    data = b.dm.data
    net = build_net(b.cfg.model, data.input_shape, data.num_classes).to(device)
    net.load_state_dict(b.init)
    x, y = data.x_train.to(device), data.y_train.to(device)
    clients: Sequence[Tensor] = [c.to(device) for c in b.dm.client_train]
    s = spec(b.cfg)
    rand = FlxRandomness(s.seed) if matched else OwnRandomness(s.seed)
    seconds, steps = timed(lambda: fedavg(net, x, y, clients, s, rand), device, net)
    return Run(seconds, steps, _params(net))


def max_abs_diff(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


def _stacked(w: Workload) -> bool:
    """``algo.vectorize=true``: flx calls the net once per stacked step of all its clients (``functional_call``
    under ``vmap``), so the step counts cannot be compared; the final-model check on the same cohorts and batches
    stands for them."""
    return "algo.vectorize=true" in w.overrides


def check(w: Workload, accelerator: str, threads: int | None) -> tuple[float, int]:
    """flx and the plain loop on flx's cohorts and batches: same steps, same final model. Returns (diff, steps)."""
    b = build_flx(compose(w, w.check_rounds, accelerator, threads))
    f, p = run_flx(b), run_plain(b, matched=True)
    if (f.steps != p.steps and not _stacked(w)) or f.steps == 0 or p.steps == 0:
        raise AssertionError(f"workload {w.key}: flx made {f.steps} local steps, the plain loop {p.steps}")
    diff = max_abs_diff(f.params, p.params)
    if diff > DIFF_TOLERANCE:
        raise AssertionError(f"workload {w.key}: final models differ by {diff:.3g} (> {DIFF_TOLERANCE})")
    run_plain(b, matched=False)  # warm-up of the timed plain variant
    return diff, p.steps


def measure(
    w: Workload, rounds: int, repeats: int, accelerator: str, threads: int | None
) -> tuple[list[float], list[float], int]:
    """Alternating timed runs; returns the flx and plain seconds and the (common) step count per run."""
    cfg = compose(w, rounds, accelerator, threads)
    flx_s, plain_s, steps = [], [], set()
    for i in range(repeats):
        b = build_flx(cfg)
        order = ("flx", "plain") if i % 2 == 0 else ("plain", "flx")
        runs = {side: run_flx(b) if side == "flx" else run_plain(b, matched=False) for side in order}
        if runs["flx"].steps != runs["plain"].steps and not _stacked(w):
            raise AssertionError(f"workload {w.key}: flx made {runs['flx'].steps} steps, plain {runs['plain'].steps}")
        flx_s.append(runs["flx"].seconds)
        plain_s.append(runs["plain"].seconds)
        steps.add(runs["flx"].steps)
        pair = f"flx {flx_s[-1]:.3f}s  plain {plain_s[-1]:.3f}s  ratio {flx_s[-1] / plain_s[-1]:.2f}"
        print(f"  [{w.key}] run {i + 1}/{repeats} ({' then '.join(order)}): {pair}", flush=True)
        del b, runs
    return flx_s, plain_s, steps.pop() if len(steps) == 1 else -1
