r"""SCAFFOLD: control variates that correct the client drift of local SGD.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
ICML 2020, arXiv:1910.06378, Algorithm 1. Client :math:`i` of the cohort :math:`S` starts from the server model
:math:`x` and takes :math:`K` steps corrected by its control variate :math:`c_i` and the server's :math:`c`
(lines 8-10):

.. math::
    y_i \leftarrow y_i - \eta_l \big(g_i(y_i) - c_i + c\big),

then (line 12) :math:`c_i^+ = g_i(x)` (option I) or :math:`c_i^+ = c_i - c + \frac{1}{K \eta_l}(x - y_i)`
(option II), uploads :math:`(\Delta y_i, \Delta c_i) = (y_i - x, c_i^+ - c_i)` and keeps :math:`c_i \leftarrow
c_i^+`. The server (lines 16-17): :math:`x \leftarrow x + \eta_g \Delta x` with :math:`\Delta x` the clients' mean
:math:`\Delta y_i` (the core's server step: ``algo.server`` with ``name=sgd``, ``lr`` = :math:`\eta_g`), and

.. math::
    c \leftarrow c + \sum_{i \in S} \frac{p_i}{\sum_{j=1}^N p_j} \Delta c_i,

with :math:`p_i` the core's aggregation weight (``algo.weighting``). ``uniform`` gives the paper's
:math:`c + \frac{|S|}{N} \frac{1}{|S|} \sum_{i \in S} \Delta c_i` exactly; ``num_samples`` (:math:`p_i = n_i`)
keeps :math:`c = \sum_j \frac{n_j}{n} c_j`, the control variate of the sample-weighted objective
:math:`\sum_j \frac{n_j}{n} f_j` that flx's FedAvg mean targets: the fixed point of the iteration is the minimiser
of the objective whose weights :math:`c` averages the :math:`c_j` with, whatever weights average the models.

Choices: option II by default (``algo.control=option2``, the paper's experiments); option I's :math:`g_i(x)` is the
gradient of the client's mean loss over all its training rows at :math:`x` (an extra pass, as the paper describes
it), in chunks of at most ``CHUNK`` rows. :math:`c_i` and :math:`c` start at 0 (Algorithm 1 takes them as inputs; zeros
keep :math:`c` the weighted mean of the :math:`c_i`); :math:`c_i` lives in the client state store, :math:`c` in the
part's state. Option II's
:math:`(x - y_i)/(K \eta_l)` is the clients' mean corrected gradient for plain SGD (``algo.momentum=0``); with
momentum it is the mean step instead. :math:`\Delta c_i`, weighted, rides in the round's one all-reduce (a declared
channel: privacy parts refuse it).

Symbols: ``eta_l`` = ``algo.lr``, ``eta_g`` = ``algo.server.lr``, ``K`` = the client's local steps.
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
from flx.traits import Channel, PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView, Round
    from flx.vectorized import Cohort

CONTROLS = ("option1", "option2")
CHUNK = 4096  # rows per gradient pass of option I
_DC = "scaffold/delta_c"  # the registered statistic: sum over the round's clients of p_i / sum_j p_j * Delta c_i
_CI = "scaffold/c"  # client.state: c_i, flat
_K = "scaffold"  # client.extras: (c_i, c - c_i, views of c - c_i shaped like fed.params)


def flat(tensors: list[Tensor]) -> Tensor:
    """The tensors as one flat vector (a copy)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def total_weight(fed: FederationView) -> float:
    """:math:`\\sum_{j=1}^N p_j` over every training client: the round's weights ``p_j`` (``algo.weighting``) summed
    over the federation, not the cohort."""
    if fed.cfg.weighting == "num_samples":
        return float(sum(fed.num_samples(j) for j in range(fed.num_clients)))
    return float(fed.num_clients)


@dataclass(frozen=True)
class ScaffoldParams:
    """``control``: how :math:`c_i^+` is computed, ``option1`` (:math:`g_i(x)`) or ``option2`` (the paper's
    experiments)."""

    control: str = "option2"


class Scaffold(FederatedCallback):
    """SCAFFOLD's corrected local steps, client control variates in the state store and the server's :math:`c`.
    Symbols: ``c`` (server), ``c_i`` (client), ``eta_l``, ``K``."""

    traits = PartTraits(
        uploads={_DC: Channel("its control-variate update Delta c_i (SCAFFOLD)")},
        vectorizable=True,  # the correction c - c_i is a constant per client: added to each stacked gradient
    )

    def __init__(self, control: str = "option2") -> None:
        self.params = p = ScaffoldParams(control=control)
        check_fields(p, "algo.")
        if p.control not in CONTROLS:
            raise bad_value("algo.control", p.control, f"allowed: {', '.join(CONTROLS)} (SCAFFOLD Algorithm 1)")
        self.c = torch.zeros(0)  # the server control variate, flat (made in on_attach)
        self.total = 1.0  # sum_j p_j over all training clients

    @override
    def on_attach(self, fed: FederationView) -> None:
        like = fed.params[0]
        self.c = torch.zeros(numel(fed.params), dtype=like.dtype, device=like.device)
        self.total = total_weight(fed)
        fed.register_stat(_DC, torch.zeros_like(self.c))

    # ------------------------------------------------------------------ client
    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        ci = client.state.get(_CI)
        ci = torch.zeros_like(self.c) if ci is None else ci.to(self.c.dtype)
        corr = self.c - ci
        client.extras[_K] = (ci, corr, flat_views(corr, fed.params))

    @override
    @torch.no_grad()
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        torch._foreach_add_(grads_of(fed.params), client.extras[_K][2])  # g_i(y) - c_i + c

    @override
    @torch.no_grad()
    def on_cohort_grad(self, fed: FederationView, cohort: Cohort) -> None:
        grads = cohort.grads or []  # (m, *p.shape) each
        for i, client in enumerate(cohort.clients):
            torch._foreach_add_([g[i] for g in grads], client.extras[_K][2])

    @override
    @torch.no_grad()
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        ci, corr, _ = client.extras.pop(_K)
        if self.params.control == "option1":
            ci_new = self._full_gradient(fed, fed.data.client_indices[client.cid])
        else:  # c_i - c + (x - y_i) / (K eta_l)
            steps = (flat(fed.global_params) - flat(fed.params)) / (client.num_steps * fed.cfg.lr)
            ci_new = steps - corr
        weight = client.round.weights[client.cid] / self.total  # p_i / sum_j p_j, once per client
        delta = fed.stat(_DC)
        assert isinstance(delta, Tensor)  # registered as one tensor
        delta += weight * (ci_new - ci)
        client.state[_CI] = ci_new

    def _full_gradient(self, fed: FederationView, rows: Tensor) -> Tensor:
        """Option I's :math:`g_i(x)`: the gradient of the mean loss over ``rows`` at the server model, flat."""
        out = torch.zeros_like(self.c)
        with torch.enable_grad():  # on_client_end runs without grad
            for chunk in rows.split(CHUNK):
                out += flat(fed.grad_at(fed.global_params, chunk)) * (len(chunk) / len(rows))
        return out

    # ------------------------------------------------------------------ server
    @override
    def on_round_end(self, fed: FederationView, rnd: Round) -> None:
        delta = fed.stat(_DC)
        assert isinstance(delta, Tensor)  # registered as one tensor
        self.c += delta.to(self.c.dtype)  # c + sum_{i in S} p_i / sum_j p_j Delta c_i

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"c": self.c.clone()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.c = state_dict["c"].to(self.c.device, self.c.dtype).clone()
