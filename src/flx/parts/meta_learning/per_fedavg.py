r"""Per-FedAvg: federated MAML, the baseline of AugFL's Table II.

A. Fallah, A. Mokhtari, A. Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic
Meta-Learning Approach", NeurIPS 2020, Algorithm 1 (one of AugFL's baselines, its Section VI-A). Each of
the :math:`K` local steps (``algo.local_steps``) of client :math:`i` is one MAML step with step :math:`\beta`
(``algo.lr``) and inner step :math:`\alpha`:

.. math::
    \tilde w = w - \alpha \nabla f_i(w; \mathcal D), \qquad
    w \leftarrow w - \beta \big(I - \alpha \nabla^2 f_i(w; \mathcal D'')\big) \nabla f_i(\tilde w; \mathcal D'),

and the server averages (``algo.aggregator=mean``). ``hessian``: ``none`` is Per-FedAvg (FO), ``fd`` Per-FedAvg (HF)
(the paper's finite difference, radius ``delta``, the AugFL paper's Eq. 10 being the same estimator), ``exact`` the
double-backward product. On few-shot clients (``partition=few_shot``) :math:`\mathcal D = \mathcal D''` is the support
set and :math:`\mathcal D'` the query set, full batch, as AugFL's clients use them (the paper draws three independent
minibatches; with 10-40 rows a client, full batches are the natural reading). Evaluation: one step of :math:`\alpha`
on the support set (:class:`~flx.parts.meta_learning.adapt.Adapt`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.autodiff import HVP_MODES
from flx.errors import bad_value, check_fields
from flx.hooks import FederatedCallback
from flx.parts.meta_learning.meta_update import maml_gradient
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView
    from flx.hooks import Build


@dataclass(frozen=True)
class PerFedAvgParams:
    """``alpha`` (:math:`\\alpha`), the Hessian mode, the finite-difference radius ``delta``."""

    alpha: float = 0.03
    hessian: str = "none"
    delta: float = 1e-3


class PerFedAvg(FederatedCallback):
    """Per-FedAvg's local update (``local_update``): ``K`` MAML steps of size ``algo.lr`` on support / query."""

    traits = PartTraits(uploads={})  # its model after the MAML steps: the model update

    def __init__(self, **params: Any) -> None:
        self.params = p = PerFedAvgParams(**params)
        check_fields(p, "algo.")
        if not p.alpha >= 0:
            raise bad_value("algo.alpha", p.alpha, "the inner step alpha, >= 0")
        if p.hessian not in HVP_MODES:
            raise bad_value("algo.hessian", p.hessian, f"allowed: {', '.join(HVP_MODES)} (none: FO, fd: HF)")
        if not p.delta > 0:
            raise bad_value("algo.delta", p.delta, "> 0")

    @override
    def check(self, build: Build) -> None:
        _require_support(build.clients.client_support)

    @override
    def local_update(self, fed: FederationView, client: ClientContext) -> Tensor:
        p, beta = self.params, fed.cfg.lr
        support, query = fed.data.support_rows(client.cid), fed.data.query_rows(client.cid)
        total = torch.zeros((), dtype=torch.float64, device=fed.params[0].device)
        for _ in range(client.num_steps):
            w = [q.detach() for q in fed.params]
            loss, g_hat = maml_gradient(fed, w, support, query, p.alpha, p.hessian, p.delta)
            with torch.no_grad():
                torch._foreach_add_(fed.params, g_hat, alpha=-beta)
            total += loss.double()
        return total / max(client.num_steps, 1)


def _require_support(support: Any) -> None:
    if support is None:
        why = "Per-FedAvg needs support and query sets: partition=few_shot"
        raise bad_value("partition", "(no support sets)", why)
