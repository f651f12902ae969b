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

The evaluated personal model (``personal``): ``optimum`` (the default) is the paper's :math:`\theta_i(w)` of Eqs. 2-3 at
the current global model, the inner problem solved on the client's training rows to ``personal_tol`` (relative
gradient-mapping norm, null: the dtype's default) in at most ``personal_max_steps`` iterations
(:func:`flx.parts.personalisation.moreau.moreau_solve`; a warning, once, when a client reaches the cap), memoised per
client for as long as the global model is unchanged (the evaluation, the structure metrics and the objective ask for the
same model; the memo is a pure function of :math:`w`, kept on the CPU, dropped when :math:`w` changes). ``stored`` is
the last local step's :math:`\theta` of the client's last round (kept in ``client.state`` on the CPU store, never as
per-client copies on the accelerator; Algorithm 1 lets every client compute while only the cohort trains here), the
global model for a client never sampled. ``steps`` (formerly ``solve``) runs :math:`K` full-batch inner steps from the
current global model. The step's training loss is the task loss of :math:`w` on :math:`D` before the step, in eval mode
(:meth:`~flx.federation.Federation.eval_loss`).

Symbols: ``lam`` (:math:`\lambda`), ``personal_lr`` (:math:`\nu`), ``inner_steps`` (:math:`K`), ``eta`` (``algo.lr``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.errors import bad_value, check_fields, count
from flx.hooks import PERSONAL_HEADLINE, FederatedCallback
from flx.parts.personalisation.fbe import as_regularizer, full_grad
from flx.parts.personalisation.moreau import default_tol, moreau_solve
from flx.parts.personalisation.personal_model import install, keep, stored
from flx.regularizers import Regularizer
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView
    from flx.hooks import Build

log = logging.getLogger(__name__)

PERSONAL = ("optimum", "stored", "steps")
_THETA = "pfedme/theta/"  # client.state keys: _THETA + index into fed.params


@dataclass(frozen=True)
class PFedMeParams:
    """``lam`` (:math:`\\lambda`), ``personal_lr`` (:math:`\\nu`), ``inner_steps`` (:math:`K`), the evaluation's
    personal model (``optimum``, ``stored`` or ``steps``) and the ``optimum`` solver's tolerance and step cap."""

    lam: float = 15.0
    personal_lr: float = 0.09
    inner_steps: int = 5
    personal: str = "optimum"
    personal_tol: float | None = None  # None: flx.parts.personalisation.moreau.default_tol of the parameters' dtype
    personal_max_steps: int = 1000


def inner_solve(
    fed: FederationView, theta: list[Tensor], w: Sequence[Tensor], rows: Tensor, p: PFedMeParams, reg: Regularizer
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
    :class:`~flx.parts.personalisation.fbe.FBE` (None: :math:`h = 0`, pFedMe as published)."""

    traits = PartTraits(uploads={}, headline=PERSONAL_HEADLINE)  # theta_i stays on the client

    def __init__(self, regularizer: Regularizer | Any = None, **params: Any) -> None:
        self.params = p = PFedMeParams(**params)
        check_fields(p, "algo.")
        if not p.lam > 0:
            raise bad_value("algo.lam", p.lam, "pFedMe's lambda, > 0")
        if not p.personal_lr > 0:
            raise bad_value("algo.personal_lr", p.personal_lr, "the inner step size nu, > 0")
        count("algo.inner_steps", p.inner_steps, 1)  # the inner steps K
        if p.personal not in PERSONAL:
            renamed = " ('solve' is now 'steps')" if p.personal == "solve" else ""
            raise bad_value("algo.personal", p.personal, f"allowed: {', '.join(PERSONAL)}{renamed}")
        if p.personal_tol is not None and not (isinstance(p.personal_tol, (int, float)) and 0 < p.personal_tol < 1):
            raise bad_value("algo.personal_tol", p.personal_tol, "the relative tolerance, in (0, 1), or null")
        count("algo.personal_max_steps", p.personal_max_steps, 1)
        self.reg = as_regularizer(regularizer)
        self.memo: dict[int, list[Tensor]] = {}  # cid -> theta_i(w) (optimum), on the CPU, for the global model below
        self.memo_w: list[Tensor] | None = None
        self.warned = False

    @override
    def check(self, build: Build) -> None:
        cfg = build.cfg
        for key in ("momentum", "weight_decay"):  # the local update is this part's own plain step, not the core's SGD
            if getattr(cfg, key) != 0:
                raise bad_value(f"algo.{key}", getattr(cfg, key), "must be 0: pFedMe's local update is plain")

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.reg.bind(fed.net)

    @override
    def local_update(self, fed: FederationView, client: ClientContext) -> Tensor:
        p, eta = self.params, fed.cfg.lr
        theta = [q.detach().clone() for q in fed.params]
        total: Tensor | float = 0.0
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
    def personalize(self, fed: FederationView, cid: int) -> Any:
        if self.params.personal == "stored":
            theta = stored(fed, cid, _THETA)
            return install(fed, theta) if theta is not None else None  # never trained: the global model
        rows = fed.data.client_indices[cid]
        if not len(rows):
            return None
        optimum = self.params.personal == "optimum"
        return install(fed, self._optimum(fed, cid, rows) if optimum else self._steps(fed, rows))

    def _steps(self, fed: FederationView, rows: Tensor) -> list[Tensor]:
        w = [q.detach().clone() for q in fed.params]
        return inner_solve(fed, [t.clone() for t in w], w, rows, self.params, self.reg)

    def _optimum(self, fed: FederationView, cid: int, rows: Tensor) -> list[Tensor]:
        """:math:`\\theta_i(w)` solved to the tolerance, from the memo while the global model is the one it was
        solved at."""
        w = [q.detach() for q in fed.params]
        if self.memo_w is None or not all(torch.equal(a, b) for a, b in zip(self.memo_w, w)):
            self.memo, self.memo_w = {}, [t.clone() for t in w]
        if cid not in self.memo:
            p = self.params
            theta, steps, rel = moreau_solve(fed, w, rows, p.lam, self.reg, p.personal_tol, p.personal_max_steps)
            tol = default_tol(w[0].dtype) if p.personal_tol is None else p.personal_tol
            if steps == p.personal_max_steps and rel > tol and not self.warned:  # a stall is the net's kinks
                self.warned = True
                log.warning(
                    "flx: pFedMe's personal model of client %d stopped at algo.personal_max_steps=%d iterations "
                    "with relative gradient-mapping norm %.3g > algo.personal_tol=%.3g; the last iterate is used, "
                    "raise the cap or the tolerance (warned once)",
                    cid,
                    steps,
                    rel,
                    tol,
                )
            self.memo[cid] = [t.detach().cpu() for t in theta]
        return self.memo[cid]
