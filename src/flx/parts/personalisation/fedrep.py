r"""FedRep: a shared representation, a personal head, trained one after the other.

Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for Personalized Federated Learning",
ICML 2021, arXiv:2102.07078, Algorithm 1: client :math:`i` first updates its head :math:`h_i` with the round's
representation :math:`\phi^t` fixed, then the representation with its new head fixed, and sends only the
representation:

.. math::
    h_i^{t,s} = h_i^{t,s-1} - \eta \nabla_h f_i(\phi^t, h_i^{t,s-1}), \quad s = 1..\tau_h; \qquad
    \phi_i^{t,s} = \phi_i^{t,s-1} - \eta \nabla_\phi f_i(\phi_i^{t,s-1}, h_i^{t,\tau_h}), \quad s = 1..\tau_\phi;

.. math::
    \phi^{t+1} = \frac{1}{|P_t|} \sum_{i \in P_t} \phi_i^{t,\tau_\phi}.

The round's ``K`` local steps (``algo.local_steps``, or ``algo.local_epochs`` passes) are split: the last
:math:`\tau_\phi` update the representation only (``algo.rep_steps``, or ``algo.rep_epochs`` passes with
``local_epochs``), the first :math:`\tau_h = K - \tau_\phi` the head only. The frozen group gets no gradient at a step
(:func:`~flx.parts.personalisation.local_layers.freeze`), so momentum and weight decay do not move it either. The
authors' code trains 10 local epochs, the last ``local_rep_ep = 1`` on the representation, the first 9 on the head
(``algo=fedrep``'s defaults: ``local_epochs: 10``, ``rep_epochs: 1``; any other budget keeps one pass for the
representation). The head (``algo.local``, default ``head``) stays on the client
(:class:`~flx.parts.personalisation.local_layers.LocalLayers`); the personalised model is :math:`(\phi^t, h_i)`.
Algorithm 1 averages uniformly; flx weighs by ``algo.weighting`` (``uniform`` in ``algo=fedrep``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from typing_extensions import override

from flx.errors import bad_value, check_fields, count
from flx.hooks import Build
from flx.parts.personalisation.local_layers import LocalLayers, freeze

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView


@dataclass(frozen=True)
class FedRepParams:
    """``rep_steps`` (:math:`\\tau_\\phi` with ``algo.local_steps``), ``rep_epochs`` (:math:`\\tau_\\phi` in passes
    with ``algo.local_epochs``)."""

    rep_steps: int | None = None
    rep_epochs: int | None = 1


class FedRep(LocalLayers):
    """FedRep: the first :math:`\\tau_h` local steps move the head (``local``) only, the others the body only."""

    # traits: LocalLayers' (data free: the phase switch reads the step index only, never the rows; under local DP-SGD
    # it drops noised gradients)

    def __init__(
        self, local: Sequence[str] = ("head",), rep_steps: int | None = None, rep_epochs: int | None = 1
    ) -> None:
        super().__init__(local)
        self.rep = p = FedRepParams(rep_steps, rep_epochs)
        check_fields(p, "algo.")
        self.body: tuple[int, ...] = ()  # positions in fed.params, set at attach
        self.head: tuple[int, ...] = ()

    @override
    def check(self, build: Build) -> None:
        super().check(build)
        epochs, p = build.cfg.local_epochs, self.rep
        if epochs:
            key, value, total = "algo.rep_epochs", p.rep_epochs, epochs
        else:
            key, value, total = "algo.rep_steps", p.rep_steps, build.cfg.local_steps
        if value is None:
            unit = "algo.local_epochs" if epochs else "algo.local_steps"
            raise bad_value(key, value, f"FedRep's representation updates, an integer in [1, {unit}] (now {total})")
        count(key, value, 1, max(total, 1))

    @override
    def on_attach(self, fed: FederationView) -> None:
        super().on_attach(fed)
        n = len(fed.params)
        self.head = tuple(k for k in self.local if k < n)
        self.body = tuple(k for k in range(n) if k not in self.head)

    def head_updates(self, fed: FederationView, client: ClientContext) -> int:
        """:math:`\\tau_h` of this client: its ``K`` steps less :math:`\\tau_\\phi`, ``rep_steps`` or ``rep_epochs``
        passes of ``ceil(n_i / B)`` steps."""
        if fed.cfg.local_epochs:
            rep = int(self.rep.rep_epochs or 0) * math.ceil(client.num_samples / fed.cfg.batch_size)
        else:
            rep = int(self.rep.rep_steps or 0)
        return max(client.num_steps - rep, 0)

    @override
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        freeze(fed, self.body if client.step < self.head_updates(fed, client) else self.head)
