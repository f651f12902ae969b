"""q-FedAvg: the server step of q-Fair Federated Learning (q-FFL).

T. Li, M. Sanjabi, A. Beirami, V. Smith, "Fair Resource Allocation in Federated Learning", ICLR 2020,
arXiv:1905.10497, Algorithm 2 (q-FedAvg), for :math:`\\min_w f_q(w) = \\sum_k \\frac{p_k}{q+1} F_k^{q+1}(w)` (Eq. 2).
With :math:`w^t` the round's global model and :math:`w_k` client ``k``'s model after its local SGD (line 5):

.. math::
    F_k = F_k(w^t), \\quad \\Delta w_k = L\\,(w^t - w_k), \\quad \\Delta_k = F_k^q\\,\\Delta w_k, \\quad
    h_k = q F_k^{q-1} \\lVert \\Delta w_k \\rVert^2 + L F_k^q \\quad (\\text{line 6})

    w^{t+1} = w^t - \\frac{\\sum_{k \\in S_t} \\Delta_k}{\\sum_{k \\in S_t} h_k} \\quad (\\text{line 8})

On the round protocol, unchanged: a client's aggregation weight becomes :math:`a_k = F_k^q`, so the federation's mean
is :math:`\\bar w = \\sum a_k w_k / \\sum a_k`, and

.. math::
    w^{t+1} = w^t + s\\,(\\bar w - w^t), \\qquad s = \\frac{L \\sum_k a_k}{\\sum_k h_k} \\in (0, 1].

The part owns ``F_k`` (one no-grad pass over the client's training rows, in eval mode), the weight :math:`a_k`, the
two sums behind ``s`` (a registered statistic in the round's one all-reduce) and the move to :math:`w^{t+1}` in
``on_server_step``; ``q = 0`` is FedAvg with uniform weights. ``L`` (``lipschitz``) defaults to :math:`1/\\eta`. The
choices the paper leaves open (``F_k`` on all rows, BatchNorm buffers, sampling, no ``1e-10``, what stops a run):
docs/drfa.md#q-fedavg. State lives for one round only: nothing to checkpoint.
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
from flx.traits import Channel, PartTraits

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

    traits = PartTraits(uploads={_SUMS: Channel("its loss (q-FFL's h_i weights)")})

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
        draws = client.stands_for  # k under duplicates=multiplicity (one run for k draws), 1 per run under repeat
        diff = torch._foreach_sub(fed.params, fed.global_params)  # w_k - w^t
        sq_dist = float(torch.stack(torch._foreach_norm(diff)).double().square().sum())
        a, h = qffl_terms(client.extras.pop("qffl_loss"), sq_dist, self.params.q, self.L)
        client.weight = draws * a
        sums = fed.stat(_SUMS)
        sums[0] += draws * a
        sums[1] += draws * h
