r"""FedBABU: only the body is trained and averaged; the head stays at its initial values until evaluation.

Oh, Kim, Yun, "FedBABU: Towards Enhanced Representation for Federated Image Classification", ICLR 2022,
arXiv:2106.06042, Algorithm 1: the head :math:`\theta_h` (the final linear classifier) is randomly initialised and
never updated during federated training; every client updates the body :math:`\theta_b` alone, and the server
averages the bodies:

.. math::
    \theta_{b,i}^{t} = \mathrm{SGD}_i\big(\theta_b^t;\ \theta_h^0 \text{ fixed}\big), \qquad
    \theta_b^{t+1} = \sum_{i \in P_t} \frac{n_i}{n} \theta_{b,i}^{t}, \qquad \theta_h^{t} = \theta_h^0.

At evaluation each client fine-tunes the whole model (body and head) on its own training rows and is measured with
the result (the paper's personalised accuracy, :math:`\tau_f = 5` fine-tuning epochs in the authors' code). That
fine-tuning is :class:`~flx.parts.meta_learning.adapt.Adapt`'s (listed after this part in ``algo=fedbabu``:
``algo.adapt_steps`` full-batch gradient steps of size ``algo.adapt_lr`` on the client's rows); departure: full-batch
steps, not minibatch epochs. The frozen head gets no gradient at a local step
(:func:`~flx.parts.personalisation.local_layers.freeze`: momentum and weight decay leave it too) and the server keeps
its copy (the head entries of the mean are set back to :math:`\theta_h^0`, bit for bit). ``algo.frozen`` (default
``head``) names the frozen tensors with :mod:`~flx.parts.personalisation.local_layers`'s patterns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor
from typing_extensions import override

from flx.errors import check_fields
from flx.hooks import Build, FederatedCallback
from flx.parts.personalisation.local_layers import as_patterns, freeze, keep_server, no_server_decay, select
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView


@dataclass(frozen=True)
class FedBABUParams:
    """``frozen``: the patterns of the tensors that no local step moves (the head)."""

    frozen: tuple[str, ...] = ("head",)


class FedBABU(FederatedCallback):
    """FedBABU's training: the tensors ``frozen`` names (:math:`\\theta_h`) get no local update and keep their initial
    values on the server; the rest (:math:`\\theta_b`) is FedAvg's."""

    # the body's update only (the head's upload is the server's own value); the freeze reads no rows
    traits = PartTraits(uploads={}, steps="data_free")

    def __init__(self, frozen: Sequence[str] = ("head",)) -> None:
        self.params = FedBABUParams(as_patterns("algo.frozen", frozen))
        check_fields(self.params, "algo.")
        self.frozen: tuple[int, ...] = ()  # positions in fed.params, set at attach

    @override
    def check(self, build: Build) -> None:
        select(build.net, [], self.params.frozen, "algo.frozen")  # every pattern names a tensor of the net
        no_server_decay(build, "FedBABU")

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.frozen = select(fed.net, fed.params, self.params.frozen, "algo.frozen")

    @override
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        freeze(fed, self.frozen)

    @override
    def on_server_step(self, fed: FederationView, rnd: Any, mean: list[Tensor]) -> None:
        keep_server(fed, mean, self.frozen)
