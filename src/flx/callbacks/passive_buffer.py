"""Passive-buffer merging for federated X-risk optimisation (FeDXL1 / FeDXL2).

Guo, Jin, Luo, Yang, "FeDXL: Provable Federated Learning for Deep X-Risk Optimization", ICML 2023,
Algorithms 1-2 (digest ``shared/papers/fedxl.md`` §2). Each local step pairs ACTIVE scores of the client's
own positives ``a = h(w; Z_1)`` and negatives ``b = h(w; Z_2)`` with PASSIVE scores that all clients
computed during the previous round(s), merged by the server:

.. math::
    G_1 = \\nabla f(u_s)\\,\\nabla_1 \\ell(a_s, h^{r-1}_{2,\\xi})\\,\\nabla a_s, \\qquad
    G_2 = \\nabla f(u^{r-1}_\\zeta)\\,\\nabla_2 \\ell(h^{r-1}_{1,\\zeta}, b_t)\\,\\nabla b_t \\quad (\\text{Eqs. 12-13})

    u_s \\leftarrow (1-\\gamma) u_s + \\gamma\\,\\ell(a_s, h^{r-1}_{2,\\xi}) \\quad (\\text{Eq. 11}), \\qquad
    m \\leftarrow (1-\\beta) m + \\beta (G_1 + G_2) \\quad (\\text{Alg. 2 line 17})

FeDXL1 is ``compositional=False`` (``f`` linear, ``nabla f = 1``, no ``u``) with ``beta=1`` (plain SGD).
Choices the paper leaves open (digest §5), each a parameter: passive partners per step ``p1``/``p2``
(default ``B1``/``B2`` and pairing every active score with every partner, as the authors' code), drawn
with or without ``replacement`` (code: with; paper: "take next"), pool ``depth`` in rounds (paper 1,
code 2), ``u0`` (1, as the code: ``f = lam log`` needs ``u > 0``), the score ``h = sigmoid(logit_1 - logit_0)``
(``score="sigmoid"``, as the code; ``"logit"`` keeps the raw margin, unbounded, so exp-type losses can overflow).
``H^0`` (Alg. 1-2 line 2) is every training sample's score under ``w^0``; later pools hold exactly the
scores and post-update ``u`` values recorded during the round's steps, merged in client-id order.
The momentum ``m`` starts each round at the server mean of the clients' last momenta (``0`` in round 1).

``pairs="local"`` is the paper's Local Pair baseline (digest §2.4): the same objective on the pairs of each
step's own minibatch, gradient through both sides, ``u`` from local pairs, no score pools; its momentum is
averaged like FeDXL2's (the paper does not say; the authors' code keeps it local). With one client holding all
the data (``partition.num_clients=1``) it is the Centralized reference (SOX for the compositional loss).
Partial participation (Appendix F) is ``algo.clients_per_round < N``: pools and the momentum mean come from
the round's participants, other clients' ``u`` tables stay frozen in the store.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.aggregation import WeightedMean, flat_views
from flx.callbacks.base import FederatedCallback
from flx.errors import ConfigError, bad_value
from flx.losses import xrisk

if TYPE_CHECKING:
    from flx.federation import ClientContext, Federation, FederationConfig, RoundContext

LOSSES = {"psm": xrisk.psm, "squared_hinge": xrisk.squared_hinge, "kl_opauc": xrisk.kl_opauc_inner}


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
    replacement: bool = True
    u0: float = 1.0
    score: str = "sigmoid"
    pairs: str = "passive"


class PassiveBuffer(FederatedCallback):
    """FeDXL's active-passive local objective and the server's merging of score pools.

    Symbols: ``gamma`` (u rate), ``beta`` (momentum rate), ``lam`` (KL-OPAUC temperature), ``margin``.
    """

    def __init__(self, **params: Any) -> None:
        self.params = p = PassiveBufferParams(**params)
        if p.pairs not in ("passive", "local"):
            raise bad_value("algo.pairs", p.pairs, "allowed: passive (FeDXL), local (the Local Pair baseline)")
        if p.score not in ("sigmoid", "logit"):
            raise bad_value("algo.score", p.score, "allowed: sigmoid, logit")
        if p.loss not in LOSSES:
            raise bad_value("algo.loss", p.loss, f"allowed: {', '.join(LOSSES)}")
        for key in ("b1", "b2", "depth"):
            if getattr(p, key) < 1:
                raise bad_value(f"algo.{key}", getattr(p, key), "must be >= 1")
        if not (0 < p.gamma <= 1 and 0 < p.beta <= 1 and p.lam > 0 and p.u0 > 0):
            raise bad_value(
                "algo.gamma/beta/lam/u0", (p.gamma, p.beta, p.lam, p.u0), "gamma, beta in (0, 1]; lam, u0 > 0"
            )
        kw = {"margin": p.margin} | ({"lam": p.lam} if p.loss == "kl_opauc" else {})
        self.ell = functools.partial(LOSSES[p.loss], **({} if p.loss == "psm" else kw))
        self.f_prime = functools.partial(xrisk.kl_opauc_outer_prime, lam=p.lam)
        self.pools: list[dict[str, Tensor]] = []  # oldest first; keys pos, u, neg
        self.gbar: Tensor | None = None

    @override
    def check_setup(self, datamodule: Any, cfg: FederationConfig) -> None:
        y = datamodule.data.y_train
        xrisk.check_binary_labels(y, "FeDXL (algo=fedxl1|fedxl2|fedxl_localpair)")
        for cid, rows in enumerate(datamodule.client_train):
            positives = int((y[rows] == 1).sum())
            if positives in (0, len(rows)):
                has = "no positives" if positives == 0 else "no negatives"
                raise ConfigError(
                    f"partition: FeDXL needs positives and negatives on every client; client {cid} has {has} "
                    "(use partition=stratified or iid, or fewer clients)"
                )

    # ------------------------------------------------------------------ server
    @override
    def on_round_start(self, fed: Federation, rnd: RoundContext) -> None:
        if not self.pools and self.params.pairs == "passive":
            self.pools = [self._initial_pool(fed)]
        self._merged = (
            {k: torch.cat([pool[k] for pool in self.pools]) for k in ("pos", "u", "neg")} if self.pools else {}
        )
        self._records: dict[int, dict[str, Tensor]] = {}
        self._momentum = WeightedMean([torch.zeros(self._numel(fed), dtype=fed.params[0].dtype)])

    @torch.no_grad()
    def _initial_pool(self, fed: Federation) -> dict[str, Tensor]:
        """``H^0``: scores of every training sample under ``w^0`` (identical on every rank, no collective)."""
        rows = torch.cat(list(fed.data.client_indices))
        scores = torch.cat([self.score(fed.net(fed.data.x[r])) for r in rows.split(4096)]).cpu()
        pos = fed.data.y[rows].cpu() == 1
        return {"pos": scores[pos], "u": torch.full((int(pos.sum()),), self.params.u0), "neg": scores[~pos]}

    @override
    def on_server_step(self, fed: Federation, rnd: RoundContext, mean: list[Tensor]) -> None:
        if self.params.pairs == "passive":
            everyone = fed.gather(self._records) if fed.world_size > 1 and fed.gather else [self._records]
            records = {cid: rec for part in everyone for cid, rec in part.items()}
            merged = {k: torch.cat([records[c][k] for c in sorted(records)]) for k in ("pos", "u", "neg")}
            self.pools = (self.pools + [merged])[-self.params.depth :]
        if self.params.compositional:
            self._momentum.sync(fed.reduce_sum if fed.world_size > 1 else None)
            self.gbar = self._momentum.compute()[0].clone()

    # ------------------------------------------------------------------ client
    def score(self, outputs: Tensor) -> Tensor:
        """``h(w; z)``: the positive-class logit margin (one output: itself), squashed by a sigmoid by default."""
        return xrisk.binary_score(outputs, self.params.score)

    @staticmethod
    def _numel(fed: Federation) -> int:
        return sum(p.numel() for p in fed.params)

    @override
    def on_client_start(self, fed: Federation, client: ClientContext) -> None:
        rows = fed.data.client_indices[client.cid]
        is_pos = fed.data.y[rows].cpu() == 1
        if not bool(is_pos.any()) or bool(is_pos.all()):
            raise RuntimeError(f"FeDXL: client {client.cid} needs both positives and negatives")
        u = client.state.get("u", torch.full((int(is_pos.sum()),), self.params.u0, dtype=torch.float64))
        m = self.gbar.clone() if self.gbar is not None else torch.zeros(self._numel(fed), dtype=fed.params[0].dtype)
        client.extras["fedxl"] = {
            "pos": rows[is_pos],
            "neg": rows[~is_pos],
            "u": u.cpu().double(),
            "m": m,
            "rec": {"pos": [], "u": [], "neg": []},
            "order": self._passive_order(client),
        }

    def _passive_order(self, client: ClientContext) -> dict[str, Tensor] | None:
        """Without replacement: one permutation per client and round, shared by the S_1 scores and their u."""
        if self.params.replacement or self.params.pairs == "local":
            return None
        g = client.generator
        return {
            "pos": torch.randperm(len(self._merged["pos"]), generator=g),
            "neg": torch.randperm(len(self._merged["neg"]), generator=g),
        }

    def _draw(self, n: int, count: int, client: ClientContext, key: str) -> Tensor:
        order = client.extras["fedxl"]["order"]
        if order is None:
            return torch.randint(n, (count,), generator=client.generator)
        k = client.step * count
        return order[key][torch.arange(k, k + count) % n]

    @staticmethod
    def _pick(rows: Tensor, count: int, gen: torch.Generator) -> Tensor:
        if len(rows) >= count:
            return torch.randperm(len(rows), generator=gen)[:count]
        return torch.randint(len(rows), (count,), generator=gen)

    @override
    def sample_batch(self, fed: Federation, client: ClientContext) -> Tensor:
        s = client.extras["fedxl"]
        s["ipos"] = self._pick(s["pos"], self.params.b1, client.generator)
        return torch.cat([s["pos"][s["ipos"]], s["neg"][self._pick(s["neg"], self.params.b2, client.generator)]])

    @override
    def local_loss(self, fed: Federation, client: ClientContext, loss: Tensor) -> Tensor:
        p, s, pool = self.params, client.extras["fedxl"], self._merged
        h = self.score(client.outputs)
        a, b = h[: p.b1], h[p.b1 :]
        if p.pairs == "local":
            return self._local_pairs(a, b, s)
        jn = self._draw(len(pool["neg"]), p.p2 or p.b2, client, "neg")
        jp = self._draw(len(pool["pos"]), p.p1 or p.b1, client, "pos")
        hn, hp, up = (pool["neg"][jn].to(h), pool["pos"][jp].to(h), pool["u"][jp].to(h))
        if p.compositional:
            u = xrisk.update_u(s["u"][s["ipos"]].to(h), a, hn, self.ell, p.gamma)
            s["u"][s["ipos"]] = u.cpu().double()
            surrogate = xrisk.compositional_surrogate(a, b, hn, hp, u, up, self.ell, self.f_prime)
        else:
            u = torch.ones_like(a)
            surrogate = xrisk.linear_surrogate(a, b, hn, hp, self.ell)
        for key, value in (("pos", a), ("u", u), ("neg", b)):
            s["rec"][key].append(value.detach().cpu())
        return surrogate

    def _local_pairs(self, a: Tensor, b: Tensor, s: dict[str, Any]) -> Tensor:
        """Local Pair baseline: partners are the step's own minibatch of the other class, gradient through both.

        (1/B1) sum_s sg[f'(u_s)] (1/B2) sum_t ell(a_s, b_t), with u_s updated from the local pairs (Eq. 11).
        """
        weight = torch.ones_like(a)
        if self.params.compositional:
            u = xrisk.update_u(s["u"][s["ipos"]].to(a), a, b, self.ell, self.params.gamma)
            s["u"][s["ipos"]] = u.cpu().double()
            weight = self.f_prime(u)
        return (weight.detach() * self.ell(a[:, None], b[None, :]).mean(dim=1)).mean()

    @override
    @torch.no_grad()
    def on_local_grad(self, fed: Federation, client: ClientContext) -> None:
        if self.params.beta == 1.0:
            return
        s, grads = client.extras["fedxl"], [p.grad for p in fed.params]
        m = s.setdefault("m_views", flat_views(s["m"], grads))  # per parameter tensor, no flattening per step
        torch._foreach_mul_(m, 1 - self.params.beta)
        torch._foreach_add_(m, grads, alpha=self.params.beta)  # m = (1-beta) m + beta g
        torch._foreach_copy_(grads, m)  # the SGD step then moves w by -eta m

    @override
    def on_client_end(self, fed: Federation, client: ClientContext) -> None:
        s = client.extras.pop("fedxl")
        if s["rec"]["pos"]:
            self._records[client.cid] = {k: torch.cat(v).double() for k, v in s["rec"].items()}
        if self.params.compositional:
            client.state["u"] = s["u"]
            self._momentum.update([s["m"]], 1.0)

    # ------------------------------------------------------------------ checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"pools": self.pools, "gbar": self.gbar}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pools, self.gbar = state_dict["pools"], state_dict["gbar"]
