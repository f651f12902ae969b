r"""AugFL's server step with a server-only pretrained model (PM): :math:`\lambda \nabla_\theta R_h(\theta^t, \theta_p)`.

S. Yue, Z. Qin, Y. Deng, J. Ren, Y. Zhang, J. Zhang, "AugFL: Augmenting Federated Learning with Pretrained Models",
Algorithm 1 step 3.2, Eq. 13, Section V. With the clients'
uploads summed by ``algo.aggregator=admm_sum`` (``mean`` :math:`= \sum_i u_i / \sum_i \rho_i`,
:class:`~flx.parts.meta_learning.meta_update.MetaUpdate`):

.. math::
    \theta^{t+1} = \frac{\sum_i (y_i^t + \rho_i \theta_i^t) - \lambda G^t}{\sum_i \rho_i}
    = \text{mean} - \frac{\lambda}{\sum_i \rho_i} G^t, \qquad G^t = \nabla_\theta R_h(\theta^t, \theta_p)
    \text{ on } \mathcal D_s.

:math:`\mathcal D_s` is the server split (``data.server_fraction``: ``fed.resources.rows``, rows no client holds) and
:math:`\theta_p` the frozen PM ``server.models.<pm>`` (``fed.resources.models``); neither reaches a client. :math:`G^t`
is computed once, on rank 0 (``fed.on_server``), and broadcast. ``rh`` (:mod:`flx.losses.distill`):

- ``crd`` (the paper's experiments): Contrastive Representation Distillation between the penultimate features of
  :math:`\theta^t` and of the PM (:class:`~flx.losses.crd.CRD`; its heads, memory banks and normaliser persist across
  rounds in this part's ``state_dict``);
- ``kd``: logit distillation :math:`T^2\,\mathrm{KL}(p_{\theta_p} \| p_\theta)`;
- ``l2``: :math:`\lVert \theta - \theta_p \rVert^2` (the theory's :math:`R_h`, §IV-C; same architecture), no data.

``gradient`` (the paper's Eq. 13 vs the authors' released code, github.com/zerui981105/AugFL): ``paper`` is the mean
over one epoch of the server rows (minibatches of ``batch_size``) of :math:`\nabla_\theta R_h` at the fixed
:math:`\theta^t`, the CRD heads taking one SGD step per minibatch (they minimise the bound, Eq. 75); ``code`` is the
mean of the minibatch gradients of ``ce_weight`` CE + ``rh_weight`` :math:`R_h` (1.0 and 0.8 in the code) along one
epoch of SGD on a working copy of :math:`\theta^t` and the heads (lr ``head_lr``, momentum, weight decay), the
trajectory then discarded. With ``lam`` = 0 (AugFL without PM) the part does nothing and needs no PM or server rows.

Symbols: ``lam`` (:math:`\lambda`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from flx.aggregation import WeightedMean
from flx.errors import ConfigError, bad_value, check_fields, number_error
from flx.hooks import FederatedCallback
from flx.losses.crd import CRD
from flx.losses.distill import RH_OPTIONS, l2_to_pm_grad, logit_kd
from flx.models.build import net_from_config
from flx.models.features import feature_dim, penultimate
from flx.models.frozen import cache_fingerprint, check_cache, freeze, pretrained_on
from flx.models.pretrain import PretrainParams
from flx.sampling import derive_seed
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import FederationView, Round
    from flx.hooks import Build
    from flx.resources import ServerResources

GRADIENTS = ("paper", "code")
_TAG = 0x414647  # "AFG": the server minibatch order and the CRD negatives of round t


CRD_COUNTS = ("feat_dim", "num_negatives")  # algo.crd's integer keys; the others are real numbers


@dataclass(frozen=True)
class PMParams:
    """``lam`` (:math:`\\lambda`), the regulariser, the PM's name, the server gradient's recipe, CRD's settings."""

    lam: float = 5.0
    rh: str = "crd"
    pm: str = "pm"
    gradient: str = "paper"
    batch_size: int = 128
    kd_temperature: float = 4.0
    ce_weight: float = 1.0
    rh_weight: float = 0.8
    head_lr: float = 0.002
    head_momentum: float = 0.9
    head_weight_decay: float = 5e-4
    crd: dict[str, Any] = field(default_factory=dict)  # CRD's feat_dim, num_negatives, temperature, momentum
    pm_model: dict[str, Any] | None = None  # no server.models.<pm>: the PM's model config, trained on the server rows
    pretrain: dict[str, Any] = field(default_factory=dict)  # its recipe (flx.models.pretrain.PretrainParams)
    cache: str | None = None  # where the trained PM is kept (a resumed run reads it back)


class PMRegularizer(FederatedCallback):
    """Subtracts :math:`\\lambda G^t / \\sum_i \\rho_i` from the ADMM mean (``on_server_step``)."""

    traits = PartTraits(uploads={})  # the server's own rows and models

    def __init__(self, **params: Any) -> None:
        for key in ("crd", "pretrain"):
            params[key] = dict(params.get(key) or {})
        if params.get("pm_model") is not None:
            params["pm_model"] = dict(params["pm_model"])
        self.params = p = PMParams(**params)
        check_fields(p, "algo.", {"batch_size": "algo.kt_batch_size", "gradient": "algo.rh_gradient"})
        PretrainParams(**p.pretrain, key_prefix="algo.pm_pretrain.")  # its checks, before the run writes anything
        for key, value in p.crd.items():
            err = number_error(f"algo.crd.{key}", value, integer=key in CRD_COUNTS)
            if err is not None:
                raise err
        if not p.lam >= 0:
            raise bad_value("algo.lam", p.lam, "the weight lambda of R_h, >= 0 (0: no PM)")
        if p.rh not in RH_OPTIONS:
            raise bad_value("algo.rh", p.rh, f"allowed: {', '.join(RH_OPTIONS)}")
        if p.gradient not in GRADIENTS:
            raise bad_value("algo.rh_gradient", p.gradient, f"allowed: {', '.join(GRADIENTS)}")
        if p.batch_size < 1:
            raise bad_value("algo.kt_batch_size", p.batch_size, ">= 1")
        self.crd: CRD | None = None
        self.pm_net: nn.Module | None = None
        self.head_opt: torch.optim.Optimizer | None = None
        # what the PM trained in the run is made from (flx.models.frozen.cache_fingerprint): set by check, stored next
        # to the cache file; None for a federation built directly from a client store (no server rows, none stored)
        self.cache_fingerprint: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.params.lam > 0

    @override
    def check(self, build: Build) -> None:
        """The PM and the server rows exist; a PM cached by an earlier run (``cache``) was made from this run's
        server rows, model, recipe and seed. Before anything is written. (A federation built directly from a client
        store has no data config to fingerprint: its PM is trained without one.)"""
        if not self.active:
            return
        res, datamodule = self._require(build.resources), build.datamodule
        p = self.params
        if p.pm in res.models or p.cache is None or datamodule is None:
            return
        x, y = build.clients.x[res.rows], build.clients.y[res.rows]
        recipe = {
            k: v
            for k, v in asdict(PretrainParams(**p.pretrain, key_prefix="algo.pm_pretrain.")).items()
            if k != "key_prefix"
        }
        seed = derive_seed(build.cfg.seed, _TAG, 2)
        assert p.pm_model is not None  # _require: server.models has no PM, so pm_model makes one
        self.cache_fingerprint = cache_fingerprint(p.pm_model, x, y, recipe, seed, datamodule.data.num_classes)
        check_cache(p.cache, self.cache_fingerprint, "algo.pm_cache")

    def _require(self, res: ServerResources | None) -> ServerResources:
        """``res`` when it holds what the part needs (the PM, or what makes it; server rows for ``R_h``)."""
        p = self.params
        if res is None or (p.pm not in res.models and p.pm_model is None):
            why = "no such server model: add server.models.pm (scripts/pretrain_pm.py trains one), or algo.lam=0"
            raise bad_value(f"algo.pm={p.pm}", "missing", why)
        if (p.rh != "l2" or p.pm not in res.models) and not len(res.rows):
            raise bad_value("data.server_fraction", 0, f"AugFL's R_h={p.rh} needs server rows: set a fraction > 0")
        return res

    @override
    def on_attach(self, fed: FederationView) -> None:
        if not self.active:
            return
        p, res = self.params, self._require(fed.resources)
        self.pm_net = pm = self._load_pm(fed, res).to(fed.params[0].device)
        if p.rh == "l2":
            l2_to_pm_grad(fed.params, list(pm.parameters()))  # checks the architectures now, not at round 0
        if p.rh == "crd" and self.crd is None:
            shape = fed.data.x.shape[1:]
            gen = torch.Generator().manual_seed(derive_seed(fed.cfg.seed, _TAG))
            dims = feature_dim(fed.net, shape), feature_dim(pm, shape)
            self.crd = CRD(*dims, num_data=len(res.rows), generator=gen, **p.crd).to(fed.params[0])
            self.head_opt = self._sgd(self.crd.parameters())

    def _load_pm(self, fed: FederationView, res: ServerResources) -> nn.Module:
        """``server.models.<pm>``, or else a PM of ``pm_model`` trained on the server rows (on rank 0, where the
        server step runs; the other ranks hold an untrained one of the same shape) and kept in ``cache``."""
        p = self.params
        if p.pm in res.models:
            return res.models[p.pm]
        assert p.pm_model is not None  # _require: server.models has no PM, so pm_model makes one
        x, y = fed.batch(res.rows)
        with torch.no_grad():
            classes = fed.net.eval()(x[:1]).shape[1]
        fed.net.train()
        if fed.rank != 0:
            return freeze(net_from_config(p.pm_model, x.shape[1:], classes))
        recipe = PretrainParams(**p.pretrain, key_prefix="algo.pm_pretrain.")
        seed = derive_seed(fed.cfg.seed, _TAG, 2)
        return pretrained_on(p.pm_model, x, y, recipe, seed, p.cache, classes, fingerprint=self.cache_fingerprint)

    def _sgd(self, params: Any) -> torch.optim.Optimizer:
        p = self.params
        return torch.optim.SGD(params, lr=p.head_lr, momentum=p.head_momentum, weight_decay=p.head_weight_decay)

    @override
    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        if not self.active:
            return
        grad = fed.on_server(lambda: [g.cpu() for g in self._seeded_gradient(fed, rnd.round)])
        agg = fed.aggregator
        if not isinstance(agg, WeightedMean):  # count_mean averages entry by entry: no one weight sum
            raise ConfigError(f"AugFL's PM term needs the round's weight sum: algo.aggregator={fed.cfg.aggregator}")
        scale = self.params.lam / agg.total_weight
        torch._foreach_add_(mean[: len(grad)], [g.to(m) for g, m in zip(grad, mean)], alpha=-scale)

    def _seeded_gradient(self, fed: FederationView, round_idx: int) -> list[Tensor]:
        """:meth:`gradient` with the global RNG (dropout) seeded by ``(seed, round)`` and restored afterwards, so the
        server step is the same on 1 or N processes."""
        devices = [fed.params[0].device] if fed.params[0].is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(derive_seed(fed.cfg.seed, round_idx, _TAG, 1))
            return self.gradient(fed, round_idx)

    def gradient(self, fed: FederationView, round_idx: int) -> list[Tensor]:
        """:math:`G^t` at :math:`\\theta^t` (``fed.global_params``), one tensor per parameter. Loads
        :math:`\\theta^t` into the net (the core overwrites the net after the server step)."""
        p, pm, res = self.params, self.pm_net, fed.resources
        assert pm is not None and res is not None  # on_attach loaded the PM from the resources it required
        if p.rh == "l2":
            return l2_to_pm_grad(fed.global_params, list(pm.parameters()))
        with torch.no_grad():
            torch._foreach_copy_(fed.params, fed.global_params)
        gen = torch.Generator().manual_seed(derive_seed(fed.cfg.seed, round_idx, _TAG))
        rows, n = res.rows, len(fed.params)
        heads = list(self.crd.parameters()) if self.crd is not None else []
        stepped = [*fed.params, *heads] if p.gradient == "code" else heads  # what the epoch's SGD moves
        opt = self._sgd(stepped) if p.gradient == "code" else self.head_opt
        total = [torch.zeros_like(q) for q in fed.params]
        fed.net.train()
        with torch.enable_grad():
            for pos in torch.randperm(len(rows), generator=gen).split(p.batch_size):
                if len(pos) < 2:  # BatchNorm cannot normalise one row in train mode
                    continue
                # the positions index CRD's memory banks, which are on the net's device
                loss = self._loss(fed, pm, rows[pos], pos.to(fed.params[0].device), gen)
                grads = torch.autograd.grad(loss, [*fed.params, *heads], allow_unused=True, materialize_grads=True)
                torch._foreach_add_(total, list(grads[:n]), alpha=len(pos) / len(rows))
                if opt is not None:
                    for q, g in zip([*fed.params, *heads], grads):
                        q.grad = g
                    opt.step()
        for q in [*fed.params, *heads]:
            q.grad = None
        return total

    def _loss(self, fed: FederationView, pm: nn.Module, rows: Tensor, pos: Tensor, gen: torch.Generator) -> Tensor:
        """:math:`R_h` of the net on the server ``rows`` (``gradient=code``: ``ce_weight`` CE + ``rh_weight``
        :math:`R_h`); ``pos``: the rows' positions in the server split (CRD's memory-bank rows)."""
        p = self.params
        x, y = fed.batch(rows)
        x_pm = x.to(next(pm.parameters()).dtype)
        if p.rh == "kd":
            logits = fed.net(x)
            with torch.no_grad():
                teacher = pm(x_pm).to(logits)
            rh = logit_kd(logits, teacher, p.kd_temperature)
        else:
            feats = penultimate(fed.net, x)
            with torch.no_grad():
                teacher = penultimate(pm, x_pm).to(feats)
            assert self.crd is not None  # made in on_attach for R_h = crd
            rh = self.crd(feats, teacher, pos, gen)
            logits = fed.net(x) if p.gradient == "code" else None
        if p.gradient == "paper":
            return rh
        return p.ce_weight * F.cross_entropy(logits, y) + p.rh_weight * rh

    @override
    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.crd is not None:
            assert self.head_opt is not None  # made with the CRD module
            out["crd"] = self.crd.state_dict()
            out["head_opt"] = self.head_opt.state_dict()
        return out

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """After ``on_attach``, which built the CRD heads (``rh=crd``): their trained state replaces the fresh one."""
        if self.crd is not None and "crd" in state_dict:
            assert self.head_opt is not None  # made with the CRD module
            self.crd.load_state_dict(state_dict["crd"])
            self.head_opt.load_state_dict(state_dict["head_opt"])
