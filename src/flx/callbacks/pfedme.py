r"""pFedMe: personalised federated learning with Moreau envelopes.

T. Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020, Algorithm 1 (the
pFedFBE paper's baseline). Client :math:`i` minimises the Moreau envelope
:math:`\hat F_i(w) = \min_\theta f_i(\theta) + \frac{\lambda}{2} \lVert \theta - w \rVert^2`, whose gradient is
:math:`\lambda (w - \theta_i(w))`. Local step :math:`r = 0..R-1` on a minibatch :math:`D`:

.. math::
    \theta \leftarrow \mathrm{prox}_{\nu h}\big(\theta - \nu (\nabla f_i(\theta; D) + \lambda (\theta - w))\big)
    \quad (K \text{ times}), \qquad w \leftarrow w - \eta \lambda (w - \theta),

and the server takes :math:`w \leftarrow (1 - \beta) w + \beta \bar w` (``algo.server.lr`` is :math:`\beta`; the
mean is uniform). The inner problem is solved approximately by :math:`K` gradient steps with the personal step
:math:`\nu`, warm-started from the previous step's :math:`\theta` (:math:`\theta = w^t` at the client's start), as
the authors' code does. With a regulariser :math:`h` (pFedFBE's composite setting) the inner steps are proximal
gradient steps on :math:`f_i + h + \frac{\lambda}{2} \lVert \theta - w \rVert^2`: our extension for the composite
experiments, the identity for :math:`h = 0`.

Deviations: Algorithm 1 lets every client compute and the server aggregate a sample; here only the cohort trains, so
a client's personal model :math:`\theta_i` (the last local step's, kept in ``client.state`` on the CPU store, never as
per-client copies on the accelerator) is from the last round it took part in, and a client never sampled is evaluated
with the global model. ``personal=solve`` instead solves the inner problem at evaluation from the current global
model (:math:`K` full-batch steps on the client's training rows). The step's training loss is the task loss of
:math:`w` on :math:`D` before the step, in eval mode (:meth:`~flx.federation.Federation.eval_loss`).

Symbols: ``lam`` (:math:`\lambda`), ``personal_lr`` (:math:`\nu`), ``inner_steps`` (:math:`K`), ``eta`` (``algo.lr``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.callbacks.fbe import as_regularizer, full_grad
from flx.callbacks.personal_model import install, keep, stored
from flx.errors import bad_value
from flx.hooks import PERSONAL_HEADLINE, FederatedCallback
from flx.regularizers import Regularizer

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationConfig
    from flx.federation import Federation

PERSONAL = ("stored", "solve")
_THETA = "pfedme/theta/"  # client.state keys: _THETA + index into fed.params


@dataclass(frozen=True)
class PFedMeParams:
    """``lam`` (:math:`\\lambda`), ``personal_lr`` (:math:`\\nu`), ``inner_steps`` (:math:`K`), the evaluation's
    personal model (``stored`` or ``solve``)."""

    lam: float = 15.0
    personal_lr: float = 0.09
    inner_steps: int = 5
    personal: str = "stored"


def inner_solve(
    fed: Federation, theta: list[Tensor], w: Sequence[Tensor], rows: Tensor, p: PFedMeParams, reg: Regularizer
) -> list[Tensor]:
    """:math:`K` proximal-gradient steps on :math:`f(\\theta; D) + h(\\theta) + \\frac{\\lambda}{2}\\lVert\\theta -
    w\\rVert^2` from ``theta`` (returned, new tensors)."""
    for _ in range(p.inner_steps):
        step = full_grad(fed, theta, rows)
        torch._foreach_add_(step, torch._foreach_sub(theta, list(w)), alpha=p.lam)
        theta = reg.prox(torch._foreach_add(theta, step, alpha=-p.personal_lr), p.personal_lr)
    return theta


class PFedMe(FederatedCallback):
    """pFedMe's local update (``local_update``) and personal model (``personalize``); ``regularizer`` as in
    :class:`~flx.callbacks.fbe.FBE` (None: :math:`h = 0`, pFedMe as published)."""

    headline = PERSONAL_HEADLINE

    def __init__(self, regularizer: Regularizer | Any = None, **params: Any) -> None:
        self.params = p = PFedMeParams(**params)
        if not p.lam > 0:
            raise bad_value("algo.lam", p.lam, "pFedMe's lambda, > 0")
        if not p.personal_lr > 0:
            raise bad_value("algo.personal_lr", p.personal_lr, "the inner step size nu, > 0")
        if p.inner_steps < 1:
            raise bad_value("algo.inner_steps", p.inner_steps, "the inner steps K, >= 1")
        if p.personal not in PERSONAL:
            raise bad_value("algo.personal", p.personal, f"allowed: {', '.join(PERSONAL)}")
        self.reg = as_regularizer(regularizer)

    @override
    def check_setup(self, datamodule: Any, cfg: FederationConfig) -> None:
        for key in ("momentum", "weight_decay"):  # the local update is this part's own plain step, not the core's SGD
            if getattr(cfg, key) != 0:
                raise bad_value(f"algo.{key}", getattr(cfg, key), "must be 0: pFedMe's local update is plain")

    @override
    def on_attach(self, fed: Federation) -> None:
        self.reg.bind(fed.net)

    @override
    def local_update(self, fed: Federation, client: ClientContext) -> Tensor:
        p, eta = self.params, fed.cfg.lr
        theta = [q.detach().clone() for q in fed.params]
        total = 0.0
        for rows in fed.client_batches(client):
            total += fed.eval_loss_tensor(rows)  # on the device: no host sync per step
            w = [q.detach() for q in fed.params]
            theta = inner_solve(fed, theta, w, rows, p, self.reg)
            with torch.no_grad():  # w <- w - eta lam (w - theta)
                torch._foreach_add_(fed.params, torch._foreach_sub(w, theta), alpha=-eta * p.lam)
        keep(client, _THETA, theta)
        mean = total / max(client.num_steps, 1)
        return mean if isinstance(mean, Tensor) else torch.zeros((), dtype=torch.float64, device=fed.params[0].device)

    @override
    def personalize(self, fed: Federation, cid: int) -> Any:
        if self.params.personal == "solve":
            rows = fed.data.client_indices[cid]
            return install(fed, self._solve(fed, rows)) if len(rows) else None
        theta = stored(fed, cid, _THETA)
        return install(fed, theta) if theta is not None else None  # never trained: the global model

    def _solve(self, fed: Federation, rows: Tensor) -> list[Tensor]:
        w = [q.detach().clone() for q in fed.params]
        return inner_solve(fed, [t.clone() for t in w], w, rows, self.params, self.reg)
