r"""AugFL's client step: a linearised, closed-form inexact-ADMM update of a MAML meta-model.

S. Yue, Z. Qin, Y. Deng, J. Ren, Y. Zhang, J. Zhang, "AugFL: Augmenting Federated Learning with Pretrained Models"
(journal extension of MobiHoc 2021), Algorithm 1 step 3.1, Eqs. 7, 10-12. Client :math:`i` at round :math:`t`, from
the global meta-model :math:`\theta^t`, on its support set :math:`S` and query set :math:`Q` (``partition=few_shot``:
``fed.data.support_rows`` / ``fed.data.query_rows``), full batch:

.. math::
    \phi_i = \theta^t - \alpha \nabla L_i(\theta^t; S), \qquad r_i = \nabla L_i(\phi_i; Q), \qquad
    g_i = \frac{\nabla L_i(\theta^t + \delta_t r_i; S) - \nabla L_i(\theta^t - \delta_t r_i; S)}{2 \delta_t}

    \hat g_i = r_i - \alpha g_i, \qquad
    \theta_i = \theta^t - \frac{y_i + w_i \hat g_i}{\rho}, \qquad y_i \leftarrow y_i + \rho (\theta_i - \theta^t)
    \; (= -w_i \hat g_i)

with :math:`\delta_t = 1 / (10 t + 100)` (``delta_scale`` = 10, ``delta_offset`` = 100) and :math:`w_i = D_i /
\sum_j D_j` over the training clients (``client_weight=samples``, the authors' code; ``uniform``: :math:`1/N`). The
client uploads :math:`u_i = y_i + \rho \theta_i` with weight :math:`\rho` and ``algo.aggregator=admm_sum`` forms
:math:`\sum_i u_i / \sum_i \rho` (Eq. 13 without the regulariser;
:class:`~flx.parts.meta_learning.pm_regularizer.PMRegularizer` subtracts :math:`\lambda G^t / \sum_i \rho`). The dual
:math:`y_i` (zeros at first, Alg. 1 step 1) and the client's round counter live in ``client.state`` (the CPU / disk
store, checkpointed), never on the accelerator.

Choices the paper leaves open (options, documented in ``docs/augfl.md``):

- ``hessian``: ``fd`` (Eq. 10, the paper), ``exact`` (double backward, a check) or ``none`` (first order).
- ``delta_index``: :math:`t` counts the client's own rounds from 1 (``client``, the authors' code) or the global
  round from 1 (``round``).
- BatchNorm: only parameters go through the ADMM update (the authors' code); ``bn_refresh`` (default on) runs one
  train-mode forward pass over the client's rows at :math:`\theta^t`, so the running statistics the evaluation uses are
  the clients' mean (the authors' code evaluates with batch statistics instead); buffers are averaged with weight
  :math:`\rho`.
- Partial participation (the paper has none): the sums run over the round's cohort, so the server step is
  :math:`1 / (m \rho)`; absent clients keep their dual.

Symbols: ``alpha`` (:math:`\alpha`), ``rho`` (:math:`\rho`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.autodiff import HVP_MODES, sq_norm
from flx.errors import bad_value, check_fields
from flx.hooks import FederatedCallback
from flx.parts.personalisation.personal_model import from_state, keep
from flx.traits import Channel, PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView
    from flx.hooks import Build

_Y, _T = "augfl/y/", "augfl/t"  # client.state: the dual (one tensor per fed.params entry), the client's rounds
DELTA_INDEX = ("client", "round")
CLIENT_WEIGHTS = ("samples", "uniform")


def maml_gradient(
    fed: FederationView, theta: list[Tensor], support: Tensor, query: Tensor, alpha: float, hessian: str, delta: float
) -> tuple[Tensor, list[Tensor]]:
    """The one-step MAML gradient :math:`(I - \\alpha \\nabla^2 L(\\theta; S)) \\nabla L(\\phi; Q)` with
    :math:`\\phi = \\theta - \\alpha \\nabla L(\\theta; S)`, the Hessian-vector product by ``hessian`` (``fd``:
    Eq. 10's central difference at radius ``delta`` along the un-normalised :math:`r`), and :math:`L(\\phi; Q)`."""
    phi = torch._foreach_add(theta, fed.grad_at(theta, support), alpha=-alpha)
    loss, r = fed.value_and_grad_at(phi, query)
    norm = torch.sqrt(sq_norm(r))  # stays on the device: no host sync per step
    g = fed.hvp(r, support, mode=hessian, params=theta, eps=torch.where(norm > 0, delta * norm, delta))  # r = 0: g = 0
    return loss, list(torch._foreach_add(r, g, alpha=-alpha))


@dataclass(frozen=True)
class MetaUpdateParams:
    """``alpha`` (:math:`\\alpha`), ``rho`` (:math:`\\rho`), the Hessian mode, the :math:`\\delta_t` schedule, the
    client weights :math:`w_i`, the BatchNorm refresh."""

    alpha: float = 0.03
    rho: float = 0.7
    hessian: str = "fd"
    delta_scale: float = 10.0
    delta_offset: float = 100.0
    delta_index: str = "client"
    client_weight: str = "samples"
    bn_refresh: bool = True


class MetaUpdate(FederatedCallback):
    """AugFL's closed-form client step (``local_update``) and its upload ``u_i = y_i + rho theta_i`` (weight rho)."""

    traits = PartTraits(
        uploads={"meta_update/u": Channel("its ADMM dual and query-set gradients (AugFL's meta-update)")},
        aggregator=("admm_sum", "AugFL's server step (Eq. 13) needs admm_sum"),
    )

    def __init__(self, **params: Any) -> None:
        self.params = p = MetaUpdateParams(**params)
        check_fields(p, "algo.")
        if not p.alpha >= 0:
            raise bad_value("algo.alpha", p.alpha, "the adaptation step alpha, >= 0")
        if not p.rho > 0:
            raise bad_value("algo.rho", p.rho, "the ADMM penalty rho, > 0")
        if p.hessian not in HVP_MODES:
            raise bad_value("algo.hessian", p.hessian, f"allowed: {', '.join(HVP_MODES)}")
        if not p.delta_scale >= 0:
            raise bad_value("algo.delta_scale", p.delta_scale, "delta_t = 1/(scale t + offset) needs scale >= 0")
        if not p.delta_offset > 0:
            raise bad_value("algo.delta_offset", p.delta_offset, "delta_t = 1/(scale t + offset) needs offset > 0")
        if p.delta_index not in DELTA_INDEX:
            raise bad_value("algo.delta_index", p.delta_index, f"allowed: {', '.join(DELTA_INDEX)}")
        if p.client_weight not in CLIENT_WEIGHTS:
            raise bad_value("algo.client_weight", p.client_weight, f"allowed: {', '.join(CLIENT_WEIGHTS)}")
        self._total = 0

    @override
    def check(self, build: Build) -> None:
        cfg = build.cfg
        if cfg.server.lr != 1 or cfg.server.momentum != 0:
            raise bad_value("algo.server.lr", cfg.server.lr, "Eq. 13 is the server step itself: sgd, lr 1, momentum 0")
        _require_support(build.clients.client_support)

    @override
    def on_attach(self, fed: FederationView) -> None:
        self._total = sum(fed.num_samples(c) for c in range(fed.num_clients))

    def delta(self, client: ClientContext, t_client: int) -> float:
        """:math:`\\delta_t = 1 / (\\text{scale}\\, t + \\text{offset})`, ``t`` from 1."""
        p = self.params
        t = t_client if p.delta_index == "client" else client.round.round + 1
        return 1.0 / (p.delta_scale * t + p.delta_offset)

    def weight(self, fed: FederationView, cid: int) -> float:
        """:math:`w_i`: ``D_i / sum_j D_j`` over the training clients, or ``1 / N``."""
        if self.params.client_weight == "uniform":
            return 1.0 / fed.num_clients
        return fed.num_samples(cid) / self._total

    def meta_gradient(self, fed: FederationView, client: ClientContext, t_client: int) -> tuple[Tensor, list[Tensor]]:
        """:math:`L_i(\\phi_i; Q)` and :math:`\\hat g_i` at the net's :math:`\\theta^t` (Alg. 1 steps 3.1.1-3.1.4)."""
        support, query = fed.data.support_rows(client.cid), fed.data.query_rows(client.cid)
        delta = self.delta(client, t_client)
        return maml_gradient(
            fed, [q.detach() for q in fed.params], support, query, self.params.alpha, self.params.hessian, delta
        )

    @override
    def local_update(self, fed: FederationView, client: ClientContext) -> Tensor:
        p = self.params
        t_client = int(client.state.get(_T, torch.zeros(())).item()) + 1
        if p.bn_refresh and any(True for _ in fed.net.buffers()):
            with torch.no_grad():  # BatchNorm running statistics of this client's rows at theta^t
                fed.net.train()
                fed.net(fed.batch(fed.data.client_indices[client.cid])[0])
        loss, g_hat = self.meta_gradient(fed, client, t_client)
        theta = [q.detach() for q in fed.params]
        y = from_state(client.state, _Y, len(theta)) or [torch.zeros_like(q) for q in theta]
        w_i = self.weight(fed, client.cid)
        theta_i = torch._foreach_sub(theta, torch._foreach_div(torch._foreach_add(y, g_hat, alpha=w_i), p.rho))
        y = list(torch._foreach_add(y, torch._foreach_sub(theta_i, theta), alpha=p.rho))  # Eq. 12
        keep(client, _Y, y)
        client.state[_T] = torch.tensor(t_client)
        with torch.no_grad():  # the upload u_i = y_i + rho theta_i (params), rho b_i (float buffers), weight rho
            torch._foreach_copy_(fed.params, torch._foreach_add(y, theta_i, alpha=p.rho))
            floats = fed.local_state[len(fed.params) :]
            if floats:
                torch._foreach_mul_(floats, p.rho)
        client.weight = p.rho
        return loss


def _require_support(support: Any) -> None:
    if support is None:
        raise bad_value("partition", "(no support sets)", "AugFL needs support and query sets: partition=few_shot")
