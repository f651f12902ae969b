r"""Sub-network scheduling: each client trains a width sub-model of ONE full-width net, its level chosen per round.

H. Su et al., "WHALE-FL: Wireless and Heterogeneity Aware Latency Efficient Federated Learning over Mobile Devices via
Adaptive Subnetwork Scheduling", 2024 (Eqs. 1-2 in "FL with Subnetwork Extraction", Eqs. 3-10 in "Fisher Information"
and "WHALE-FL Design"). Also the fixed-size baselines it extends: HeteroFL (Diao et al., ICLR 2021; prefix channels),
FedRolex (Alam et al., NeurIPS 2022; rolling) and Federated Dropout (Caldas et al., 2018; random channels). Per round
``r`` and client ``i`` (the paper's Eqs. 4-9):

.. math::
    p_{i,r} = \max\big(\hat p(\min(TE_{i,r} SE_{i,r}^{\beta} / U_{th}, 1)),\ p_i^{max}\big), \qquad
    \rho_{i,r} = s^{p_{i,r} - 1}

(Eqs. 4-9, :mod:`flx.parts.systems.whale_utility`), then local SGD on the sub-model (masked weights and gradients) and
``algo.aggregator=count_mean``: each entry is the mean over the clients whose sub-model holds it (Eqs. 1-2, 10).
``scheduler``: ``whale`` (Eq. 6), ``te_only`` / ``se_only`` (ablations), ``fixed`` (``p = p^max`` of the device
type: HeteroFL / FedRolex / FedDropout with ``extractor=prefix|rolling|random``), ``full`` (``p = 1``: FedAvg).

Choices the paper leaves open (docs/whale.md): ``FI`` per batch (``fisher``), the window holds the client's last
``D`` rounds **in which it trained** (per round the mean of ``FI^2`` over its batches, one length-N registered
statistic, so a round is one all-reduce); ``|B|`` = ``ceil(n_i / B)`` batches (``te_batches``: or ``steps``, or
``samples`` as the code); a client with an empty window (cold start) trains the smallest level ``P`` (the code's
``FI = 1e-5`` has this effect); ``p^max`` per device type is our assumption (``max_levels``). Static BN: the global
model's statistics are rebuilt on the training rows before each validation and test and cleared after.

Symbols: ``beta``, ``u_th`` (``U_th``), ``T``, ``D``, ``P`` (``levels``), ``s``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from typing_extensions import override

from flx.errors import MAX_INT, ConfigError, bad_value, check_fields, count
from flx.hooks import FederatedCallback
from flx.models.scalable import clear_bn_stats, rebuild_bn_stats
from flx.models.width import MODES, apply_masks, mask_grads, masks_from_indices, width_indices
from flx.parts.systems import whale_report as report
from flx.parts.systems import whale_utility as wu
from flx.sampling import derive_seed
from flx.traits import Channel, PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView, Round
    from flx.hooks import Build


@runtime_checkable
class Scalable(Protocol):
    """A net whose width the part sets (:mod:`flx.models.scalable`, :mod:`flx.models.scalable_lm`)."""

    def set_width(self, ratio: float, indices: Mapping[str, Tensor] | None = None) -> None: ...


def _scalable(net: nn.Module) -> Scalable:
    """``net``, which ``check`` admitted for having ``set_width``."""
    if not isinstance(net, Scalable):
        raise ConfigError(f"WHALE-FL: {type(net).__name__} has no set_width (use a scalable model)")
    return net


_MASK_TAG, _LABEL_TAG = 0x57A1, 0x57A2
_FI2 = "whale/fi2"  # (N,): each trained client's mean of FI^2 over its batches this round
#: our assumption (the paper gives no W^max per device type): the testbed's types from most to least capable
MAX_LEVELS = {"MacBookPro2018": 1, "Xavier": 2, "TX2": 3, "Nano": 4, "RaspberryPi": 5}
TE_BATCHES = ("batches", "steps", "samples")


@dataclass(frozen=True)
class SubnetworkParams:
    """See the module docstring; ``bn_batch``: chunk rows of the static-BN rebuild; ``target_acc``: log
    ``sim/time_to_target`` when ``target_metric`` first reaches it."""

    scheduler: str = "whale"
    extractor: str = "prefix"
    fisher: str = "trace_empirical"
    fisher_samples: int | None = None
    fisher_batches: int | None = None  # FI on the round's first this many local steps only (None: every step)
    beta: float = 2.0
    u_th: float = 20000.0
    T: float = 20.0
    D: int = 10
    levels: int = 5
    s: float = 0.5
    te_batches: str = "batches"
    max_levels: Mapping[str, int] = field(default_factory=lambda: dict(MAX_LEVELS))
    label_aware: bool = False
    bn_batch: int = 1024
    target_acc: float | None = None
    target_metric: str = "val/acc"
    track_fisher: bool | None = None  # None: only when the scheduler reads TE (whale, te_only)


class Subnetwork(FederatedCallback):
    """Per-round width levels (WHALE-FL or fixed), sub-model masks, Fisher windows and static-BN evaluation."""

    traits = PartTraits(
        uploads={_FI2: Channel("its Fisher values (WHALE-FL's level schedule)")},
        aggregator=("count_mean", "sub-networks need count_mean"),
        metrics=("whale/*", "sim/time_to_target"),
    )

    def __init__(self, **params: Any) -> None:
        if "max_levels" in params and params["max_levels"] is not None:
            levels = params["max_levels"]
            if not isinstance(levels, Mapping):
                raise bad_value("algo.max_levels", levels, "a mapping from device type to its largest level")
            for k, v in levels.items():
                count(f"algo.max_levels.{k}", v, 1)
            params["max_levels"] = {str(k): v for k, v in levels.items()}
        self.params = p = SubnetworkParams(**params)
        check_fields(p, "algo.")
        for key, value, allowed in (
            ("scheduler", p.scheduler, wu.SCHEDULERS),
            ("extractor", p.extractor, MODES),
            ("fisher", p.fisher, wu.FISHER),
            ("te_batches", p.te_batches, TE_BATCHES),
        ):
            if value not in allowed:
                raise bad_value(f"algo.{key}", value, f"allowed: {', '.join(allowed)}")
        for key, number in (("beta", p.beta), ("u_th", p.u_th), ("T", p.T), ("s", p.s)):
            if not number > 0:
                raise bad_value(f"algo.{key}", number, "must be > 0")
        if p.fisher_samples is not None and p.fisher_samples < 1:
            raise bad_value("algo.fisher_samples", p.fisher_samples, ">= 1, or null for the whole batch")
        if p.fisher_batches is not None and p.fisher_batches < 1:
            raise bad_value("algo.fisher_batches", p.fisher_batches, ">= 1, or null for every local step")
        if p.D < 1 or p.levels < 1:
            raise bad_value("algo.D" if p.D < 1 else "algo.levels", min(p.D, p.levels), "must be >= 1")
        count("algo.bn_batch", p.bn_batch, 1, MAX_INT)
        if p.target_acc is not None and not 0 <= p.target_acc <= 1:
            raise bad_value("algo.target_acc", p.target_acc, "a fraction in [0, 1] that target_metric reaches, or null")
        for device, v in p.max_levels.items():
            if not 1 <= v <= p.levels:
                why = f"a level in 1..{p.levels} (algo.levels={p.levels}: raise it or lower this)"
                raise bad_value(f"algo.max_levels.{device}", v, why)
        self.windows: list[list[float]] = []  # per client, the last D rounds' mean FI^2 (oldest first)
        self.levels: dict[int, int] = {}  # this round's level per cohort client
        self.time_to_target: float | None = None
        self._fed: FederationView | None = None
        self._log: dict[str, float] = {}
        self._utils: list[float] = []  # this round's Util values (for calibrating U_th: whale/util_median)
        # per round: {"round" (1-based, as fl/round), "clock", "level": {cid: p}, "fi": {cid: sqrt(mean FI^2)}}
        # -> whale.json, W&B
        self.history: list[dict[str, Any]] = []
        # the per-batch Fisher is the costliest part of a round; the fixed / full / SE-only schedulers never read it
        self.track_fisher = p.track_fisher if p.track_fisher is not None else p.scheduler in ("whale", "te_only")

    # ------------------------------------------------------------------ setup
    @override
    def check(self, build: Build) -> None:
        """The simulated devices, a width-scalable net, a device profile per level and a level cap per device type:
        all decided by the config, checked before anything is written (the aggregator: ``traits.aggregator``)."""
        p, fed, net, num_clients = self.params, build, build.net, build.clients.num_train_clients
        if fed.system is None:
            raise ConfigError("system=none: sub-network scheduling needs simulated devices, e.g. system=mobile20")
        if not hasattr(net, "width_groups") or not hasattr(net, "set_width"):
            raise bad_value(
                "model",
                type(net).__name__,
                "not width-scalable: use model=cnn_scalable|resnet18_scalable|transformer_scalable",
            )
        for level in range(1, p.levels + 1):
            if wu.width(level, p.s) not in fed.system.widths:
                raise bad_value("algo.levels", p.levels, f"width s^{level - 1} has no device profile (s={p.s})")
        types = {fed.system.device_type(c) for c in range(num_clients)}
        if missing := sorted(types - set(p.max_levels)):
            raise bad_value("algo.max_levels", dict(p.max_levels), f"no level for device types {missing}")

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.windows = [[] for _ in range(fed.num_clients)]  # a resumed run's checkpoint replaces them
        fed.register_stat(_FI2, torch.zeros(fed.num_clients, dtype=fed.params[0].dtype))
        self._fed = fed

    # ------------------------------------------------------------------ server: levels
    def client_level(self, fed: FederationView, cid: int, round_idx: int) -> int:
        """``p_{i,r}`` (identical on every rank: the windows and the simulator are)."""
        p, system = self.params, fed.system
        assert system is not None  # check: WHALE-FL runs on simulated devices
        p_max = p.max_levels[system.device_type(cid)]
        if p.scheduler == "full":
            return 1
        if p.scheduler == "fixed":
            return p_max
        window = self.windows[cid]
        if p.scheduler != "se_only" and not window:
            return p.levels  # cold start: no Fisher history yet
        te = wu.training_efficiency(window, self._te_batches(fed, cid)) if window else 0.0
        t_co, t_tr = system.unit_times(cid, round_idx, steps=fed.client_steps(cid))
        util = wu.utility(te, t_co, t_tr, T=p.T, beta=p.beta, mode=p.scheduler)
        self._utils.append(util)
        return wu.level(util, u_th=p.u_th, levels=p.levels, p_max=p_max)

    def _te_batches(self, fed: FederationView, cid: int) -> int:
        n = fed.num_samples(cid)
        return {"batches": -(-n // fed.cfg.batch_size), "steps": fed.client_steps(cid), "samples": n}[
            self.params.te_batches
        ]

    @override
    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        self._utils = []
        self.levels = {cid: self.client_level(fed, cid, rnd.round) for cid in rnd.cohort}
        for cid, level in self.levels.items():
            rnd.set_width(cid, wu.width(level, self.params.s))

    @override
    def on_round_end(self, fed: FederationView, rnd: Round) -> None:
        _scalable(fed.net).set_width(1.0)  # also after a dropped last client, whose on_client_end never ran
        stat, left_out = fed.stat(_FI2), set(fed.faults.dropped) | set(fed.faults.skipped)
        assert isinstance(stat, Tensor)  # registered as one tensor
        trained = [c for c in rnd.cohort if c not in left_out]
        fi2: list[float] = stat.cpu().tolist()  # one copy to the host a round
        for cid in trained if self.track_fisher else ():
            self.windows[cid] = [*self.windows[cid], fi2[cid]][-self.params.D :]
        counts = {q: sum(v == q for v in self.levels.values()) for q in range(1, self.params.levels + 1)}
        self._log = {f"whale/level_{q}": float(k) for q, k in counts.items()}
        self._log["whale/width_mean"] = sum(rnd.width(c) for c in rnd.cohort) / max(len(rnd.cohort), 1)
        rms = [math.sqrt(max(fi2[c], 0.0)) for c in trained]
        if self.track_fisher:
            self._log["whale/fi_mean"] = sum(rms) / len(rms) if rms else 0.0
        if self._utils:
            self._log["whale/util_median"] = sorted(self._utils)[len(self._utils) // 2]
        fis = dict(zip(trained, rms)) if self.track_fisher else {}
        clock = fed.clock.elapsed if fed.clock is not None else None
        self.history.append({"round": rnd.round + 1, "clock": clock, "level": dict(self.levels), "fi": fis})

    # ------------------------------------------------------------------ client: masks, gradients, Fisher
    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        rho, r = client.round.width(client.cid), client.round.round
        gen = torch.Generator().manual_seed(derive_seed(fed.cfg.seed, r, client.cid, _MASK_TAG))
        classes = None
        if self.params.label_aware:  # token targets: the ids of the scored positions (-100 marks the others)
            classes = torch.unique(fed.data.y[fed.data.client_indices[client.cid]]).cpu()
            classes = classes[classes >= 0]
        indices = width_indices(fed.net, rho, self.params.extractor, round_idx=r, generator=gen)
        client.masks = masks_from_indices(fed.net, indices, classes=classes)
        apply_masks(fed.local_state, client.masks)
        _scalable(fed.net).set_width(rho, indices=indices)  # the LM's LayerNorms and attention read the kept channels
        client.extras["whale_fi2"] = [0.0, 0]
        if self.params.fisher == "trace_sampled":
            seed = derive_seed(fed.cfg.seed, r, client.cid, _LABEL_TAG)
            client.extras["whale_labels"] = torch.Generator(device=fed.params[0].device).manual_seed(seed)

    @override
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        assert client.masks is not None  # on_client_start sets them
        mask_grads(fed.params, client.masks)
        last = self.params.fisher_batches
        if not self.track_fisher or (last is not None and client.step >= last):
            return  # an approximation of TE for cost: the mean of FI^2 over the round's first steps only
        assert client.batch is not None  # the step's batch, set before on_local_grad
        x, y = client.batch
        gen = client.extras.get("whale_labels")
        p = self.params
        fi = wu.batch_fisher_tensor(fed.net, fed.loss_fn, x, y, client.masks, p.fisher, gen, samples=p.fisher_samples)
        acc = client.extras["whale_fi2"]
        acc[0], acc[1] = acc[0] + fi * fi, acc[1] + 1

    @override
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        _scalable(fed.net).set_width(1.0)
        total, count = client.extras.pop("whale_fi2")  # total: a float64 scalar on the device (no sync per step)
        value, stat = total / max(count, 1), fed.stat(_FI2)
        assert isinstance(stat, Tensor)  # registered as one tensor
        stat[client.cid] += value.to(stat.dtype) if isinstance(value, Tensor) else value  # this rank's clients' slots

    # ------------------------------------------------------------------ evaluation: static BN, logging
    def _rebuild_bn(self, pl_module: pl.LightningModule) -> None:
        fed = self._fed
        if fed is None:
            return
        rows = torch.cat([fed.data.client_indices[c] for c in range(fed.num_clients)])
        rebuild_bn_stats(fed.net, fed.data.x[rows], self.params.bn_batch)

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rebuild_bn(pl_module)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        clear_bn_stats(pl_module)

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rebuild_bn(pl_module)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        clear_bn_stats(pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        p, fed = self.params, self._fed
        if p.target_acc is not None and self.time_to_target is None and fed is not None and fed.clock is not None:
            value = trainer.callback_metrics.get(p.target_metric)
            if value is not None and float(value) >= p.target_acc:
                self.time_to_target = fed.clock.elapsed
        values = dict(self._log)
        if self.time_to_target is not None:
            values["sim/time_to_target"] = self.time_to_target
        if values:
            pl_module.log_dict(values, on_epoch=True)
        if self.history:
            report.log_histograms(trainer, self.history[-1], p.levels)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``whale.json`` and, with W&B, the history table and the Fisher trace (:func:`report.write_history`)."""
        if trainer.is_global_zero and self.history and not trainer.fast_dev_run:  # type: ignore[attr-defined]  # set by lightning trainer/setup.py, undeclared
            system = self._fed.system if self._fed is not None else None
            report.write_history(trainer, self.history, system, self.params.s)

    def fisher_trace(self) -> dict[str, list[tuple[float, float]]]:
        """Each client's Fisher value at the clock of the rounds it trained in (:func:`report.fisher_trace`)."""
        return report.fisher_trace(self.history)

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        windows = [list(w) for w in self.windows]
        return {"windows": windows, "time_to_target": self.time_to_target, "history": self.history, "round_base": 1}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.windows = [list(w) for w in state_dict["windows"]]
        self.time_to_target = state_dict.get("time_to_target")
        # a checkpoint without "round_base" (flx before the history counted rounds as fl/round does) has 0-based ones
        shift = 1 - state_dict.get("round_base", 0)
        self.history = [{**h, "round": h["round"] + shift} for h in state_dict.get("history", [])]
