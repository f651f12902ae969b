"""Per-client additive Gaussian input noise: feature heterogeneity as in FeDXL's experiments.

Guo, Jin, Luo, Yang, ICML 2023, Sec. 4 ("Datasets and Neural Networks"): every training input of machine ``i``
gets noise :math:`\\mathcal N(\\mu_i, 0.04)` with :math:`\\mu_i = -0.08 + 0.01\\,i`; the authors' code adds
it per pixel after normalisation, re-sampled on every load (``std = 0.2``), to training data only.

.. math::
    \\tilde x = x + \\mu_i + \\sigma\\,\\varepsilon, \\qquad \\varepsilon \\sim \\mathcal N(0, I),
    \\quad \\mu_i = \\mu_0 + i\\,\\delta

The noise is drawn from the client's generator, so it depends only on ``(seed, round, client)``; it is
applied by a forward pre-hook that exists only while the client trains (evaluation sees clean inputs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from flx.errors import bad_value, number_error
from flx.hooks import FederatedCallback
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView


class ClientNoise(FederatedCallback):
    """Adds ``N(mu0 + delta * client_id, sigma^2)`` noise to every local training input.

    Args:
        mu0: mean for client 0 (paper: -0.08).
        delta: mean increment per client id (paper: 0.01).
        sigma: standard deviation (paper: variance 0.04, i.e. 0.2).
    """

    # the inputs change on the client, nothing is sent; a part that scores client inputs applies the same noise
    traits = PartTraits(uploads={}, provides=("client_noise",))

    def __init__(self, mu0: float = -0.08, delta: float = 0.01, sigma: float = 0.2) -> None:
        for key, value in (("mu0", mu0), ("delta", delta), ("sigma", sigma)):
            err = number_error(f"algo.parts.noise.{key}", value)
            if err is not None:
                raise err
        if not sigma >= 0:
            raise bad_value("algo.parts.noise.sigma", sigma, "must be >= 0")
        self.mu0, self.delta, self.sigma = float(mu0), float(delta), float(sigma)
        self._handle: Any = None

    def register_input_hook(self, net: nn.Module, cid: int, generator: torch.Generator) -> RemovableHandle:
        """Adds client ``cid``'s noise to every input of ``net`` (drawn from ``generator``) until the handle is removed.

        Public so that a part scoring client inputs outside the local steps applies the same noise (FeDXL's
        round-1 pools, ``algo.init_pools=minibatch``).
        """
        mu = self.mu0 + self.delta * cid

        def add_noise(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
            x = args[0]
            eps = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device) if self.sigma else 0.0
            return (x + mu + self.sigma * eps, *args[1:])

        return net.register_forward_pre_hook(add_noise)

    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        self._handle = self.register_input_hook(fed.net, client.cid, client.generator)

    @override
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        self._handle.remove()
        self._handle = None
