"""The contract of a federated round inside Lightning (``flx.loop``), pinned on a real Trainer built by
``flx.run.build`` (Lightning 2.6, one process).

A recording part logs every federated hook and every Lightning callback hook it receives, with the round, to one
list. Round ``t`` (0-based; Lightning's epoch ``t``) must run as follows, and nothing else may fire
(Lightning's per-step hooks ``on_before_backward``, ``on_before_optimizer_step``, ... never do: the local steps are
flx's own, not Lightning's):

.. code-block:: text

    sample_clients, on_round_start      FederatedFitLoop.on_advance_start: before any epoch hook
    on_train_epoch_start                the loop has set the round's one batch: this rank's shard (the bar's total)
    on_train_batch_start                once: the batch is the shard
        per client of the shard:
            on_client_start             the net holds w^t
            K x (sample_batch, local_loss, on_local_grad, on_local_step_end)
            on_client_end
            on_train_client_end         a Lightning callback's per-client tick (the progress bar's client bar)
    on_train_batch_end
    on_server_step, on_round_end        FederatedEpochLoop.on_advance_end after the batch: before validation
    on_validation_start ... end         Lightning's check inside the epoch loop, if (t + 1) % eval_every == 0
    on_train_epoch_end                  after validation (Lightning 2.x validates inside the epoch loop)
    on_save_checkpoint                  RoundCheckpoint (a monitoring callback: after the module's epoch-end hook)

``on_fit_start`` and ``on_train_start`` come once before round 0's ``sample_clients``; ``on_train_end`` and
``on_fit_end`` once after the last round, where ``trainer.current_epoch`` is already ``algo.rounds``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from omegaconf import DictConfig
from torch import Tensor

from flx.checkpoint_io import load
from flx.config import precheck
from flx.hooks import FederatedCallback
from flx.run import build

pytestmark = pytest.mark.slow

K = 2  # local steps
COHORTS = ((0, 1, 2), (3, 1), (2, 0, 3))  # rounds of 3, 2 and 3 clients: the slots change from round to round
TINY = [
    "data=digits",
    "model=mlp",
    "model.hidden=[8]",
    "partition=iid",
    "partition.num_clients=4",
    "algo.clients_per_round=2",
    f"algo.local_steps={K}",
    "logger=none",
    "callbacks.round_curves=null",
    "callbacks.progress_bar.mode=bar",  # the client bar is drawn (to the captured stderr): its total is checked
    "trainer.accelerator=cpu",
    "checkpoint.keep_last=null",
    "+algo.parts.rec._target_=test_loop.Recorder",
]
LOCAL = ("sample_batch", "local_loss", "on_local_grad", "on_local_step_end")
VALIDATION = ("on_validation_start", "on_validation_epoch_start", "on_validation_epoch_end", "on_validation_end")
# every Lightning callback hook but the per-batch validation ones (their count depends on the evaluation loaders)
LIGHTNING = tuple(
    n
    for n in dir(Callback)
    if n.startswith("on_") and n not in ("on_exception", "on_validation_batch_start", "on_validation_batch_end")
)


def _snapshot(tensors: list[Tensor]) -> list[Tensor]:
    return [t.detach().clone() for t in tensors]


class Recorder(FederatedCallback):
    """Test part: records every hook call as ``(round, hook[, client[, step]])`` in :attr:`events`; what a hook saw
    (models, totals, files) goes to :attr:`seen` under the same key. With ``cohorts`` it picks round ``t``'s cohort."""

    def __init__(self, cohorts: list[list[int]] | None = None) -> None:
        self.cohorts = [list(c) for c in cohorts] if cohorts is not None else None
        self.events: list[tuple[Any, ...]] = []
        self.seen: dict[tuple[Any, ...], Any] = {}
        self.trainer: pl.Trainer | None = None

    def _add(self, *event: Any, seen: Any = None) -> None:
        self.events.append(event)
        if seen is not None:
            self.seen[event] = seen

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.trainer = trainer

    # ------------------------------------------------------------------ federated hooks
    def on_attach(self, fed) -> None:
        self._add(self.trainer.current_epoch, "on_attach")

    def local_update(self, fed, client):
        self._add(client.round.round, "local_update", client.cid)
        return None  # defer to the K SGD steps

    def sample_clients(self, fed, round_idx, rng):
        self._add(round_idx, "sample_clients")
        return None if self.cohorts is None else self.cohorts[round_idx]

    def on_round_start(self, fed, rnd) -> None:
        folder = Path(self.trainer.checkpoint_callback.dirpath)
        files = sorted(p.name for p in folder.glob("round_*.ckpt"))
        global_step = self.trainer.global_step
        self._add(rnd.round, "on_round_start", seen=(rnd, files, global_step, _snapshot(fed.global_params)))

    def on_client_start(self, fed, client) -> None:
        self._add(
            client.round.round,
            "on_client_start",
            client.cid,
            seen=(_snapshot(fed.params), _snapshot(fed.global_params)),
        )

    def sample_batch(self, fed, client):
        self._add(client.round.round, "sample_batch", client.cid, client.step)
        return None

    def local_loss(self, fed, client, loss):
        self._add(client.round.round, "local_loss", client.cid, client.step)
        return loss

    def on_local_grad(self, fed, client) -> None:
        self._add(client.round.round, "on_local_grad", client.cid, client.step)

    def on_local_step_end(self, fed, client) -> None:
        self._add(client.round.round, "on_local_step_end", client.cid, client.step)

    def on_client_end(self, fed, client) -> None:
        self._add(client.round.round, "on_client_end", client.cid, seen=(_snapshot(fed.params), client.weight))

    def on_server_step(self, fed, rnd, mean) -> None:
        self._add(rnd.round, "on_server_step", seen=(_snapshot(mean), _snapshot(fed.global_params)))

    def on_round_end(self, fed, rnd) -> None:
        self._add(rnd.round, "on_round_end", seen=(_snapshot(fed.params), _snapshot(fed.global_params)))

    # ------------------------------------------------------------------ Lightning hooks with something to look at
    def on_train_start(self, trainer, pl_module) -> None:
        self._add(trainer.current_epoch, "on_train_start", seen=_snapshot(pl_module.federation.params))

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._add(trainer.current_epoch, "on_train_epoch_start", seen=trainer.num_training_batches)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        total = trainer.progress_bar_callback.clients.total
        self._add(trainer.current_epoch, "on_train_batch_start", tuple(batch), seen=total)

    def on_train_client_end(self, trainer, pl_module, cid) -> None:
        self._add(trainer.current_epoch, "on_train_client_end", cid)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._add(
            trainer.current_epoch, "on_train_batch_end", tuple(batch), seen=trainer.progress_bar_callback.clients.n
        )

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._add(trainer.current_epoch, "on_validation_epoch_start", seen=_snapshot(pl_module.federation.params))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._add(trainer.current_epoch, "on_save_checkpoint", seen=trainer.global_step)


def _record_only(name: str):
    def hook(self: Recorder, trainer: pl.Trainer, *args: Any) -> None:
        self._add(trainer.current_epoch, name)

    hook.__name__ = name
    return hook


for _name in LIGHTNING:
    if _name not in vars(Recorder):
        setattr(Recorder, _name, _record_only(_name))


# ---------------------------------------------------------------------- running and the expected order
def _fit(out: Path, *overrides: str) -> tuple[Recorder, pl.Trainer, DictConfig]:
    cfg = precheck([*TINY, *overrides, f"paths.output_dir={out}"])
    dm, module, trainer = build(cfg)
    trainer.fit(module, datamodule=dm)
    return next(cb for cb in trainer.callbacks if isinstance(cb, Recorder)), trainer, cfg


def _shards(rec: Recorder) -> list[tuple[int, ...]]:
    return [rec.seen[e][0].shard for e in rec.events if e[1] == "on_round_start"]


def expected_events(shards: list[tuple[int, ...]], validated: set[int]) -> list[tuple[Any, ...]]:
    """The order of the module docstring, for rounds that train ``shards[t]``; validation after the rounds (1-based)
    in ``validated``."""
    events: list[tuple[Any, ...]] = [(0, "on_fit_start"), (0, "on_attach"), (0, "on_train_start")]
    for t, shard in enumerate(shards):
        events += [(t, "sample_clients"), (t, "on_round_start"), (t, "on_train_epoch_start")]
        events += [(t, "on_train_batch_start", tuple(shard))]
        for cid in shard:
            events += [(t, "on_client_start", cid), (t, "local_update", cid)]
            events += [(t, hook, cid, k) for k in range(K) for hook in LOCAL]
            events += [(t, "on_client_end", cid), (t, "on_train_client_end", cid)]
        events += [(t, "on_train_batch_end", tuple(shard))]
        events += [(t, "on_server_step"), (t, "on_round_end")]
        events += [(t, hook) for hook in VALIDATION] if t + 1 in validated else []
        events += [(t, "on_train_epoch_end"), (t, "on_save_checkpoint")]
    return events + [(len(shards), "on_train_end"), (len(shards), "on_fit_end")]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Recorder, pl.Trainer, DictConfig]:
    """3 rounds of 3, 2, 3 clients, K=2, validation every round, progress bar on, every round's checkpoint kept."""
    cohorts = "[" + ",".join("[" + ",".join(map(str, c)) + "]" for c in COHORTS) + "]"
    return _fit(tmp_path_factory.mktemp("loop"), "algo.rounds=3", f"+algo.parts.rec.cohorts={cohorts}")


# ---------------------------------------------------------------------- the tests
def test_hook_order_of_a_round(run: tuple[Recorder, pl.Trainer, DictConfig]) -> None:
    """Every hook of the 3 rounds, in the module docstring's order, exactly: sampling and ``on_round_start`` before
    ``on_train_epoch_start``; one ``on_train_batch_start``/``end`` pair around the round's clients (the batch is the
    shard), each client's hooks with the local hooks K times in order, then its ``on_train_client_end``; the server
    step after the batch and before validation; ``on_train_epoch_end`` after
    validation; the round's checkpoint last."""
    rec, _, _ = run
    shards = _shards(rec)
    assert [tuple(sorted(s)) for s in shards] == [tuple(sorted(c)) for c in COHORTS]
    assert rec.events == expected_events(shards, validated={1, 2, 3})


@pytest.mark.parametrize(
    ("overrides", "rounds", "validated"),
    [(["eval_every=2"], 5, {2, 4}), (["data.val_fraction=0"], 2, set())],
    ids=["eval_every=2", "val_fraction=0"],
)
def test_validation_cadence(tmp_path: Path, overrides: list[str], rounds: int, validated: set[int]) -> None:
    """``eval_every=e`` is Lightning's ``check_val_every_n_epoch``: validation after rounds e, 2e, ... only (not at
    the last round 5 when it is not a multiple); ``data.val_fraction=0`` has no validation loader, and no validation
    hook fires at all. The rest of the order is unchanged."""
    rec, trainer, cfg = _fit(tmp_path, f"algo.rounds={rounds}", *overrides)
    assert trainer.check_val_every_n_epoch == cfg.eval_every
    ran = {t + 1 for t, hook, *_ in rec.events if hook == "on_validation_epoch_start"}
    assert ran == validated
    assert rec.events == expected_events(_shards(rec), validated)


def test_checkpoint_at_each_round_end(run: tuple[Recorder, pl.Trainer, DictConfig]) -> None:
    """``RoundCheckpoint`` writes ``round_{t+1:05d}.ckpt`` once per round, after validation and
    ``on_train_epoch_end`` (see the order test), with ``trainer.global_step`` = rounds done (a round is one step);
    the file of round r is on disk when round r+1's ``on_round_start`` runs; the file holds the state after r
    rounds."""
    rec, trainer, cfg = run
    rounds_so_far = [r + 1 for r in range(len(COHORTS))]
    saves = [(e[0], rec.seen[e]) for e in rec.events if e[1] == "on_save_checkpoint"]
    assert saves == list(enumerate(rounds_so_far))
    starts = [rec.seen[e] for e in rec.events if e[1] == "on_round_start"]
    # written in the background: at round t's start round t-1's file may still be in flight, the earlier ones are on
    # disk (at most one checkpoint in flight), and after fit all of them are
    on_disk = [files for _, files, _, _ in starts]
    assert all(f[: t - 1] == [f"round_{r:05d}.ckpt" for r in range(1, t)] for t, f in enumerate(on_disk))
    assert all(len(f) in (t - 1, t) if t else f == [] for t, f in enumerate(on_disk))
    folder = Path(cfg.checkpoint.dirpath)
    assert sorted(p.name for p in folder.glob("round_*.ckpt")) == [f"round_{r:05d}.ckpt" for r in range(1, 4)]
    assert [step for _, _, step, _ in starts] == [0, *rounds_so_far[:-1]]
    assert trainer.global_step == rounds_so_far[-1]
    for r, steps in enumerate(rounds_so_far, start=1):
        ckpt = load(str(Path(cfg.checkpoint.dirpath) / f"round_{r:05d}.ckpt"))
        assert (ckpt["epoch"], ckpt["global_step"], ckpt["flx"]["round"]) == (r - 1, steps, r)


def test_progress_bar_total_is_the_rounds_clients(run: tuple[Recorder, pl.Trainer, DictConfig]) -> None:
    """The loop sets ``fit_loop.max_batches = 1`` (the round's one batch) before ``on_train_epoch_start``
    (``RoundLoader`` has no length); the client bar's total is this rank's clients of the round: 3, 2, 3, reset at
    every round, and it has counted every client (``on_train_client_end``) when the batch ends."""
    rec, _, _ = run
    per_round = {e[0]: rec.seen[e] for e in rec.events if e[1] == "on_train_epoch_start"}
    assert per_round == {t: 1 for t in range(len(COHORTS))}
    totals = [(e[0], rec.seen[e]) for e in rec.events if e[1] == "on_train_batch_start"]
    assert totals == [(t, len(c)) for t, c in enumerate(COHORTS)]
    counted = [(e[0], rec.seen[e]) for e in rec.events if e[1] == "on_train_batch_end"]
    assert counted == [(t, len(c)) for t, c in enumerate(COHORTS)]


def test_limit_train_batches_caps_the_slots(tmp_path: Path) -> None:
    """``trainer.limit_train_batches=2`` (an int) trains at most 2 clients per rank and round (the first 2 of the
    shard): the bar's total is min(shard, 2); the round still ends, validates and checkpoints."""
    rec, trainer, _ = _fit(tmp_path, "algo.rounds=2", "algo.clients_per_round=3", "trainer.limit_train_batches=2")
    shards = [s[:2] for s in _shards(rec)]
    assert rec.events == expected_events(shards, validated={1, 2})
    assert {rec.seen[e] for e in rec.events if e[1] == "on_train_batch_start"} == {2}
    assert trainer.global_step == 2  # rounds


def _equal(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_clients_start_from_w_t_and_the_round_ends_with_the_new_model(
    run: tuple[Recorder, pl.Trainer, DictConfig],
) -> None:
    """With FedAvg (server SGD, lr 1: an exact copy of the mean):

    * ``on_round_start`` of round t: ``fed.global_params`` = w^t, the model ``on_round_end`` of round t-1 left (w^0:
      the net at ``on_train_start``);
    * ``on_client_start``: the net holds exactly w^t (bitwise), whatever the previous client trained;
    * ``on_client_end``: the net holds the local model w_i != w^t;
    * ``on_server_step``: ``fed.global_params`` still hold w^t, ``mean`` = sum_i p_i w_i / sum_i p_i (p_i = n_i);
    * ``on_round_end``: the net = ``fed.global_params`` = ``mean`` (bitwise) = w^{t+1};
    * ``on_validation_epoch_start``: the net still holds w^{t+1}, the model validation sees.
    """
    rec, _, _ = run
    by_round: dict[int, dict[tuple[Any, ...], Any]] = {}
    for event, seen in rec.seen.items():
        by_round.setdefault(event[0], {})[event[1:]] = seen
    w = rec.seen[(0, "on_train_start")]
    for t in range(len(COHORTS)):
        seen = by_round[t]
        assert _equal(seen[("on_round_start",)][3], w)
        ups, weights = [], []
        for cid in COHORTS[t]:
            net, global_params = seen[("on_client_start", cid)]
            assert _equal(net, w) and _equal(global_params, w)
            local, weight = seen[("on_client_end", cid)]
            assert not _equal(local, w)
            ups.append(local)
            weights.append(weight)
        mean, global_params = seen[("on_server_step",)]
        assert _equal(global_params, w)
        for i, m in enumerate(mean):
            expected = sum(p * up[i] for p, up in zip(weights, ups)) / sum(weights)
            torch.testing.assert_close(m, expected, rtol=0, atol=1e-6)
        net, global_params = seen[("on_round_end",)]
        assert _equal(net, mean) and _equal(global_params, mean)
        assert _equal(seen[("on_validation_epoch_start",)], mean)
        w = mean
