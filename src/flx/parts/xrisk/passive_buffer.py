"""Passive-buffer merging for federated X-risk optimisation (FeDXL1 / FeDXL2).

Guo, Jin, Luo, Yang, "FeDXL: Provable Federated Learning for Deep X-Risk Optimization", ICML 2023,
Algorithms 1-2. Each local step pairs ACTIVE scores of the client's
own positives ``a = h(w; Z_1)`` and negatives ``b = h(w; Z_2)`` with PASSIVE scores that all clients
computed during the previous round(s), merged by the server:

.. math::
    G_1 = \\nabla f(u_s)\\,\\nabla_1 \\ell(a_s, h^{r-1}_{2,\\xi})\\,\\nabla a_s, \\qquad
    G_2 = \\nabla f(u^{r-1}_\\zeta)\\,\\nabla_2 \\ell(h^{r-1}_{1,\\zeta}, b_t)\\,\\nabla b_t \\quad (\\text{Eqs. 12-13})

    u_s \\leftarrow (1-\\gamma) u_s + \\gamma\\,\\ell(a_s, h^{r-1}_{2,\\xi}) \\quad (\\text{Eq. 11}), \\qquad
    m \\leftarrow (1-\\beta) m + \\beta (G_1 + G_2) \\quad (\\text{Alg. 2 line 17})

FeDXL1 is ``compositional=False`` (``f`` linear, ``nabla f = 1``, no ``u``) with ``beta=1`` (plain SGD).
Choices the paper leaves open, each a parameter: passive partners per step ``p1``/``p2``
(default ``B1``/``B2`` and pairing every active score with every partner, as the authors' code), drawn
without ``replacement`` (default: "take next" from a per-client shuffle of the pool, reshuffled when used up, as the
paper) or with it (the code), pool ``depth`` in rounds (paper 1, code 2), ``u0`` (1, as the code:
``f = lam log`` needs ``u > 0``), the score ``h = sigmoid(z)`` with ``z`` the binary margin of
:mod:`flx.models.heads` (``score="sigmoid"``, as the code; ``"logit"`` keeps ``z``, unbounded, so exp-type losses
can overflow). ``H^0`` and ``U^0`` (Alg. 1-2 line 2, ``init_pools``): by default every client scores ``K``
minibatches of ``B1`` positives and ``B2`` negatives under ``w^0``, drawn and perturbed (the ``ClientNoise`` part)
as in its local steps, with no update (``"minibatch"``, the paper); ``"clean_pass"`` scores every training sample
once, without noise. Later pools hold exactly the scores and post-update ``u`` values recorded during the round's
steps, merged in client-id order. A positive drawn twice in one minibatch updates its ``u`` once, with the mean of
its estimates (:func:`flx.losses.xrisk.update_u_table`). With ``beta < 1`` the momentum ``m`` starts each round at
the server mean of the clients' last momenta (``0`` in round 1; ``momentum_sync="server"``, Alg. 2 line 5), or
each client keeps its own across rounds in the client state store (``"client"``).

``pairs="local"`` is the paper's Local Pair baseline (Sec. 4): the same objective on the pairs of each
step's own minibatch, gradient through both sides, ``u`` from local pairs, no score pools; its config keeps the
momentum per client (``momentum_sync=client``: the paper describes only model averaging; the authors' code keeps
momentum and ``u`` local). With one client holding all the data (``partition.num_clients=1``) it is the
Centralized reference (SOX for the compositional loss).
Partial participation (Appendix F) is ``algo.clients_per_round < N``: pools and the momentum mean come from
the round's participants, other clients' ``u`` tables stay frozen in the store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from typing_extensions import override

from flx.aggregation import flat_views, numel
from flx.errors import ConfigError, bad_value, check_fields
from flx.hooks import FederatedCallback
from flx.local_sgd import grads_of
from flx.losses import xrisk
from flx.models import heads
from flx.parts.xrisk import fedxl_pools
from flx.traits import Channel, PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView, Round
    from flx.hooks import Build
    from flx.parts.xrisk.client_noise import ClientNoise
    from flx.vectorized import Cohort

LOSSES: dict[str, Callable[..., Tensor]] = {
    "psm": xrisk.psm,
    "squared_hinge": xrisk.squared_hinge,
    "kl_opauc": xrisk.kl_opauc_inner,
}
CHOICES = {
    "pairs": ("passive", "local"),
    "score": ("sigmoid", "logit"),
    "init_pools": ("minibatch", "clean_pass"),
    "momentum_sync": ("server", "client"),
}
KEYS = ("pos", "u", "neg")  # a pool's entries: positive scores H_1, their u values U, negative scores H_2
# registered statistics: per-client pool slots (KEYS, then a presence flag per client), the momentum sum and count
_POOLS, _MOMENTUM = "fedxl/pools", "fedxl/momentum"


@dataclass(frozen=True)
class PassiveBufferParams:
    """``b1``/``b2`` active positives/negatives per step, ``p1``/``p2`` passive partners (None: = b1/b2)."""

    b1: int = 32
    b2: int = 32
    p1: int | None = None
    p2: int | None = None
    loss: str = "kl_opauc"
    compositional: bool = True
    lam: float = 1.0
    margin: float = 1.0
    gamma: float = 0.1
    beta: float = 0.1
    depth: int = 1
    replacement: bool = False
    u0: float = 1.0
    score: str = "sigmoid"
    pairs: str = "passive"
    init_pools: str = "minibatch"
    momentum_sync: str = "server"


class PassiveBuffer(FederatedCallback):
    """FeDXL's active-passive local objective and the server's merging of score pools.

    Symbols: ``gamma`` (u rate), ``beta`` (momentum rate), ``lam`` (KL-OPAUC temperature), ``margin``.
    """

    traits = PartTraits(
        uploads={
            _POOLS: Channel("the prediction scores of its rows (the passive buffers)"),
            _MOMENTUM: Channel("its mean local gradient (server-side momentum)"),
        },
        # algo.vectorize: sample_batch and local_loss run per client inside the stacked step (each client draws from
        # its own generator, in the sequential order), the momentum per client on the stacked gradients
        vectorizable=True,
        uses=("client_noise",),  # the clients' input noise, applied to the initial pools' scores too
        headline=("auroc", "pauc_0.3", "pauc_0.5"),  # the paper's Tables 2-3
    )

    def __init__(self, **params: Any) -> None:
        self.params = p = PassiveBufferParams(**params)
        keys = {k: f"algo.parts.passive_buffer.{k}" for k in ("compositional", "pairs")}  # set on the part itself
        check_fields(p, "algo.", keys)
        for key, allowed in CHOICES.items():
            if getattr(p, key) not in allowed:
                raise bad_value(keys.get(key, f"algo.{key}"), getattr(p, key), f"allowed: {', '.join(allowed)}")
        if p.loss not in LOSSES:
            raise bad_value("algo.loss", p.loss, f"allowed: {', '.join(LOSSES)}")
        for key in ("b1", "b2", "depth"):
            if getattr(p, key) < 1:
                raise bad_value(f"algo.{key}", getattr(p, key), "must be >= 1")
        for key, ok, rule in (
            ("gamma", 0 < p.gamma <= 1, "must be in (0, 1]"),
            ("beta", 0 < p.beta <= 1, "must be in (0, 1]"),
            ("lam", p.lam > 0, "must be > 0"),
            ("u0", p.u0 > 0, "must be > 0"),
        ):
            if not ok:
                raise bad_value(f"algo.{key}", getattr(p, key), rule)
        kw = {"margin": p.margin} | ({"lam": p.lam} if p.loss == "kl_opauc" else {})
        self.ell = functools.partial(LOSSES[p.loss], **({} if p.loss == "psm" else kw))
        self.f_prime = functools.partial(xrisk.kl_opauc_outer_prime, lam=p.lam)
        self.pools: list[dict[str, Tensor]] = []  # oldest first; keys pos, u, neg
        self.gbar: Tensor | None = None
        self.server_momentum = p.beta < 1 and p.momentum_sync == "server"
        self._merged: dict[str, Tensor] = {}  # the round's passive pools: the last `depth` pools, concatenated
        self._slots: dict[str, list[slice]] = {}  # per key, client cid's entries in the pools statistic

    @override
    def check(self, build: Build) -> None:
        y = build.clients.y  # the training split's labels
        xrisk.check_binary_labels(y, "FeDXL (algo=fedxl1|fedxl2|fedxl_localpair)")
        for cid in range(build.clients.num_train_clients):
            rows = build.clients.client_indices[cid]
            positives = int((y[rows] == 1).sum())
            if positives in (0, len(rows)):
                has = "no positives" if positives == 0 else "no negatives"
                raise ConfigError(
                    f"partition: FeDXL needs positives and negatives on every client; client {cid} has {has} "
                    "(use partition=stratified or iid, or fewer clients)"
                )

    @override
    def on_attach(self, fed: FederationView) -> None:
        """Declares the round's statistics, in the model's dtype (an fp32 model keeps an fp32 round buffer).

        Pools: client ``i`` records exactly ``K_i B1`` positive scores, as many ``u`` values and ``K_i B2`` negative
        scores, so each key has one fixed slot per client (client-id order) plus a presence flag per client; summing
        the ranks' slots is the client-id-order merge of the participants. The model's dtype is exact: the scores are
        computed in it, ``u`` is returned in it (:func:`flx.losses.xrisk.update_u_table`), and the passive partners
        are cast to it before use. Momentum: ``sum_i m_i`` and the count of clients.
        """
        dtype = fed.params[0].dtype
        if self.params.pairs == "passive":
            steps = [fed.client_steps(cid) for cid in range(fed.num_clients)]
            sizes = {"pos": self.params.b1, "u": self.params.b1, "neg": self.params.b2}
            likes = []
            for key in KEYS:
                ends = torch.tensor(steps).cumsum(0).mul(sizes[key]).tolist()
                self._slots[key] = [slice(a, b) for a, b in zip([0, *ends[:-1]], ends)]
                likes.append(torch.zeros(ends[-1], dtype=dtype))
            fed.register_stat(_POOLS, [*likes, torch.zeros(fed.num_clients, dtype=dtype)])
        if self.server_momentum:
            fed.register_stat(_MOMENTUM, [torch.zeros(numel(fed.params), dtype=dtype), torch.zeros(1, dtype=dtype)])

    # ------------------------------------------------------------------ server
    @override
    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        if not self.pools and self.params.pairs == "passive":
            if self.params.init_pools == "minibatch":
                noise = [cast("ClientNoise", q) for q in self.linked("client_noise")]
                self.pools = [fedxl_pools.minibatch_pool(fed, self.score, self.params, noise)]
            else:
                self.pools = [fedxl_pools.initial_pool(fed, self.score, self.params.u0)]
        self._merged = {k: torch.cat([pool[k] for pool in self.pools]) for k in KEYS} if self.pools else {}

    @override
    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        if self.params.pairs == "passive":
            *pools, present = fed.stat(_POOLS)
            counts = present.cpu().tolist()  # one copy to the host a round
            if max(counts) > 1:  # two local runs of one client (duplicates=repeat) would add up in one slot
                raise RuntimeError(f"FeDXL: a client recorded its scores {max(counts):g} times in round {rnd.round}")
            cids = [cid for cid, c in enumerate(counts) if c > 0]
            merged = {k: torch.cat([v[self._slots[k][c]] for c in cids]).double().cpu() for k, v in zip(KEYS, pools)}
            self.pools = (self.pools + [merged])[-self.params.depth :]
        if self.server_momentum:
            total, count = fed.stat(_MOMENTUM)
            self.gbar = (total / count[0]).to(fed.params[0].dtype)

    # ------------------------------------------------------------------ client
    def score(self, outputs: Tensor) -> Tensor:
        """``h(w; z)``: the binary margin ``z`` (:mod:`flx.models.heads`), squashed by a sigmoid by default."""
        return heads.binary_score(outputs, self.params.score)

    def _start_momentum(self, fed: FederationView, client: ClientContext) -> Tensor:
        """``m`` at the round's first step: the server mean ``G_bar``, or the client's own (``momentum_sync``)."""
        if self.params.momentum_sync == "client" and "m" in client.state:
            return client.state["m"].clone()
        if self.params.momentum_sync == "server" and self.gbar is not None:
            return self.gbar.clone()
        return torch.zeros(numel(fed.params), dtype=fed.params[0].dtype, device=fed.params[0].device)

    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        pos, neg = fedxl_pools.split(fed, fed.data.client_indices[client.cid])
        if not len(pos) or not len(neg):
            raise RuntimeError(f"FeDXL: client {client.cid} needs both positives and negatives")
        u = client.state.get("u", torch.full((len(pos),), self.params.u0, dtype=torch.float64))
        client.extras["fedxl"] = {
            "pos": pos,
            "neg": neg,
            "u": u.to(fed.params[0].device, torch.float64),  # the u table lives with the scores it is updated from
            "m": self._start_momentum(fed, client),
            "rec": {"pos": [], "u": [], "neg": []},
            "order": self._passive_order(client),
        }

    def _passive_order(self, client: ClientContext) -> dict[str, Tensor] | None:
        """Without replacement: the round's draws, per client, shared by the S_1 scores and their u."""
        p = self.params
        if p.replacement or p.pairs == "local":
            return None
        g, steps = client.generator, client.num_steps
        return {
            "pos": fedxl_pools.shuffled(len(self._merged["pos"]), steps * (p.p1 or p.b1), g),
            "neg": fedxl_pools.shuffled(len(self._merged["neg"]), steps * (p.p2 or p.b2), g),
        }

    def _draw(self, n: int, count: int, client: ClientContext, key: str) -> Tensor:
        order = client.extras["fedxl"]["order"]
        if order is None:
            return torch.randint(n, (count,), generator=client.generator)
        return order[key][client.step * count : (client.step + 1) * count]

    @override
    def sample_batch(self, fed: FederationView, client: ClientContext) -> Tensor:
        s = client.extras["fedxl"]
        s["ipos"] = fedxl_pools.pick(s["pos"], self.params.b1, client.generator)
        ineg = fedxl_pools.pick(s["neg"], self.params.b2, client.generator)
        return torch.cat([s["pos"][s["ipos"].to(s["pos"].device)], s["neg"][ineg.to(s["neg"].device)]])

    @override
    def local_loss(self, fed: FederationView, client: ClientContext, loss: Tensor) -> Tensor:
        p, s, pool = self.params, client.extras["fedxl"], self._merged
        assert client.outputs is not None  # set before local_loss
        h = self.score(client.outputs)
        a, b = h[: p.b1], h[p.b1 :]
        if p.pairs == "local":
            return self._local_pairs(a, b, s)
        jn = self._draw(len(pool["neg"]), p.p2 or p.b2, client, "neg")
        jp = self._draw(len(pool["pos"]), p.p1 or p.b1, client, "pos")
        hn, hp, up = (pool["neg"][jn].to(h), pool["pos"][jp].to(h), pool["u"][jp].to(h))
        if p.compositional:
            u = xrisk.update_u_table(s["u"], s["ipos"], a, hn, self.ell, p.gamma)
            surrogate = xrisk.compositional_surrogate(a, b, hn, hp, u, up, self.ell, self.f_prime)
        else:
            u = torch.ones_like(a)
            surrogate = xrisk.linear_surrogate(a, b, hn, hp, self.ell)
        for key, value in zip(KEYS, (a, u, b)):
            s["rec"][key].append(value.detach())
        return surrogate

    def _local_pairs(self, a: Tensor, b: Tensor, s: dict[str, Any]) -> Tensor:
        """Local Pair baseline: partners are the step's own minibatch of the other class, gradient through both.

        (1/B1) sum_s sg[f'(u_s)] (1/B2) sum_t ell(a_s, b_t), with u_s updated from the local pairs (Eq. 11).
        """
        weight = torch.ones_like(a)
        if self.params.compositional:
            u = xrisk.update_u_table(s["u"], s["ipos"], a, b, self.ell, self.params.gamma)
            weight = self.f_prime(u)
        return (weight.detach() * self.ell(a[:, None], b[None, :]).mean(dim=1)).mean()

    @override
    @torch.no_grad()
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        if self.params.beta == 1.0:
            return
        s, grads = client.extras["fedxl"], grads_of(fed.params)
        m = s.setdefault("m_views", flat_views(s["m"], grads))  # per parameter tensor, no flattening per step
        torch._foreach_mul_(m, 1 - self.params.beta)
        torch._foreach_add_(m, grads, alpha=self.params.beta)  # m = (1-beta) m + beta g
        torch._foreach_copy_(grads, m)  # the SGD step then moves w by -eta m

    @override
    @torch.no_grad()
    def on_cohort_grad(self, fed: FederationView, cohort: Cohort) -> None:
        if self.params.beta == 1.0:
            return
        assert cohort.grads is not None  # set for on_cohort_grad
        for i, client in enumerate(cohort.clients):  # each client's m, on its slice of the stacked gradients
            grads = [g[i] for g in cohort.grads]
            m = flat_views(client.extras["fedxl"]["m"], grads)
            torch._foreach_mul_(m, 1 - self.params.beta)
            torch._foreach_add_(m, grads, alpha=self.params.beta)
            torch._foreach_copy_(grads, m)

    @override
    @torch.no_grad()
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        s = client.extras.pop("fedxl")
        if s["rec"]["pos"]:  # committed here, so a dropped client records nothing
            *pools, present = fed.stat(_POOLS)
            for key, pool in zip(KEYS, pools):
                pool[self._slots[key][client.cid]] = torch.cat(s["rec"][key])
            present[client.cid] += 1
        if self.params.compositional:
            client.state["u"] = s["u"]
        if self.server_momentum:
            total, count = fed.stat(_MOMENTUM)
            total += s["m"]
            count += 1
        elif self.params.beta < 1 and self.params.momentum_sync == "client":
            client.state["m"] = s["m"]

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"pools": self.pools, "gbar": self.gbar}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pools, self.gbar = state_dict["pools"], state_dict["gbar"]
