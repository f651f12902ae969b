r"""Ditto: a personal model per client, trained next to the global FedAvg model.

Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021, Algorithm 1
(the "pFedditto" baseline of the pFedFBE paper). The global model is FedAvg's (the
core's local SGD steps and mean, untouched: Ditto's global model is FedAvg's bit for bit); client :math:`i` also
keeps a personal model :math:`v_i` that minimises :math:`f_i(v) + \frac{\lambda}{2} \lVert v - w^t \rVert^2`, one
step per local step on the same minibatch :math:`D` (as the authors' code does):

.. math::
    v_i \leftarrow \mathrm{prox}_{\eta_v h}\big(v_i - \eta_v (\nabla f_i(v_i; D) + \lambda (v_i - w^t))\big).

:math:`w^t` is the round's global model (fixed during the round). With a regulariser :math:`h` (pFedFBE's composite
setting) the step is a proximal-gradient step: our extension, the identity for :math:`h = 0`. :math:`v_i` lives in
``client.state`` (the CPU store, not on the accelerator); at a client's first round it starts from :math:`w^t` (the
authors' code starts every :math:`v_i` from :math:`w^0`, which for a client first sampled late is an untrained
model). ``personalize`` installs :math:`v_i` (a client never sampled: the global model).

Symbols: ``lam`` (:math:`\lambda`), ``personal_lr`` (:math:`\eta_v`, default ``algo.lr`` as in the paper).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.errors import bad_value, check_fields
from flx.hooks import PERSONAL_HEADLINE, FederatedCallback
from flx.parts.personalisation.fbe import as_regularizer
from flx.parts.personalisation.personal_model import from_state, install, keep, stored
from flx.regularizers import Regularizer
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView

_V = "ditto/v/"  # client.state keys: _V + index into fed.params
_VK = "ditto/v"


@dataclass(frozen=True)
class DittoParams:
    """``lam`` (:math:`\\lambda`), ``personal_lr`` (:math:`\\eta_v`; None: ``algo.lr``)."""

    lam: float = 0.1
    personal_lr: float | None = None


class Ditto(FederatedCallback):
    """Ditto's personal models: one proximal step on :math:`v_i` per local step (``on_local_step_end``), kept in the
    state store and installed by ``personalize``; ``regularizer`` as in :class:`~flx.parts.personalisation.fbe.FBE`."""

    traits = PartTraits(uploads={}, headline=PERSONAL_HEADLINE)  # v_i stays on the client

    def __init__(self, regularizer: Regularizer | Any = None, **params: Any) -> None:
        self.params = p = DittoParams(**params)
        check_fields(p, "algo.")
        if not p.lam >= 0:
            raise bad_value("algo.lam", p.lam, "Ditto's lambda, >= 0")
        if p.personal_lr is not None and not p.personal_lr > 0:
            raise bad_value("algo.personal_lr", p.personal_lr, "> 0, or null for algo.lr")
        self.reg = as_regularizer(regularizer)

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.reg.bind(fed.net)

    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        v = from_state(client.state, _V, len(fed.params))
        client.extras[_VK] = v if v is not None else [t.clone() for t in fed.global_params]

    @override
    def on_local_step_end(self, fed: FederationView, client: ClientContext) -> None:
        lr = self.params.personal_lr or fed.cfg.lr
        v: list[Tensor] = client.extras[_VK]
        assert client.rows is not None, "on_local_step_end runs inside a local step"
        step = fed.grad_at(v, client.rows)  # v_i steps on the rows w_i just stepped on, whichever part chose them
        torch._foreach_add_(step, torch._foreach_sub(v, fed.global_params), alpha=self.params.lam)
        client.extras[_VK] = self.reg.prox(torch._foreach_add(v, step, alpha=-lr), lr)

    @override
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        keep(client, _V, client.extras.pop(_VK))

    @override
    def personalize(self, fed: FederationView, cid: int) -> Any:
        v = stored(fed, cid, _V)
        return install(fed, v) if v is not None else None
