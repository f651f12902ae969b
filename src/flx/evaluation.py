"""Personalised evaluation: each client's own model, made by the parts' ``personalize`` hooks, on its own rows.

``personalized(fed, cid)`` turns the one reused net into client ``cid``'s personalised model for the length of a
``with`` block (pFedFBE's ``theta_i(w)``, AugFL's one-step adaptation) and restores the global model exactly;
``evaluate_clients`` measures every client that way, the clients spread over the ranks, with one sum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flx.federation import Federation


@contextmanager
def personalized(fed: Federation, cid: int) -> Iterator[None]:
    """Inside the block the net is client ``cid``'s personalised model (the parts' ``personalize`` contexts, in part
    order; the global model when no part personalises). On exit the net's parameters and float buffers are restored
    exactly and the global RNG stream is as it was. Gradients are enabled inside, even under Lightning's inference
    mode, so a part may take local steps."""
    saved = [t.detach().clone() for t in fed.local_state]
    dev = fed.params[0].device
    try:
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []))
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.enable_grad())
            for part in fed.parts_with("personalize"):
                ctx = part.personalize(fed, cid)
                if ctx is not None:
                    stack.enter_context(ctx)
            yield
    finally:
        with torch.no_grad():
            for t, s in zip(fed.local_state, saved):
                t.copy_(s)


def evaluate_clients(
    fed: Federation, data: Sequence[tuple[Tensor, Tensor]], metric: Callable[[Tensor, Tensor], Tensor]
) -> Tensor:
    """``metric`` (a batch mean) of each client's personalised model (:func:`personalized`) on its own rows.

    ``data[cid]`` is client ``cid``'s ``(x, y)``. Client ``cid`` is evaluated on rank ``cid % world_size``, in eval
    mode; one all-reduce sums the per-client values. Returns one value per client (NaN: no rows), on the CPU.
    """
    # plain floats per client: the personalised block leaves Lightning's inference mode, where a tensor made outside
    # it could not be written
    rows = [[0.0, 0.0] for _ in data]
    was_training = fed.net.training
    for cid in range(fed.rank, len(data), fed.world_size):
        x, y = data[cid]
        if len(y) == 0:
            continue
        with personalized(fed, cid):
            fed.net.eval()
            with torch.no_grad(), fed.step_context():
                rows[cid] = [float(metric(fed.net(x), y)) * len(y), float(len(y))]
            fed.net.train(was_training)
    out = torch.tensor(rows, dtype=torch.float64, device=fed.params[0].device)
    if fed.world_size > 1 and fed.reduce_sum is not None:
        out = fed.reduce_sum(out)
    return torch.where(out[:, 1] > 0, out[:, 0] / out[:, 1].clamp_min(1), torch.nan).cpu()
