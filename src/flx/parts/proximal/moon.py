r"""MOON: a model-contrastive term in the local objective.

Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021, arXiv:2103.16257, Eq. (3)-(4) and Algorithm 1.
Client :math:`i` minimises, on each minibatch, the task loss plus :math:`\mu` times a contrastive loss that pulls the
representation :math:`z` of its local model towards :math:`z_{glob}` of the round's global model :math:`w^t` and
away from :math:`z_{prev}` of its own previous local model :math:`w_i^{prev}`:

.. math::
    \ell = \ell_{sup}(w; x, y) + \mu\, \ell_{con}, \qquad
    \ell_{con} = -\log \frac{\exp(\mathrm{sim}(z, z_{glob}) / \tau)}
        {\exp(\mathrm{sim}(z, z_{glob}) / \tau) + \exp(\mathrm{sim}(z, z_{prev}) / \tau)},

with :math:`\mathrm{sim}` the cosine similarity, :math:`\ell_{con}` averaged over the minibatch's rows and
:math:`z_{glob}`, :math:`z_{prev}` constants (no gradient). Choices (docs/baselines.md):

- **Representation**: :math:`z` is the net's penultimate features, :func:`flx.models.features.penultimate` (the input
  of its final linear layer). The paper puts a projection head (a 2-layer MLP) between the encoder and the output
  layer and takes its output; for the default MLP the last hidden layer plays that role. No head is added.
- **Previous model**: :math:`w_i^{prev}` is the client's local model at the end of the last round it trained in, kept
  in ``client.state``; at a client's first round it is :math:`w^t` (the authors' code starts every previous model
  from the initial global model), so :math:`z_{prev} = z_{glob}`, :math:`\ell_{con} = \log 2` with zero gradient:
  the first round is FedAvg's step. Only trainable parameters are kept; the other models run with the net's buffers
  (copies: BatchNorm statistics are updated by the local model's forward only).
- The three representations come from three forward passes through ``torch.func.functional_call`` (the net itself
  for :math:`z`, after its forward for the logits: dropout draws its own masks there).

``mu = 0`` adds nothing: FedAvg bit for bit. Symbols: ``mu`` (:math:`\mu`), ``temperature`` (:math:`\tau`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from typing_extensions import override

from flx.errors import bad_value, check_fields
from flx.hooks import Build, FederatedCallback
from flx.models.features import feature_dim, penultimate
from flx.parts.personalisation.personal_model import from_state, keep
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView

_PREV = "moon/prev/"  # client.state keys: _PREV + index into fed.params
_PREVK = "moon/prev"


def contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, temperature: float) -> Tensor:
    r"""Eq. (3): the mean over rows of :math:`-\log \frac{e^{s_g}}{e^{s_g} + e^{s_p}}`, :math:`s = \mathrm{sim} /
    \tau`; ``z``, ``z_glob``, ``z_prev`` are ``(B, D)``."""
    sims = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], 1)
    return F.cross_entropy(sims / temperature, torch.zeros(len(z), dtype=torch.long, device=z.device))


class _Features(nn.Module):
    """The net's penultimate features as a module's forward, for ``functional_call`` at other parameters."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return penultimate(self.net, x)


@dataclass(frozen=True)
class MoonParams:
    """``mu`` (:math:`\\mu`, ``algo.mu``, >= 0), ``temperature`` (:math:`\\tau`, ``algo.temperature``, > 0)."""

    mu: float = 1.0
    temperature: float = 0.5


class Moon(FederatedCallback):
    """Adds :math:`\\mu \\ell_{con}` to every local step's loss (``local_loss``); the previous local model rides in
    the state store."""

    traits = PartTraits(uploads={})  # w_i^prev stays on the client

    def __init__(self, **params: float) -> None:
        self.params = p = MoonParams(**params)
        check_fields(p, "algo.")
        if not p.mu >= 0:
            raise bad_value("algo.mu", p.mu, "MOON's mu, >= 0")
        if not p.temperature > 0:
            raise bad_value("algo.temperature", p.temperature, "MOON's temperature, > 0")

    @override
    def check(self, build: Build) -> None:
        feature_dim(build.net, tuple(build.clients.x.shape[1:]))  # one line for a net without penultimate features

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.features = _Features(fed.net)
        self.names = ["net." + n for n, p in fed.net.named_parameters() if p.requires_grad]

    def represent(self, fed: FederationView, params: Sequence[Tensor], x: Tensor) -> Tensor:
        """The penultimate features ``(B, D)`` of the net at ``params`` (gradients flow to ``params``)."""
        buffers = {"net." + n: b.clone() for n, b in fed.net.named_buffers()}
        return functional_call(self.features, (dict(zip(self.names, params)), buffers), (x,))

    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        if self.params.mu:
            prev = from_state(client.state, _PREV, len(fed.params))
            client.extras[_PREVK] = prev if prev is not None else fed.global_params

    @override
    def local_loss(self, fed: FederationView, client: ClientContext, loss: Tensor) -> Tensor:
        if self.params.mu == 0.0:
            return loss
        assert client.batch is not None, "local_loss runs inside a local step"
        x = client.batch[0]
        z = self.represent(fed, fed.params, x)
        with torch.no_grad():
            z_glob = self.represent(fed, fed.global_params, x)
            z_prev = self.represent(fed, client.extras[_PREVK], x)
        return loss + self.params.mu * contrastive_loss(z, z_glob, z_prev, self.params.temperature)

    @override
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        client.extras.pop(_PREVK, None)
        keep(client, _PREV, fed.params)  # the next round's w_i^prev
