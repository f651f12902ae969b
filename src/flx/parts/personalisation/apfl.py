r"""APFL: a per-client mix of a local model and the global one, with an adaptive mixing weight.

Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461, Algorithm 1 and the
mixing-weight update of its Sec. 3.2 (Eq. 11 in v3). Client :math:`i` keeps a local model :math:`v_i` and a weight
:math:`\alpha_i \in [0, 1]`; its personalised model is :math:`\bar v_i = \alpha_i v_i + (1 - \alpha_i) w`. At every
local step, on the step's minibatch :math:`\xi`, from the values before the step:

.. math::
    w &\leftarrow w - \eta \nabla f_i(w; \xi) \\
    v_i &\leftarrow v_i - \eta\, \alpha_i \nabla f_i(\bar v_i; \xi)
        \qquad (\nabla_v f_i(\alpha v + (1 - \alpha) w) = \alpha \nabla f_i(\bar v)) \\
    \alpha_i &\leftarrow \Pi_{[0, 1]}\big(\alpha_i - \eta_\alpha \langle v_i - w, \nabla f_i(\bar v_i; \xi) \rangle\big)

:math:`w`'s steps are the core's local SGD steps untouched, so the uploaded model and the global model are FedAvg's
bit for bit. :math:`v_i` and :math:`\alpha_i` step in ``on_local_grad`` (the net still holds :math:`w` before its
step) and live in ``client.state`` (the CPU store). Choices (docs/baselines.md): at a client's first round
:math:`v_i = w^t` (Algorithm 1 starts every :math:`v_i` from the initial model, which for a client first sampled late
is an untrained one) and :math:`\alpha_i` = ``alpha``; ``adapt_alpha: false`` keeps :math:`\alpha_i` fixed (the
paper's fixed-:math:`\alpha` runs); ``personalize`` installs :math:`\alpha_i v_i + (1 - \alpha_i) w` with :math:`w`
the current global model (a client never sampled: the global model). Only trainable parameters are mixed.

Symbols: ``alpha`` (:math:`\alpha_i` at the first visit), ``alpha_lr`` (:math:`\eta_\alpha`; None: ``algo.lr``,
the paper's one step size :math:`\eta_t`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.errors import bad_value, check_fields
from flx.hooks import PERSONAL_HEADLINE, FederatedCallback
from flx.parts.personalisation.personal_model import from_state, install, keep, stored
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView

_V = "apfl/v/"  # client.state keys: _V + index into fed.params
_ALPHA = "apfl/alpha"  # a float64 scalar
_VK = "apfl/v"


def mix(alpha: Tensor, v: Sequence[Tensor], w: Sequence[Tensor]) -> list[Tensor]:
    r""":math:`\alpha v + (1 - \alpha) w` per tensor, in ``w``'s dtype (``alpha = 0`` gives ``w`` exactly)."""
    return [alpha.to(b.dtype) * a + (1 - alpha.to(b.dtype)) * b for a, b in zip(v, w)]


@dataclass(frozen=True)
class APFLParams:
    """``alpha`` (the initial :math:`\\alpha_i`, in [0, 1]), ``adapt_alpha``, ``alpha_lr`` (:math:`\\eta_\\alpha`)."""

    alpha: float = 0.25
    adapt_alpha: bool = True
    alpha_lr: float | None = None


class APFL(FederatedCallback):
    """APFL's local models and mixing weights: one step of :math:`v_i` and :math:`\\alpha_i` per local step
    (``on_local_grad``), kept in the state store; ``personalize`` installs the mixed model."""

    traits = PartTraits(uploads={}, headline=PERSONAL_HEADLINE)  # v_i and alpha_i stay on the client

    def __init__(self, **params: Any) -> None:
        self.params = p = APFLParams(**params)
        check_fields(p, "algo.")
        if not 0 <= p.alpha <= 1:
            raise bad_value("algo.alpha", p.alpha, "APFL's initial mixing weight, in [0, 1]")
        if p.alpha_lr is not None and not p.alpha_lr > 0:
            raise bad_value("algo.alpha_lr", p.alpha_lr, "> 0, or null for algo.lr")

    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        v = from_state(client.state, _V, len(fed.params))
        client.extras[_VK] = v if v is not None else [t.clone() for t in fed.global_params]
        alpha = client.state.get(_ALPHA)
        client.state[_ALPHA] = torch.tensor(self.params.alpha, dtype=torch.float64) if alpha is None else alpha
        client.state[_ALPHA] = client.state[_ALPHA].to(fed.params[0].device)

    @override
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        assert client.rows is not None, "on_local_grad runs inside a local step"
        v: list[Tensor] = client.extras[_VK]
        w = [p.detach() for p in fed.params]  # w before its step
        alpha = client.state[_ALPHA]
        g = fed.grad_at(mix(alpha, v, w), client.rows)  # detached
        if self.params.adapt_alpha:
            lr = fed.cfg.lr if self.params.alpha_lr is None else self.params.alpha_lr
            slope = sum(((a - b).double() * c.double()).sum() for a, b, c in zip(v, w, g))
            client.state[_ALPHA] = (alpha - lr * slope).clamp(0.0, 1.0)
        torch._foreach_add_(v, torch._foreach_mul(g, alpha.to(g[0].dtype)), alpha=-fed.cfg.lr)

    @override
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        keep(client, _V, client.extras.pop(_VK))

    @override
    def personalize(self, fed: FederationView, cid: int) -> Any:
        v = stored(fed, cid, _V)
        if v is None:
            return None
        alpha = fed.store.get(cid, fed.params[0].device)[_ALPHA]
        return install(fed, mix(alpha, v, [p.detach() for p in fed.params]))
