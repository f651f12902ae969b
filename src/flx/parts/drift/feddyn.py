r"""FedDyn: a dynamic regulariser that aligns the clients' stationary points with the global objective's.

Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning Based on Dynamic Regularization", ICLR 2021,
arXiv:2111.04263, Algorithm 1. Client :math:`k` of the cohort :math:`P_t` minimises, from the server model
:math:`\theta^{t-1}`,

.. math::
    L_k(\theta) - \langle \nabla L_k(\theta_k^{t-1}), \theta \rangle + \frac{\alpha}{2} \lVert \theta - \theta^{t-1}
    \rVert^2

by the core's :math:`K` local SGD steps on the gradient :math:`\nabla L_k(\theta) - g_k + \alpha(\theta -
\theta^{t-1})`, where :math:`g_k` stands for :math:`\nabla L_k(\theta_k^{t-1})` and is updated by the first-order
condition of the local problem, :math:`g_k \leftarrow g_k - \alpha(\theta_k^t - \theta^{t-1})`. The server, with
:math:`m` the number of ALL clients (the paper's devices, not the cohort):

.. math::
    h^t = h^{t-1} - \frac{\alpha}{m} \sum_{k \in P_t} (\theta_k^t - \theta^{t-1}), \qquad
    \theta^t = \frac{1}{|P_t|} \sum_{k \in P_t} \theta_k^t - \frac{1}{\alpha} h^t,

so that :math:`h^t = \frac1m \sum_{k=1}^m g_k` at every round (:math:`g_k` and :math:`h` start at 0). flx weighs
both by the core's :math:`p_k` (``algo.weighting``). The mean is the core's weighted mean :math:`\bar\theta`, and

.. math::
    h^t = h^{t-1} - \alpha \frac{W_t}{\sum_{j=1}^m p_j} (\bar\theta - \theta^{t-1}),
    \qquad W_t = \sum_{k \in P_t} p_k \text{ (the aggregated clients)},

which keeps :math:`h = \sum_j \frac{p_j}{\sum p} g_j`: ``uniform`` is the paper's formula exactly, ``num_samples``
makes the fixed point the minimiser of the sample-weighted objective that flx's FedAvg mean targets. The correction
edits the mean in ``on_server_step``, before the server optimizer (whose ``sgd``, ``lr=1`` default copies it; another
``algo.server.lr`` is our extension: :math:`\theta^t = \theta^{t-1} + \eta_g(\bar\theta - h^t/\alpha -
\theta^{t-1})`). Each client counts once per round (the default samplers draw without replacement).

:math:`\alpha = 0` is defined as no term and no correction (neither :math:`g_k` nor :math:`h` is kept): FedAvg bit
for bit. (The paper needs :math:`\alpha > 0`; :math:`h^t/\alpha` does not vanish as :math:`\alpha \to 0`.)

Symbols: ``alpha`` (:math:`\alpha`), ``g_k`` (the client's gradient state), ``h`` (the server state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.aggregation import flat_views, numel
from flx.errors import bad_value, check_fields
from flx.hooks import FederatedCallback
from flx.local_sgd import grads_of
from flx.parts.drift.scaffold import flat, total_weight
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView, Round
    from flx.vectorized import Cohort

_G = "feddyn/g"  # client.state: g_k, flat
_K = "feddyn"  # client.extras: (g_k, views of g_k shaped like fed.params)


@dataclass(frozen=True)
class FedDynParams:
    """``alpha``: the weight of the dynamic regulariser, :math:`\\alpha \\ge 0` (0: FedAvg)."""

    alpha: float = 0.01


class FedDyn(FederatedCallback):
    """FedDyn's local gradient term, the clients' gradient states in the state store and the server state ``h``."""

    traits = PartTraits(
        uploads={},  # the clients send their model; g_k stays on the client
        steps="data_free",  # the term reads the models and g_k, itself a function of past local and global models
        vectorizable=True,  # the term is elementwise: added to the stacked gradients (on_cohort_grad)
        aggregator=("mean", "FedDyn corrects the weighted mean of the client models: use mean"),
    )

    def __init__(self, alpha: float = 0.01) -> None:
        self.params = p = FedDynParams(alpha=alpha)
        check_fields(p, "algo.")
        if not p.alpha >= 0:
            raise bad_value("algo.alpha", p.alpha, "FedDyn's alpha, >= 0 (0: FedAvg)")
        self.alpha = float(p.alpha)
        self.h: list[Tensor] = []  # the server state, shaped like fed.params (made in on_attach)
        self.total = 1.0  # sum_j p_j over all training clients (the paper's m for uniform weights)

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.h = [torch.zeros_like(p) for p in fed.global_params]
        self.total = total_weight(fed)

    # ------------------------------------------------------------------ client
    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        if self.alpha == 0.0:
            return
        like = fed.params[0]
        g = client.state.get(_G)
        g = torch.zeros(numel(fed.params), dtype=like.dtype, device=like.device) if g is None else g.to(like.dtype)
        client.extras[_K] = (g, flat_views(g, fed.params))

    @override
    @torch.no_grad()
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        if self.alpha == 0.0:
            return
        grads = grads_of(fed.params)  # grad L_k(theta) - g_k + alpha (theta - theta^{t-1})
        torch._foreach_add_(grads, torch._foreach_sub(fed.params, fed.global_params), alpha=self.alpha)
        torch._foreach_sub_(grads, client.extras[_K][1])

    @override
    @torch.no_grad()
    def on_cohort_grad(self, fed: FederationView, cohort: Cohort) -> None:
        if self.alpha == 0.0:
            return
        grads = cohort.grads or []  # (m, *p.shape) each
        for g, w, w_t in zip(grads, cohort.params, fed.global_params):
            g.add_(w - w_t, alpha=self.alpha)  # w^t broadcast over the clients
        for i, client in enumerate(cohort.clients):
            torch._foreach_sub_([g[i] for g in grads], client.extras[_K][1])

    @override
    @torch.no_grad()
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        if self.alpha == 0.0:
            return
        g, _ = client.extras.pop(_K)
        client.state[_G] = g - self.alpha * (flat(fed.params) - flat(fed.global_params))

    # ------------------------------------------------------------------ server
    @override
    @torch.no_grad()
    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        if self.alpha == 0.0:
            return
        out = set(fed.faults.dropped) | set(fed.faults.skipped)
        aggregated = sum(rnd.weights[c] * rnd.draws[c] for c in rnd.cohort if c not in out)  # W_t
        n = len(self.h)
        delta = torch._foreach_sub([m.to(h.dtype) for m, h in zip(mean[:n], self.h)], fed.global_params)
        torch._foreach_add_(self.h, delta, alpha=-self.alpha * aggregated / self.total)
        for m, h in zip(mean[:n], self.h):
            m.sub_(h / self.alpha)  # theta^t = mean - h^t / alpha, then the server optimizer

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"h": [h.clone() for h in self.h]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.h = [t.to(h.device, h.dtype).clone() for t, h in zip(state_dict["h"], self.h)]
