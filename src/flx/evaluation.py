"""Per-client evaluation: each client's personalised model on its own rows, and the global model on many clients' rows.

``personalized(fed, cid)`` turns the one reused net into client ``cid``'s personalised model for the length of a
``with`` block (pFedFBE's ``theta_i(w)``, AugFL's one-step adaptation) and restores the global model exactly;
``evaluate_clients`` measures every client that way, the clients spread over the ranks, with one sum.
``global_sums`` measures the global model on many clients at once: the clients' rows are batched together and a row
that several clients share is forwarded once (clients that no part personalises; ``client_losses``, every client's
training loss: :mod:`flx.parts.robustness.client_loss`, DRFA-GA's dual ascent), instead of one forward pass per client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flx.datamodules.client_eval import ClientRows

if TYPE_CHECKING:
    from flx.context import FederationView

BATCH_ROWS = 4096  # rows a forward pass of the global model takes at most (the global evaluation's chunk)


@contextmanager
def personalized(fed: FederationView, cid: int) -> Iterator[bool]:
    """Inside the block the net is client ``cid``'s personalised model (the parts' ``personalize`` contexts, in part
    order; the global model when no part personalises). On exit the net's parameters and float buffers are restored
    exactly and the global RNG stream is as it was. Gradients are enabled inside, even under Lightning's inference
    mode, so a part may take local steps. The block gets whether some part personalised (False: the global model)."""
    saved = [t.detach().clone() for t in fed.local_state]
    dev = fed.params[0].device
    try:
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []))
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            own = False
            for part in fed.parts_with("personalize"):
                ctx = part.personalize(fed, cid)
                if ctx is not None:
                    stack.enter_context(ctx)
                    own = True
            yield own
    finally:
        with torch.no_grad():
            for t, s in zip(fed.local_state, saved):
                t.copy_(s)


def evaluate_clients(
    fed: FederationView, data: ClientRows, metric: Callable[[Tensor, Tensor], Tensor], batch_rows: int = BATCH_ROWS
) -> Tensor:
    """``metric`` (a batch mean) of each client's personalised model (:func:`personalized`) on its own rows.

    ``data[cid]`` is client ``cid``'s ``(x, y)`` (rows ``data.rows[cid]`` of ``data.x``, ``data.y``). Client ``cid``
    is evaluated on rank ``cid % world_size``, in eval mode; the clients whose model is the global one (no part
    personalised them) are evaluated together (:func:`global_sums`). One all-reduce sums the per-client values.
    Returns one value per client (NaN: no rows), on the CPU.
    """
    # plain floats per client: the personalised block leaves Lightning's inference mode, where a tensor made outside
    # it could not be written
    sums = [[0.0, 0.0] for _ in range(len(data))]
    shared = []  # this rank's clients evaluated with the global model
    was_training = fed.net.training
    for cid in range(fed.rank, len(data), fed.world_size):
        if len(data.rows[cid]) == 0:
            continue
        with personalized(fed, cid) as own:
            if not own:
                shared.append(cid)
                continue
            rows = data.rows[cid].to(getattr(data.x, "index_device", data.x.device))  # they may live on the host
            fed.net.eval()
            with torch.no_grad(), fed.step_context():
                sums[cid] = [float(metric(fed.net(data.x[rows]), data.y[rows])) * len(rows), float(len(rows))]
            fed.net.train(was_training)
    for cid, total in global_sums(fed, data.x, data.y, data.rows, shared, metric, batch_rows).items():
        sums[cid] = [total, float(len(data.rows[cid]))]
    out = torch.tensor(sums, dtype=torch.float64, device=fed.params[0].device)
    fed.all_reduce_(out)
    return torch.where(out[:, 1] > 0, out[:, 0] / out[:, 1].clamp_min(1), torch.nan).cpu()


@torch.no_grad()
def global_sums(
    fed: FederationView,
    x: Tensor,
    y: Tensor,
    rows: Sequence[Tensor],
    clients: Iterable[int],
    fn: Callable[[Tensor, Tensor], Tensor],
    batch_rows: int = BATCH_ROWS,
) -> dict[int, float]:
    """``n_c fn(net(x[rows[c]]), y[rows[c]])`` for each of ``clients`` (``n_c``: its rows), ``fn`` a batch mean, of
    the net's current model in eval mode under the step context; put back in its mode after.

    The clients go in groups whose distinct rows number at most ``batch_rows``; a group is one forward pass over its
    distinct rows, so a row that several clients hold is forwarded once. A client with more rows is evaluated alone,
    in chunks of ``batch_rows`` (its value is then the row-weighted sum of the chunks'). Float64 sums, kept on the
    net's device until the end: one device-to-host copy for all ``clients``, not one per client.
    """
    out: dict[int, Tensor] = {}
    was_training = fed.net.training
    dev = getattr(x, "index_device", x.device)  # where row indices into x live (flx.datamodules.placement)
    fed.net.eval()
    try:
        with fed.step_context():
            for group, union in _groups(rows, clients, batch_rows):
                if len(union) > batch_rows:  # one client
                    chunks = rows[group[0]].to(dev).split(batch_rows)
                    out[group[0]] = sum(fn(fed.net(x[r]), y[r]).double() * len(r) for r in chunks)
                    continue
                outputs = fed.net(x[union.to(dev)])
                for cid in group:
                    r = rows[cid]
                    at = torch.searchsorted(union, r).to(outputs.device)
                    out[cid] = fn(outputs[at], y[r.to(dev)]).double() * len(r)
    finally:
        fed.net.train(was_training)
    values = torch.stack(list(out.values())).cpu().tolist() if out else []
    return dict(zip(out, values))


def client_losses(fed: FederationView, clients: Iterable[int]) -> dict[int, float]:
    """:math:`f_i`: the mean ``loss_fn`` of the net's current model over client ``i``'s training rows, for each of
    ``clients`` that has rows, batched across them (:func:`global_sums`)."""
    rows = fed.data.client_indices
    sums = global_sums(fed, fed.data.x, fed.data.y, rows, clients, fed.loss_fn)
    return {cid: total / len(rows[cid]) for cid, total in sums.items()}


def _groups(rows: Sequence[Tensor], clients: Iterable[int], batch_rows: int) -> Iterator[tuple[list[int], Tensor]]:
    """``clients`` with rows, in order, as ``(group, its distinct rows ascending)``: each group's distinct rows at most
    ``batch_rows``, or one client."""
    group: list[int] = []
    union: Tensor | None = None  # on the rows' device
    for cid in clients:
        r = rows[cid]
        if len(r) == 0:
            continue
        grown = r.unique() if union is None else torch.cat([union, r]).unique()
        if group and len(grown) > batch_rows:
            yield group, union
            group, grown = [], r.unique()
        group.append(cid)
        union = grown
    if group:
        yield group, union
