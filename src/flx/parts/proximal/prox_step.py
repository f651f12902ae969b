r"""Proximal local steps (FedMiD) and federated dual averaging (FedDualAvg) for a nonsmooth regulariser ``h``.

H. Yuan, M. Zaheer, S. Reddi, "Federated Composite Optimization", ICML 2021, arXiv:2011.08474, with the Euclidean
mirror map, so every mirror step is a prox step of :mod:`flx.regularizers` (the paper's regulariser :math:`\psi` is
``h`` here, as in pFedFBE, whose paper runs both as baselines). Client :math:`i` takes :math:`K_i` steps of size
:math:`\eta`, weight :math:`p_i`; the server step size is :math:`\eta_s` and :math:`\bar K = \sum_i p_i K_i / \sum_i
p_i`.

**FedMiD** (:class:`ProxStep`): proximal SGD on the clients, the primal mean, a server prox step (``server_prox``)

.. math::
    w_{i,k+1} = \mathrm{prox}_{\eta h}\big(w_{i,k} - \eta \nabla f_i(w_{i,k}; \xi)\big), \qquad
    w^{t+1} = \mathrm{prox}_{\eta_s \eta \bar K h}\Big(w^t + \eta_s\,\big(\textstyle\sum_i p_i w_{i,K_i} / \sum_i p_i
    - w^t\big)\Big).

**FedDualAvg** (:class:`DualAveraging`): gradient steps on a dual :math:`z`, evaluated at its prox; the server averages
the duals

.. math::
    x_{i,k} = \mathrm{prox}_{\tilde\eta_{t,k} h}(z_{i,k}), \quad
    z_{i,k+1} = z_{i,k} - \eta \nabla f_i(x_{i,k}; \xi), \quad z_{i,0} = z^t, \quad
    \tilde\eta_{t,k} = \tilde\eta_t + \eta k,

    z^{t+1} = z^t + \eta_s\big(\textstyle\sum_i p_i z_{i,K_i} / \sum_i p_i - z^t\big), \quad
    \tilde\eta_{t+1} = \tilde\eta_t + \eta_s \eta \bar K, \quad w^{t+1} = \mathrm{prox}_{\tilde\eta_{t+1} h}(z^{t+1}),

from :math:`z^0 = w^0`, :math:`\tilde\eta_0 = 0`. The net holds the primal :math:`w^t` between rounds; the part keeps
:math:`z^t` and :math:`\tilde\eta_t` in its ``state_dict``, uploads the dual and lets the server optimizer step it, so
list it last among the parts with ``on_server_step`` or ``on_client_end``. How the dual travels through the hooks and
the choices the papers leave open (how :math:`\bar K` is weighted, momentum, other parts' gradients):
docs/pfedfbe.md#fedmid-and-feddualavg.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.errors import bad_value
from flx.hooks import FederatedCallback
from flx.regularizers import make_regularizer
from flx.traits import Channel, PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView, Round
    from flx.hooks import Build

# registered statistics: [sum_i p_i K_i, sum_i p_i] over the round's aggregated clients, for K-bar
_MID_STEPS, _DUAL_STEPS = "prox_step/steps", "dual_averaging/steps"
_DUAL = "dual_averaging/z"  # client.extras key of the client's dual z_i


def _register_steps(fed: FederationView, name: str) -> None:
    fed.register_stat(name, torch.zeros(2, dtype=fed.params[0].dtype))  # model dtype: no fp64 round buffer


def _add_steps(fed: FederationView, name: str, client: ClientContext) -> None:
    steps = fed.stat(name)
    steps[0] += client.weight * client.num_steps
    steps[1] += client.weight


def _mean_steps(fed: FederationView, name: str) -> float:
    """``K-bar``: the aggregation-weighted mean of the round's local step counts (summed over ranks)."""
    steps = fed.stat(name)
    return float(steps[0]) / float(steps[1])


@dataclass(frozen=True)
class ProxStepParams:
    """``server_prox``: apply ``prox_{eta_s eta K-bar h}`` after the server step (``algo.server_prox``)."""

    server_prox: bool = True


class ProxStep(FederatedCallback):
    """FedMiD: ``w <- prox_{eta h}(w)`` after every local step, and a server prox step after the server optimizer.

    Symbols: ``eta`` (``algo.lr``), ``eta_s`` (``algo.server.lr``), ``K_i`` (local steps), ``h`` (the regulariser).

    Args:
        regularizer: the ``algo.regularizer`` mapping (:func:`flx.regularizers.make_regularizer`); None: ``h = 0``.
        server_prox: see :class:`ProxStepParams`.
    """

    traits = PartTraits(
        uploads={_MID_STEPS: Channel("its local step count (K-bar)", "count")},
        steps="data_free",  # the prox operator reads the model only
    )

    def __init__(self, regularizer: Mapping[str, Any] | None = None, server_prox: bool = True) -> None:
        if not isinstance(server_prox, bool):
            raise bad_value("algo.server_prox", server_prox, "true or false")
        self.reg = make_regularizer(regularizer)
        self.params = ProxStepParams(server_prox)
        self._stepped = False  # whether this round had a server step (set in on_server_step, read in on_round_end)

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.reg.bind(fed.net)
        if self.params.server_prox:
            _register_steps(fed, _MID_STEPS)

    @override
    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        self._stepped = False

    @override
    def on_local_step_end(self, fed: FederationView, client: ClientContext) -> None:
        self.reg.prox_(fed.params, fed.cfg.lr)

    @override
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        if self.params.server_prox:
            _add_steps(fed, _MID_STEPS, client)

    @override
    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        self._stepped = True

    @override
    def on_round_end(self, fed: FederationView, rnd: Round) -> None:
        if self._stepped and self.params.server_prox:
            self.reg.prox_(fed.params, fed.cfg.server.lr * fed.cfg.lr * _mean_steps(fed, _MID_STEPS))
        self._stepped = False


class DualAveraging(FederatedCallback):
    """FedDualAvg: clients step a dual ``z`` at ``x = prox_{eta~ h}(z)``; the server averages and steps the duals.

    Symbols: ``z`` (dual), ``eta~`` (``elapsed``, the step size accumulated since the start), ``eta``, ``eta_s``,
    ``K_i``, ``h``. Server state: ``z`` (one tensor per trainable parameter) and ``elapsed``, both in ``state_dict``.

    Args:
        regularizer: the ``algo.regularizer`` mapping (:func:`flx.regularizers.make_regularizer`); None: ``h = 0``.
    """

    traits = PartTraits(
        uploads={_DUAL_STEPS: Channel("its local step count (K-bar)", "count")},  # z_i travels as its model
        steps="data_free",  # the dual steps on the gradient as the other hooks left it (private under local DP-SGD)
        aggregator=("mean", "FedDualAvg averages the clients' duals: use mean"),
    )

    def __init__(self, regularizer: Mapping[str, Any] | None = None) -> None:
        self.reg = make_regularizer(regularizer)
        self.z: list[Tensor] | None = None  # z^t, the server's dual
        self.elapsed = 0.0  # eta~_t
        self._stepped = False  # whether this round had a server step (set in on_server_step, read in on_round_end)

    @override
    def check(self, build: Build) -> None:
        cfg = build.cfg
        if cfg.momentum != 0:
            raise bad_value("algo.momentum", cfg.momentum, "FedDualAvg takes plain gradient steps on the dual: use 0")
        if cfg.weight_decay != 0:
            why = "FedDualAvg takes plain gradient steps on the dual: use 0 (an l2 term: regularizer elastic_net, mu2)"
            raise bad_value("algo.weight_decay", cfg.weight_decay, why)

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.reg.bind(fed.net)
        self.z = [p.detach().clone() for p in fed.params]  # z^0 = w^0; a resumed run's checkpoint replaces it
        _register_steps(fed, _DUAL_STEPS)

    @property
    def _z(self) -> list[Tensor]:
        """:math:`z^t`, which ``on_attach`` sets (or a checkpoint loads)."""
        if self.z is None:
            raise RuntimeError("DualAveraging: z^t is set in on_attach")
        return self.z

    @torch.no_grad()
    def _to_primal(self, fed: FederationView, z: list[Tensor], gamma: float) -> None:
        """The net's parameters <- ``prox_{gamma h}(z)``."""
        torch._foreach_copy_(fed.params, z)
        self.reg.prox_(fed.params, gamma)

    # ------------------------------------------------------------------ client
    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        z = [t.clone() for t in self._z]
        client.extras[_DUAL] = z
        self._to_primal(fed, z, self.elapsed)  # x_{i,0} = prox(z^t) = w^t (a projection at t = 0 for indicators)

    @override
    @torch.no_grad()
    def on_local_step_end(self, fed: FederationView, client: ClientContext) -> None:
        z, eta = client.extras[_DUAL], fed.cfg.lr
        for zi, p in zip(z, fed.params):
            if p.grad is not None:  # the gradient at x_{i,k}, as the parts' on_local_grad left it
                zi.add_(p.grad, alpha=-eta)
        k = client.step + 1
        if k < client.num_steps:  # after the last step only z is uploaded
            self._to_primal(fed, z, self.elapsed + eta * k)

    @override
    @torch.no_grad()
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        z = client.extras.pop(_DUAL)
        torch._foreach_copy_(fed.params, z)  # the upload is the dual z_{i,K_i}
        if all(bool(t.isfinite().all()) for t in z):  # a non-finite upload is dropped by the core: no K_i either
            _add_steps(fed, _DUAL_STEPS, client)

    # ------------------------------------------------------------------ server
    @override
    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        self._stepped = False

    @override
    @torch.no_grad()
    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        # mean[:n] is the dual mean z-bar; the server optimizer steps fed.global_params towards it, so it gets z^t
        torch._foreach_copy_(fed.global_params, self._z)
        self._stepped = True

    @override
    @torch.no_grad()
    def on_round_end(self, fed: FederationView, rnd: Round) -> None:
        if not self._stepped:  # no client aggregated: the net kept w^t, z and eta~ stay
            return
        self._stepped = False
        torch._foreach_copy_(self._z, [p.detach() for p in fed.params])  # z^{t+1}, from the server optimizer
        self.elapsed += fed.cfg.server.lr * fed.cfg.lr * _mean_steps(fed, _DUAL_STEPS)
        self._to_primal(fed, self._z, self.elapsed)

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"z": None if self.z is None else [t.clone() for t in self.z], "elapsed": self.elapsed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """After ``on_attach``: the checkpoint's ``z`` on the model's device and dtype (those of ``z^0``)."""
        self.z = [z.to(z0.device, z0.dtype) for z, z0 in zip(state_dict["z"], self._z)]
        self.elapsed = float(state_dict["elapsed"])
