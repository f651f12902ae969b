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

The round's ``K`` local steps (``algo.local_steps``, or ``algo.local_epochs`` passes) are split: the first
:math:`\tau_h` update the head only (``algo.head_steps``, or ``algo.head_epochs`` passes with ``local_epochs``), the
other :math:`\tau_\phi = K - \tau_h` the representation only. The frozen group gets no gradient at a step
(:func:`~flx.parts.personalisation.local_layers.freeze`), so momentum and weight decay do not move it either. The
authors' code trains 10 local epochs, the last ``local_rep_ep = 1`` on the representation, the first 9 on the head
(``algo=fedrep``'s defaults). The head (``algo.local``, default ``head``) stays on the client
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
    """``head_steps`` (:math:`\\tau_h` with ``algo.local_steps``), ``head_epochs`` (:math:`\\tau_h` in passes with
    ``algo.local_epochs``)."""

    head_steps: int | None = None
    head_epochs: int | None = None


class FedRep(LocalLayers):
    """FedRep: the first :math:`\\tau_h` local steps move the head (``local``) only, the others the body only."""

    # traits: LocalLayers' (data free: the phase switch reads the step index only, never the rows; under local DP-SGD
    # it drops noised gradients)

    def __init__(
        self, local: Sequence[str] = ("head",), head_steps: int | None = None, head_epochs: int | None = None
    ) -> None:
        super().__init__(local)
        self.rep = p = FedRepParams(head_steps, head_epochs)
        check_fields(p, "algo.")
        self.body: tuple[int, ...] = ()  # positions in fed.params, set at attach
        self.head: tuple[int, ...] = ()

    @override
    def check(self, build: Build) -> None:
        super().check(build)
        epochs, p = build.cfg.local_epochs, self.rep
        if epochs:
            key, value, total = "algo.head_epochs", p.head_epochs, epochs
        else:
            key, value, total = "algo.head_steps", p.head_steps, build.cfg.local_steps
        if value is None:
            unit = "algo.local_epochs" if epochs else "algo.local_steps"
            raise bad_value(key, value, f"FedRep's head updates, an integer in [0, {unit}) (now {total})")
        count(key, value, 0, max(total - 1, 0))

    @override
    def on_attach(self, fed: FederationView) -> None:
        super().on_attach(fed)
        n = len(fed.params)
        self.head = tuple(k for k in self.local if k < n)
        self.body = tuple(k for k in range(n) if k not in self.head)

    def head_updates(self, fed: FederationView, client: ClientContext) -> int:
        """:math:`\\tau_h` of this client: ``head_steps``, or ``head_epochs`` passes of ``ceil(n_i / B)`` steps."""
        if fed.cfg.local_epochs:
            return int(self.rep.head_epochs or 0) * math.ceil(client.num_samples / fed.cfg.batch_size)
        return int(self.rep.head_steps or 0)

    @override
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        freeze(fed, self.body if client.step < self.head_updates(fed, client) else self.head)
