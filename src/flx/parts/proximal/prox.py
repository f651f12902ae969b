"""Proximal local term (FedProx).

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous Networks",
MLSys 2020, Algorithm 2 / Eq. (2): client ``i`` approximately minimises

.. math::
    h_i(w; w^t) = F_i(w) + \\frac{\\mu}{2}\\,\\lVert w - w^t \\rVert^2,

so each local SGD step is

.. math::
    w \\leftarrow w - \\eta\\,\\big(\\nabla F_i(w; \\xi) + \\mu\\,(w - w^t)\\big).

The term's gradient ``mu * (w - w^t)`` is added to the parameter gradients after backward (the same
update as differentiating the term, without building it into the graph). ``mu = 0`` is FedAvg exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from typing_extensions import override

from flx.errors import bad_value, check_fields
from flx.hooks import FederatedCallback
from flx.local_sgd import grads_of
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView
    from flx.vectorized import Cohort


@dataclass(frozen=True)
class ProxParams:
    """``mu``: weight of the proximal term (``algo.mu``), ``mu >= 0``."""

    mu: float = 0.01


class Prox(FederatedCallback):
    """Adds ``mu * (w - w_global)`` to every local gradient. Symbols: ``mu``, ``w^t`` (round's global model)."""

    traits = PartTraits(
        uploads={},
        steps="data_free",  # the term reads the models only: local DP-SGD's clipped gradient stays private
        vectorizable=True,  # algo.vectorize: the same term on the stacked gradients (on_cohort_grad)
    )

    def __init__(self, mu: float = 0.01) -> None:
        check_fields(ProxParams(mu=mu), "algo.")
        if not mu >= 0:
            raise bad_value("algo.mu", mu, "must be >= 0")
        self.params = ProxParams(mu=float(mu))

    @override
    @torch.no_grad()
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        if self.params.mu == 0.0:
            return
        grads = grads_of(fed.params)
        torch._foreach_add_(grads, torch._foreach_sub(fed.params, fed.global_params), alpha=self.params.mu)

    @override
    @torch.no_grad()
    def on_cohort_grad(self, fed: FederationView, cohort: Cohort) -> None:
        if self.params.mu == 0.0:
            return
        for g, w, w_t in zip(cohort.grads or (), cohort.params, fed.global_params):  # grads: set at on_cohort_grad
            g.add_(w - w_t, alpha=self.params.mu)  # w: (m, ...), w^t broadcast over the clients
