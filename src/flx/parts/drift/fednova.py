"""FedNova: normalised averaging of heterogeneous local work.

Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020 (arXiv:2007.07481), Section 4, the normalised update with the default
``tau_eff = sum_i p_i ||a_i||_1``. Client ``i``'s local solver moves it by ``x^t - x_i = eta G_i a_i`` (``G_i``: its
``tau_i`` stochastic gradients, ``a_i``: how the solver weighs them); FedNova averages the normalised updates

.. math::
    d_i = \\frac{x^t - x_i^{t,\\tau_i}}{\\lVert a_i \\rVert_1},\\qquad
    x^{t+1} = x^t - \\tau_{\\text{eff}} \\sum_i p_i d_i,\\qquad \\tau_{\\text{eff}} = \\sum_i p_i \\lVert a_i \\rVert_1.

``||a_i||_1`` for the local solvers of the paper (Section 4 / Appendix), with ``rho`` local momentum and ``mu`` a
proximal weight (FedProx's; ``algo.weight_decay`` acts as one, its constant part folded into the gradients):
plain SGD ``tau_i``; momentum ``a_{i,k} = (1 - rho^{tau_i - k}) / (1 - rho)``, ``||a_i||_1 = (tau_i - rho (1 -
rho^{tau_i}) / (1 - rho)) / (1 - rho)``; proximal ``a_{i,k} = (1 - eta mu)^{tau_i - 1 - k}``, ``||a_i||_1 = (1 -
(1 - eta mu)^{tau_i}) / (eta mu)``; both at once (no closed form in the paper): the same recursion, run on a
constant unit gradient (:func:`a_norm`).

Each client sends ``x^t - (tau_eff / ||a_i||_1)(x^t - x_i)``, which the core's weighted mean turns into FedNova's
update (``p_i``: the round's weights ``rnd.weights`` times the draws); ``tau_eff`` is computed from the cohort in
``on_round_start`` (``tau_i = fed.client_steps(i)`` is known before any client trains; a part that sets steps,
``rnd.set_steps``, is listed before this one), as ``a_min + sum_i p_i (||a_i||_1 -
a_min)``, so that equal work gives a factor of exactly 1 and the upload untouched: FedAvg bit for bit.
The paper's random local epochs (``algo.random_work``) are their own part,
:class:`flx.parts.systems.random_work.RandomWork`, which must be listed before this one (:meth:`FedNova.check`).

Departures: ``p_i`` and ``tau_eff`` are the planned cohort's (clients without rows left out); a client dropped for a
non-finite update is still in them. The local step size is ``algo.lr`` (a part that schedules it changes ``a_i``
unseen); ``mu`` must be the proximal part's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from flx.errors import ConfigError, bad_value, check_fields
from flx.hooks import Build, FederatedCallback
from flx.parts.systems.random_work import RandomWork
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView, Round


@dataclass(frozen=True)
class FedNovaParams:
    """``mu``: the proximal weight of a FedProx term the clients run (``algo.mu``, >= 0)."""

    mu: float = 0.0


def a_norm(tau: int, eta: float, rho: float = 0.0, mu: float = 0.0) -> float:
    """``||a_i||_1`` of ``tau`` local SGD steps with step size ``eta``, momentum ``rho`` (``torch.optim.SGD``'s) and a
    proximal weight ``mu``: ``(x^t - x^{t,tau}) / eta`` when every step's gradient is 1. The paper's closed forms
    where it gives one (exact for plain SGD: ``tau``); else the recursion ``b_{k+1} = rho b_k + 1 - mu u_k``,
    ``u_{k+1} = u_k + eta b_{k+1}`` (``u = x^t - x``), ``||a_i||_1 = u_tau / eta``."""
    if rho == 0.0 and mu == 0.0:
        return float(tau)
    if mu == 0.0:
        return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)
    if rho == 0.0:
        return (1.0 - (1.0 - eta * mu) ** tau) / (eta * mu)
    u = b = 0.0
    for _ in range(tau):
        b = rho * b + 1.0 - mu * u
        u += eta * b
    return u / eta


class FedNova(FederatedCallback):
    """Scales each client's update by ``tau_eff / ||a_i||_1``. Symbols: ``tau_i`` (local steps), ``a_i``, ``p_i``,
    ``tau_eff``, ``eta`` (``algo.lr``), ``rho`` (``algo.momentum``), ``mu``."""

    traits = PartTraits(
        uploads={},  # the upload is the (rescaled) model
        steps="data_free",  # no step hook; the end of a client reads the models only
        vectorizable=True,  # on_client_end runs per client on the stacked path too, the client's model in the net
    )

    def __init__(self, mu: float = 0.0) -> None:
        check_fields(FedNovaParams(mu=mu), "algo.")
        if not mu >= 0:
            raise bad_value("algo.mu", mu, "must be >= 0")
        self.params = FedNovaParams(mu=float(mu))
        self.factors: dict[int, float] = {}  # this round's tau_eff / ||a_i||_1, by client (on_round_start's)

    @override
    def check(self, build: Build) -> None:
        """A :class:`RandomWork` listed after this part would change the steps after ``tau_eff`` is computed."""
        after = build.parts[build.parts.index(self) + 1 :] if self in build.parts else ()
        if any(isinstance(part, RandomWork) for part in after):
            raise ConfigError("algo.parts: list the RandomWork part (random local work) before FedNova's")

    @override
    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        self.factors = self.normalisers(fed, rnd)  # after the set_steps of the parts listed before this one

    def normalisers(self, fed: FederationView, rnd: Round) -> dict[int, float]:
        """``tau_eff / ||a_i||_1`` for every cohort client with rows, with ``p_i`` = ``rnd.weights[i] *
        rnd.draws[i]``."""
        cfg, mu = fed.cfg, self.params.mu + fed.cfg.weight_decay
        norms = {c: a_norm(fed.client_steps(c), cfg.lr, cfg.momentum, mu) for c in rnd.cohort if fed.num_samples(c)}
        if not norms:
            return {}
        p = {c: rnd.weights[c] * rnd.draws[c] for c in norms}
        low = min(norms.values())
        tau_eff = low + sum(p[c] * (a - low) for c, a in norms.items()) / sum(p.values())
        return {c: tau_eff / a for c, a in norms.items()}

    @override
    @torch.no_grad()
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        factor = self.factors.get(client.cid, 1.0)
        if factor == 1.0:  # equal work: FedAvg's upload, untouched
            return
        torch._foreach_sub_(fed.params, fed.global_params)  # x_i - x^t
        torch._foreach_mul_(fed.params, factor)
        torch._foreach_add_(fed.params, fed.global_params)  # x^t - (tau_eff / ||a_i||_1) (x^t - x_i)
