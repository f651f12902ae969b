"""FeDXL's passive pools before the first round, and the draws from a client's rows and from the pools.

Guo et al., "FeDXL: Provable Federated Learning for Deep X-Risk Optimization", ICML 2023 (Algorithms 1-2, line 2:
the round-1 pools ``H^0``, ``U^0``). :class:`flx.parts.xrisk.passive_buffer.PassiveBuffer` merges and uses the pools;
this module makes the first ones and holds the draws both use (docs/fedxl.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flx.sampling import derive_seed

if TYPE_CHECKING:
    from flx.context import FederationView

H0_TAG = 0x4830  # the (seed, 0, client, tag) stream of the round-1 pools' minibatches and noise


@torch.no_grad()
def initial_pool(fed: FederationView, score: Callable[[Tensor], Tensor], u0: float) -> dict[str, Tensor]:
    """``H^0``: scores of every training sample under ``w^0`` (identical on every rank, no collective)."""
    rows = torch.cat(list(fed.data.client_indices[: fed.num_clients]))  # the training clients
    scores = torch.cat([score(fed.net(fed.data.x[r])) for r in rows.split(4096)]).cpu()
    pos = fed.data.y[rows].cpu() == 1
    return {"pos": scores[pos], "u": torch.full((int(pos.sum()),), u0), "neg": scores[~pos]}


@torch.no_grad()
def minibatch_pool(
    fed: FederationView, score: Callable[[Tensor], Tensor], p: Any, noise: Sequence[Any]
) -> dict[str, Tensor]:
    """``H^0``, ``U^0``: each client scores ``K`` minibatches of ``p.b1`` positives and ``p.b2`` negatives under
    ``w^0`` as in its local steps, no update.

    Minibatches come from :func:`pick` and the inputs go through the input noise of the run's ``ClientNoise`` parts
    (``noise``: their ``register_input_hook``), all drawn from a ``(seed, 0, client)`` stream, in train mode as the
    local steps; every rank computes the same pools. The net's buffers may move (BatchNorm statistics), but clients
    load the round's snapshot and the server step overwrites them.
    """
    gen, was_training = torch.Generator(), fed.net.training
    dev = fed.params[0].device
    scores: dict[str, list[Tensor]] = {"pos": [], "neg": []}
    fed.net.train()
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):  # dropout off the global stream
        for cid, rows in enumerate(fed.data.client_indices[: fed.num_clients]):
            seed = derive_seed(fed.cfg.seed, 0, cid, H0_TAG)
            gen.manual_seed(seed)
            torch.manual_seed(seed)
            handles = [q.register_input_hook(fed.net, cid, gen) for q in noise]
            pos, neg = split(fed, rows)
            for _ in range(fed.client_steps(cid)):
                at = [pick(pos, p.b1, gen).to(pos.device), pick(neg, p.b2, gen).to(neg.device)]
                batch = torch.cat([pos[at[0]], neg[at[1]]])
                h = score(fed.net(fed.data.x[batch])).double()  # (B1 + B2,), to the host once, below
                scores["pos"].append(h[: p.b1])
                scores["neg"].append(h[p.b1 :])
            for handle in handles:
                handle.remove()
    fed.net.train(was_training)
    pos = torch.cat(scores["pos"]).cpu()
    return {"pos": pos, "u": torch.full_like(pos, p.u0), "neg": torch.cat(scores["neg"]).cpu()}


def split(fed: FederationView, rows: Tensor) -> tuple[Tensor, Tensor]:
    """A client's rows: its positives, its negatives."""
    is_pos = (fed.data.y[rows] == 1).to(rows.device)  # a no-op unless the store is kept on the host
    return rows[is_pos], rows[~is_pos]


def shuffled(n: int, total: int, g: torch.Generator) -> Tensor:
    """Draws "taken next" from a shuffled pool of ``n``: permutations one after another (fresh when used up)."""
    return torch.cat([torch.randperm(n, generator=g) for _ in range(-(-total // n))])[:total]


def pick(rows: Tensor, count: int, gen: torch.Generator) -> Tensor:
    """``count`` positions into ``rows``, drawn on the host from ``gen`` (and kept there: the u table's update groups
    them without a device sync, :func:`flx.losses.xrisk.update_u_table`)."""
    if len(rows) >= count:
        return torch.randperm(len(rows), generator=gen)[:count]
    return torch.randint(len(rows), (count,), generator=gen)
