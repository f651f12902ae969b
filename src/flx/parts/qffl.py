"""q-FedAvg: the server step of q-Fair Federated Learning (q-FFL).

Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated Learning", ICLR 2020, Algorithm 2
(q-FedAvg), for the objective :math:`\\min_w f_q(w) = \\sum_k \\frac{p_k}{q+1} F_k^{q+1}(w)` (Eq. 2). With
:math:`w^t` the round's global model and :math:`w_k` client ``k``'s model after its local SGD (line 5):

.. math::
    F_k = F_k(w^t), \\quad \\Delta w_k = L\\,(w^t - w_k), \\quad \\Delta_k = F_k^q\\,\\Delta w_k, \\quad
    h_k = q F_k^{q-1} \\lVert \\Delta w_k \\rVert^2 + L F_k^q \\quad (\\text{line 6})

    w^{t+1} = w^t - \\frac{\\sum_{k \\in S_t} \\Delta_k}{\\sum_{k \\in S_t} h_k} \\quad (\\text{line 8})

How it maps onto the round protocol (no change to it): a client's aggregation weight becomes
:math:`a_k = F_k^q`, so the federation's weighted mean is :math:`\\bar w = \\sum a_k w_k / \\sum a_k`, and since
:math:`\\sum_k \\Delta_k = L \\sum_k a_k\\,(w^t - \\bar w)`,

.. math::
    w^{t+1} = w^t + s\\,(\\bar w - w^t), \\qquad s = \\frac{L \\sum_k a_k}{\\sum_k h_k} \\in (0, 1]
    \\quad (h_k \\ge L a_k).

``on_server_step`` moves the parameter entries of the mean to that point, so the default server optimizer
(sgd, lr 1) lands on :math:`w^{t+1}` exactly; another server optimizer sees the pseudo-gradient
:math:`\\sum \\Delta_k / \\sum h_k`. The federation multiplies every weight by one positive per-round scale, which
cancels in :math:`\\bar w` (a ratio); ``s`` uses this part's own unscaled sums (2 numbers, a registered statistic in
the model's dtype) that ride in the round's one all-reduce. ``q = 0`` gives :math:`a_k = 1, h_k = L, s = 1`: the
uniform mean, i.e. FedAvg with ``weighting: uniform``.

Choices the paper leaves open:

- ``F_k`` is the mean loss over ALL the client's training samples (as the authors' code, not a minibatch): one
  extra no-grad forward pass over the client's data per round, in chunks; ``fed.loss_fn`` must be a batch mean.
- The net is in eval mode during that pass (then back in train mode): no dropout noise and no RNG draw, and
  BatchNorm neither uses batch statistics nor updates its running statistics, so local training is exactly
  FedAvg's. The pass runs under the precision context of the local steps.
- Float buffers (BatchNorm running statistics) are not iterates of the update: they keep the
  :math:`F_k^q`-weighted mean :math:`\\bar w` and are not moved by ``s``.
- ``L`` (``lipschitz``) defaults to :math:`1/\\eta` (``algo.lr``), as in the paper's experiments and code.
- The paper draws :math:`S_t` with probabilities :math:`p_k`; its code, and the federation's default, draw
  uniformly without replacement (so ``weighting`` plays no part: this part replaces the weight). A client drawn
  several times by a sampling part counts once per draw in both sums.
- The authors' code adds ``1e-10`` to ``F_k``; here ``F_k`` is used as is: the term
  :math:`q F_k^{q-1} \\lVert \\Delta w_k \\rVert^2` is 0 when ``q = 0`` or :math:`\\Delta w_k = 0` (no 0 * inf), a
  negative or non-finite ``F_k`` stops the run, and so does a round with :math:`\\sum h_k \\notin (0, \\infty)`. If
  every sampled client has ``F_k = 0`` with ``q > 0``, all weights are 0 and the federation's mean itself raises.

State lives for one round only (the two sums, zeroed by the federation at each round start, and each client's
``F_k``): nothing to checkpoint, so ``state_dict`` is Lightning's empty default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from typing_extensions import override

from flx.errors import bad_value, check_fields
from flx.hooks import FederatedCallback

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView, Round

_SUMS = "qffl/sums"  # the registered statistic (sum a_k, sum h_k)


def qffl_terms(loss: float, sq_dist: float, q: float, lipschitz: float) -> tuple[float, float]:
    """``(a_k, h_k) = (F^q, q F^(q-1) ||Delta w||^2 + L F^q)`` with ``F = loss``, ``||w^t - w_k||^2 = sq_dist``.

    >>> qffl_terms(4.0, 0.25, q=0.5, lipschitz=2.0)  # ||Delta w||^2 = 4 * 0.25 = 1; h = 0.5 * 4^-0.5 + 2 * 2
    (2.0, 4.25)
    >>> qffl_terms(0.0, 1.0, q=0.0, lipschitz=3.0)  # q = 0: a = 1, h = L whatever F
    (1.0, 3.0)
    """
    a = loss**q  # 0.0 ** 0 == 1.0
    sq_step = lipschitz**2 * sq_dist
    if q == 0 or sq_step == 0:
        return a, lipschitz * a
    f_pow = loss ** (q - 1) if loss > 0 or q >= 1 else math.inf  # F -> 0+ with q < 1
    return a, q * f_pow * sq_step + lipschitz * a


@dataclass(frozen=True)
class QFFLParams:
    """``q``: fairness exponent (``algo.q``, ``>= 0``); ``lipschitz``: ``L`` (``algo.lipschitz``, None: 1/eta)."""

    q: float = 0.2
    lipschitz: float | None = None


class QFFL(FederatedCallback):
    """Weights clients by ``F_k^q`` and rescales the server step by ``L sum a_k / sum h_k``.

    Symbols: ``q``, ``L`` (lipschitz), ``F_k`` (client loss at ``w^t``), ``a_k = F_k^q``, ``h_k``, ``s``.
    """

    uploads = ("its loss (q-FFL's h_i weights)",)

    def __init__(self, q: float = 0.2, lipschitz: float | None = None) -> None:
        check_fields(QFFLParams(q=q, lipschitz=lipschitz), "algo.")
        if not 0 <= q < math.inf:
            raise bad_value("algo.q", q, "must be a finite number >= 0 (q = 0 is FedAvg)")
        if lipschitz is not None and not 0 < lipschitz < math.inf:
            raise bad_value("algo.lipschitz", lipschitz, "must be a finite number > 0, or null for 1/algo.lr")
        self.params = QFFLParams(q=float(q), lipschitz=None if lipschitz is None else float(lipschitz))
        self.L = 0.0

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.L = 1.0 / fed.cfg.lr if self.params.lipschitz is None else self.params.lipschitz
        # (sum a_k, sum h_k): this rank's clients, summed over ranks by the round's all-reduce. The model's dtype, so
        # an fp32 model keeps an fp32 round buffer; s is a ratio of two sums, fp32 rounding (1e-7) is harmless
        fed.register_stat(_SUMS, torch.zeros(2, dtype=fed.params[0].dtype))

    # ------------------------------------------------------------------ server
    @override
    @torch.no_grad()
    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        sums = fed.stat(_SUMS)
        assert isinstance(sums, Tensor)  # registered as one tensor
        sum_a, sum_h = sums.cpu().tolist()  # one copy to the host a round
        if not 0 < sum_h < math.inf:
            raise RuntimeError(f"q-FFL round {rnd.round}: sum of h_k is {sum_h}, the server step needs it in (0, inf)")
        s = self.L * sum_a / sum_h
        params = mean[: len(fed.params)]  # float buffers keep the weighted mean
        torch._foreach_mul_(params, s)  # w^t + s (mean - w^t), with s in (0, 1]
        torch._foreach_add_(params, [g.to(m.dtype) for m, g in zip(params, fed.global_params)], alpha=1.0 - s)

    # ------------------------------------------------------------------ client
    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        loss = fed.eval_loss(fed.data.client_indices[client.cid])
        if not 0 <= loss < math.inf:
            raise RuntimeError(f"q-FFL: client {client.cid} has loss F_k={loss} at w^t; q-FFL needs a finite F_k >= 0")
        client.extras["qffl_loss"] = loss

    @override
    @torch.no_grad()
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        draws = client.draws  # k under duplicates=multiplicity (one run for k draws), 1 per run under repeat
        diff = torch._foreach_sub(fed.params, fed.global_params)  # w_k - w^t
        sq_dist = float(torch.stack(torch._foreach_norm(diff)).double().square().sum())
        a, h = qffl_terms(client.extras.pop("qffl_loss"), sq_dist, self.params.q, self.L)
        client.weight = draws * a
        sums = fed.stat(_SUMS)
        sums[0] += draws * a
        sums[1] += draws * h
