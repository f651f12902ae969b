r"""FedALA: each client starts from an adaptive, element-wise mix of its old local model and the global one.

Zhang, Hua, Wang, Song, Xue, Ma, Guan, "FedALA: Adaptive Local Aggregation for Personalized Federated Learning",
AAAI 2023, arXiv:2212.01197, Eq. (5)-(8) and Algorithm 1. At the start of its round, client :math:`i` with old local
model :math:`\Theta_i` (its model after its last local training) and the round's global model :math:`\Theta` starts
from

.. math::
    \hat\Theta_i = \Theta_i + (\Theta - \Theta_i) \odot [\mathbf 1^{|\Theta| - p}; W_i^p],

the lower layers taking the global model and the top :math:`p` layers an element-wise mix with weights :math:`W_i^p
\in [0, 1]`, learned on a random sample :math:`D_i^s` of :math:`s\%` of its rows (minibatches of ``algo.batch_size``)
by projected gradient steps,

.. math::
    W_i^p \leftarrow \Pi_{[0, 1]}\big(W_i^p - \eta\, \nabla_{\hat\Theta^p} \mathcal L(\hat\Theta_i; D_i^s) \odot
        (\Theta^p - \Theta_i^p)\big)

(:math:`\nabla_W` by the chain rule), :math:`\hat\Theta_i` re-mixed after every step. Then the core's local steps
train from :math:`\hat\Theta_i`, and the client uploads its local model as in FedAvg. As in the paper: at a client's
first round there is no old model and ALA is off (:math:`\hat\Theta_i = \Theta`); the first time ALA runs,
:math:`W` starts at 1 and trains epoch after epoch over :math:`D_i^s` until the standard deviation of the last
``num_pre_loss`` epoch losses falls below ``threshold`` (at most ``max_epochs``); later, one epoch from the stored
:math:`W_i`. Choices (docs/baselines.md): a layer is a module owning trainable parameters (a ``Linear``'s weight and
bias are one layer); an epoch's loss is the mean of its minibatch losses; :math:`D_i^s` is a uniform sample drawn
each round from its own ``(seed, round, client)`` stream (the local steps' minibatches stay FedAvg's), its order kept
across the epochs of that round. :math:`\Theta_i` and
:math:`W_i` live in ``client.state``; ``personalize`` installs :math:`\Theta_i` (the client's local model after its
last training; a client never sampled: the global model).

Symbols: ``rand_percent`` (:math:`s`), ``layer_idx`` (:math:`p`), ``eta`` (:math:`\eta`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.errors import bad_value, check_fields
from flx.hooks import PERSONAL_HEADLINE, Build, FederatedCallback
from flx.parts.personalisation.personal_model import from_state, install, keep, stored
from flx.sampling import derive_seed
from flx.traits import PartTraits

if TYPE_CHECKING:
    from torch import nn

    from flx.context import ClientContext, FederationView

_OLD = "fedala/theta/"  # client.state keys: _OLD + index into fed.params (the local model)
_W = "fedala/W/"  # _W + j, j indexing the top layers' parameters
_WK = "fedala/W"
_TAG = 0xA1A  # the sample's stream: derive_seed(seed, round, client, copy, _TAG)


def top_params(net: nn.Module, p: int) -> tuple[int, ...]:
    """Indices into the net's trainable parameters of those owned by its last ``p`` layers (modules owning
    trainable parameters directly, in ``parameters()`` order)."""
    owners = [m for m in net.modules() for q in m.parameters(recurse=False) if q.requires_grad]
    layers = list(dict.fromkeys(id(m) for m in owners))
    return tuple(k for k, m in enumerate(owners) if id(m) in layers[len(layers) - p :])


@dataclass(frozen=True)
class FedALAParams:
    """``rand_percent`` (:math:`s`), ``layer_idx`` (:math:`p`), ``eta`` (:math:`\\eta`), ``threshold``,
    ``num_pre_loss`` and ``max_epochs`` (the first ALA's stopping rule)."""

    rand_percent: int = 80
    layer_idx: int = 1
    eta: float = 1.0
    threshold: float = 0.1
    num_pre_loss: int = 10
    max_epochs: int = 100


class FedALA(FederatedCallback):
    """Adaptive local aggregation at each client's start (``on_client_start``); the old local model and :math:`W_i`
    ride in the state store; ``personalize`` installs the local model."""

    traits = PartTraits(uploads={}, headline=PERSONAL_HEADLINE)  # Theta_i and W_i stay on the client

    def __init__(self, **params: Any) -> None:
        self.params = p = FedALAParams(**params)
        check_fields(p, "algo.")
        if not 0 < p.rand_percent <= 100:
            raise bad_value(
                "algo.rand_percent", p.rand_percent, "the percent s of a client's rows ALA learns on, 1-100"
            )
        if not p.layer_idx >= 1:
            raise bad_value("algo.layer_idx", p.layer_idx, "the top layers p that ALA mixes, >= 1")
        if not p.eta >= 0:
            raise bad_value("algo.eta", p.eta, "ALA's step size on W, >= 0 (0: W stays 1, FedAvg's start)")
        if not p.threshold >= 0:
            raise bad_value("algo.threshold", p.threshold, ">= 0")
        if not p.num_pre_loss >= 1:
            raise bad_value("algo.num_pre_loss", p.num_pre_loss, ">= 1")
        if not p.max_epochs >= 1:
            raise bad_value("algo.max_epochs", p.max_epochs, ">= 1")

    @override
    def check(self, build: Build) -> None:
        layers = len({id(m) for m in build.net.modules() for q in m.parameters(recurse=False) if q.requires_grad})
        if self.params.layer_idx > layers:
            raise bad_value("algo.layer_idx", self.params.layer_idx, f"at most the net's {layers} layers")

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.top = top_params(fed.net, self.params.layer_idx)

    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        old = from_state(client.state, _OLD, len(fed.params))
        if old is None:
            return  # the first round: no old local model, ALA is off (Theta_i = Theta)
        w = from_state(client.state, _W, len(self.top))
        start = w is None
        if w is None:
            w = [torch.ones_like(fed.params[k]) for k in self.top]
        w = self.learn(fed, client, old, w, start)
        with torch.no_grad():
            torch._foreach_copy_([fed.params[k] for k in self.top], self.mixed(fed, old, w))
        client.extras[_WK] = w

    def mixed(self, fed: FederationView, old: list[Tensor], w: list[Tensor]) -> list[Tensor]:
        r"""The top layers of :math:`\hat\Theta_i = \Theta_i + (\Theta - \Theta_i) \odot W`."""
        return [old[k] + (fed.global_params[k] - old[k]) * wj for k, wj in zip(self.top, w)]

    def learn(
        self, fed: FederationView, client: ClientContext, old: list[Tensor], w: list[Tensor], start: bool
    ) -> list[Tensor]:
        """Eq. (7)-(8): projected gradient steps on ``w`` over the round's sample :math:`D_i^s`; until the epoch losses
        settle the first time (``start``), one epoch afterwards."""
        p = self.params
        idx = fed.data.client_indices[client.cid]
        n = max(1, len(idx) * p.rand_percent // 100)
        gen = torch.Generator().manual_seed(
            derive_seed(fed.cfg.seed, client.round.round, client.cid, client.copy, _TAG)
        )
        sample = idx[torch.randperm(len(idx), generator=gen)[:n].to(idx.device)]
        diffs = [fed.global_params[k] - old[k] for k in self.top]
        history: list[float] = []
        for _ in range(p.max_epochs if start else 1):
            losses = []
            for rows in sample.split(fed.cfg.batch_size):
                theta = list(fed.global_params)
                for k, t in zip(self.top, self.mixed(fed, old, w)):
                    theta[k] = t
                loss, g = fed.value_and_grad_at(theta, rows)
                w = [(wj - p.eta * g[k] * d).clamp_(0.0, 1.0) for wj, k, d in zip(w, self.top, diffs)]
                losses.append(loss)
            history.append(float(torch.stack(losses).mean()))
            recent = torch.tensor(history[-p.num_pre_loss :], dtype=torch.float64)
            if len(history) > p.num_pre_loss and float(recent.std(unbiased=False)) < p.threshold:
                break
        return w

    @override
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        keep(client, _OLD, fed.params)
        if _WK in client.extras:
            keep(client, _W, client.extras.pop(_WK))

    @override
    def personalize(self, fed: FederationView, cid: int) -> Any:
        local = stored(fed, cid, _OLD)
        return install(fed, local) if local is not None else None
