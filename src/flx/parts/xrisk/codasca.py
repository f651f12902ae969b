r"""CODASCA: federated min-max AUC maximisation with control variates (a FeDXL baseline).

Yuan, Guo, Xu, Ying, Yang, "Federated Deep AUC Maximization for Heterogeneous Data with a Constant
Communication Complexity", ICML 2021. Primal variables :math:`v = (w, a, b)`, dual :math:`\alpha \ge 0`, objective
the AUC-M surrogate :math:`F` of :mod:`flx.losses.aucm`. Stage :math:`s` solves the proximal problem
:math:`F(v, \alpha) + \frac{1}{2\gamma}\|v - v_{s-1}\|^2` by local stochastic gradient descent-ascent whose
client drift is corrected by SCAFFOLD-style control variates :math:`c_i` (client) and :math:`c` (server):

.. math::
    v_i \leftarrow v_i - \eta_s\big(\nabla_v F_i(v_i, \alpha_i; z) - c_{i,v} + c_v + \tfrac1\gamma (v_i - v_{s-1})\big),
    \qquad \alpha_i \leftarrow \Big[\alpha_i + \eta_s\big(\nabla_\alpha F_i - c_{i,\alpha} + c_\alpha\big)\Big]_+

for :math:`K` local steps; then :math:`c_i^{new}` is the mean of the client's :math:`K` stochastic gradients,
:math:`c \leftarrow c + \frac1N \sum_{i \in P}(c_i^{new} - c_i)` (with every client participating: the mean of the
:math:`c_i`), and the server averages :math:`(w, a, b, \alpha)` with the global step size :math:`\eta_g`
(``algo.server.lr``). Every ``t0`` local iterations a new stage starts: :math:`\eta_s = \eta / \text{decay}^s` and
the reference :math:`v_s` becomes the mean of the stage's global iterates.

Choices (the FeDXL paper only names CODASCA as a baseline, Sec. 4; these follow the authors' public code
of CODASCA, LibAUC example 06, and are options where the paper and code can differ):

- ``alpha_grad="ab"`` (code): the dual step uses :math:`2(m + b - a) - 2\alpha` with the just-updated
  :math:`a, b`; ``"stochastic"`` uses the minibatch :math:`\partial_\alpha F`.
- ``clip=1.0`` (code): the :math:`w` gradient is clipped elementwise to :math:`[-1, 1]` before the correction
  (``null`` disables); :math:`c_i` averages the unclipped gradients, as the code.
- ``control="grad_mean"`` (code); ``"none"`` drops the control variates (CODA+, the same paper's baseline).
- The stage reference :math:`v_0` is the initial model with :math:`a = b = 0` (the code draws it from
  N(0, 0.01^2)); later references are the mean of the global models after each round of the stage (the code
  averages each client's local iterates and never synchronises them, so its clients hold different references).
- ``p`` (the positive ratio) defaults to the fraction of positives in the whole training set (the code passes
  the known ``imratio``). Scores are :math:`h = \sigma(z)` (``score``), as the code's sigmoid output, with
  :math:`z = \text{logit}_1 - \text{logit}_0`, or the single logit with ``model.binary_head=one_logit``
  (:mod:`flx.models.heads`). ``algo.weight_decay`` applies to :math:`a, b` too, as in the code.
- The server step of :math:`a, b, \alpha` is the plain step :math:`x + \eta_g(\bar x - x)` whatever
  ``algo.server.name`` is; the defaults (``sgd``, ``lr=1``) give the code's plain averaging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.aggregation import flat_views, numel
from flx.errors import bad_value, check_fields
from flx.hooks import FederatedCallback
from flx.local_sgd import grads_of
from flx.losses import aucm, xrisk
from flx.models import heads
from flx.traits import Channel, PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView, Round
    from flx.hooks import Build

A, B, ALPHA = 0, 1, 2  # offsets of a, b, alpha after the flattened w in the (n + 3) vectors
_SUMS = "codasca/sums"  # the registered statistic: (a, b, alpha) weighted sums, weight sum, sum of c_i^new - c_i


@dataclass(frozen=True)
class CodascaParams:
    """Symbols: ``margin`` (m), ``gamma`` (the proximal 1/gamma weight), ``t0`` (local iterations per stage)."""

    margin: float = 1.0
    gamma: float = 500.0
    t0: int = 4000
    decay: float = 3.0
    control: str = "grad_mean"
    clip: float | None = 1.0
    alpha_grad: str = "ab"
    p: float | None = None
    score: str = "sigmoid"


class Codasca(FederatedCallback):
    """The AUC-M local objective, its primal-dual local steps with control variates, and the stage schedule."""

    traits = PartTraits(uploads={_SUMS: Channel("its control variates and AUC statistics (CODASCA)")})

    def __init__(self, **params: Any) -> None:
        self.params = p = CodascaParams(**params)
        check_fields(p, "algo.")
        for key, value, allowed in (
            ("control", p.control, ("grad_mean", "none")),
            ("alpha_grad", p.alpha_grad, ("ab", "stochastic")),
            ("score", p.score, ("sigmoid", "logit")),
        ):
            if value not in allowed:
                raise bad_value(f"algo.{key}", value, f"allowed: {', '.join(allowed)}")
        for key, ok, rule in (
            ("margin", p.margin > 0, "the AUC margin, must be > 0"),
            ("gamma", p.gamma > 0, "must be > 0"),
            ("decay", p.decay >= 1, "must be >= 1"),
            ("t0", p.t0 >= 1, "must be >= 1"),
        ):
            if not ok:
                raise bad_value(f"algo.{key}", getattr(p, key), rule)
        if p.clip is not None and not p.clip > 0:
            raise bad_value("algo.clip", p.clip, "a positive number, or null for no clipping")
        if p.p is not None and not 0 < p.p < 1:
            raise bad_value("algo.p", p.p, "the positive ratio, in (0, 1); null = measured on the training set")
        self.state: dict[str, Any] = {}
        self.lr = 0.0  # eta_s of the current stage
        self._ref_w: list[Tensor] = []  # the stage reference's w, per parameter tensor (views into state["ref"])

    @override
    def check(self, build: Build) -> None:
        cfg = build.cfg
        xrisk.check_binary_labels(build.clients.y, "algo=codasca")  # the training split's labels
        if cfg.local_epochs is not None:
            raise bad_value("algo.local_epochs", cfg.local_epochs, "CODASCA counts stages in steps: use null")

    @override
    def on_attach(self, fed: FederationView) -> None:
        # (a, b, alpha) weighted sums (3), weight sum (1), sum of c_i^new - c_i (n + 3): this rank's clients, summed
        # over ranks by the round's all-reduce; in the model's dtype, as the server state c and (a, b, alpha)
        fed.register_stat(_SUMS, torch.zeros(4 + numel(fed.params) + 3, dtype=fed.params[0].dtype))

    # ------------------------------------------------------------------ server
    @override
    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        st, n = self.state, numel(fed.params)
        if not st:
            like = fed.params[0]
            rows = torch.cat(list(fed.data.client_indices[: fed.num_clients]))  # the training clients
            ratio = self.params.p if self.params.p is not None else float((fed.data.y[rows] == 1).double().mean())
            if not 0 < ratio < 1:
                raise RuntimeError(f"CODASCA: the training set has positive ratio {ratio}; it needs both classes")
            st.update(
                p=ratio,
                abz=torch.zeros(3, dtype=like.dtype, device=like.device),
                c=torch.zeros(n + 3, dtype=like.dtype, device=like.device),
                ref=self._global_vector(fed, None),
                ref_sum=torch.zeros(n + 2, dtype=like.dtype, device=like.device),
                ref_count=0,
                stage=0,
            )
        stage = rnd.round * fed.cfg.local_steps // self.params.t0
        if stage != st["stage"]:
            if st["ref_count"]:
                st["ref"] = st["ref_sum"] / st["ref_count"]
            st["ref_sum"].zero_()
            st["ref_count"], st["stage"] = 0, stage
        self.lr = fed.cfg.lr / self.params.decay ** st["stage"]
        self._ref_w = flat_views(st["ref"][:n], fed.params)
        for group in fed.local_opt.param_groups:
            group["lr"] = self.lr

    def _global_vector(self, fed: FederationView, abz: Tensor | None) -> Tensor:
        """``(w, a, b)`` of the global model, flat (``a = b = 0`` before the first round)."""
        w = torch.cat([p.detach().reshape(-1) for p in fed.global_params])
        return torch.cat([w, abz[:2] if abz is not None else w.new_zeros(2)])

    @override
    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        st, sums = self.state, fed.stat(_SUMS)
        assert isinstance(sums, Tensor)  # registered as one tensor
        eta_g = fed.cfg.server.lr
        st["abz"] += eta_g * (sums[:3] / sums[3] - st["abz"])
        st["abz"][ALPHA].clamp_(min=0)
        st["c"] += sums[4:] / fed.num_clients

    @override
    def on_round_end(self, fed: FederationView, rnd: Round) -> None:
        self.state["ref_sum"] += self._global_vector(fed, self.state["abz"])
        self.state["ref_count"] += 1

    # ------------------------------------------------------------------ client
    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        st = self.state
        ci = client.state.get("c")
        if ci is None:
            ci = torch.zeros_like(st["c"])
        a, b, alpha = (st["abz"][i].clone().requires_grad_(True) for i in (A, B, ALPHA))
        client.extras["codasca"] = {
            "a": a,
            "b": b,
            "alpha": alpha,
            "ci": ci,
            "corr": (st["c"] - ci) if self.params.control == "grad_mean" else torch.zeros_like(ci),
            "acc": torch.zeros_like(ci),
        }
        s, n = client.extras["codasca"], numel(fed.params)
        s["corr_w"], s["acc_w"] = flat_views(s["corr"][:n], fed.params), flat_views(s["acc"][:n], fed.params)

    @override
    def local_loss(self, fed: FederationView, client: ClientContext, loss: Tensor) -> Tensor:
        s = client.extras["codasca"]
        assert client.outputs is not None and client.batch is not None  # set before local_loss
        h = heads.binary_score(client.outputs, self.params.score)
        return aucm.aucm(h, client.batch[1], s["a"], s["b"], s["alpha"], self.state["p"], self.params.margin)

    @override
    @torch.no_grad()
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        p, st, s, lr = self.params, self.state, client.extras["codasca"], self.lr
        n, wd, corr, ref = numel(fed.params), fed.cfg.weight_decay, s["corr"], st["ref"]
        # per parameter tensor, no flattening: g <- clip(g) + (c - c_i) + (w - w_ref) / gamma; c_i sums the raw g
        grads = grads_of(fed.params)
        torch._foreach_add_(s["acc_w"], grads)
        if p.clip is not None:
            torch._foreach_clamp_min_(grads, -p.clip)
            torch._foreach_clamp_max_(grads, p.clip)
        torch._foreach_add_(grads, s["corr_w"])
        prox = list(torch._foreach_sub([q.detach() for q in fed.params], self._ref_w))
        torch._foreach_div_(prox, p.gamma)
        torch._foreach_add_(grads, prox)  # the SGD step (lr = eta_s, weight decay wd) then moves w
        a, b, alpha = s["a"], s["b"], s["alpha"]
        for i, var in ((A, a), (B, b)):
            g = var.grad
            s["acc"][n + i] += g
            var -= lr * (g + corr[n + i] + (var - ref[n + i]) / p.gamma + wd * var)
            var.grad = None
        g_alpha = aucm.alpha_grad_ab(a, b, alpha, p.margin) if p.alpha_grad == "ab" else alpha.grad
        s["acc"][n + ALPHA] += g_alpha
        alpha += lr * (g_alpha + corr[n + ALPHA])
        alpha.clamp_(min=0)
        alpha.grad = None

    @override
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        s, sums = client.extras.pop("codasca"), fed.stat(_SUMS)
        assert isinstance(sums, Tensor)  # registered as one tensor
        sums[:3] += client.weight * torch.stack([s["a"].detach(), s["b"].detach(), s["alpha"].detach()])
        sums[3] += client.weight
        if self.params.control == "grad_mean":
            ci = s["acc"] / client.num_steps
            sums[4:] += ci - s["ci"]
            client.state["c"] = ci

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = dict(state_dict)
