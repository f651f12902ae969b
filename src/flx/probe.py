"""The task loss of the net on store rows, at any parameters, outside the local steps: what parts differentiate and
evaluate (``fed.grad_at``, ``fed.value_and_grad_at``, ``fed.hvp``, ``fed.eval_loss``, ``fed.batch``).

None of these touch the training state: BatchNorm statistics, the net's values and mode, and the training step's RNG
stream are as they were (:mod:`flx.autodiff`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from flx import autodiff
from flx.context import ClientData


class LossProbe:
    """The loss ``loss_fn`` of ``net`` (trainable parameters ``params``) on rows of the client store ``data``, inside
    ``step_context``."""

    def __init__(
        self,
        net: nn.Module,
        params: list[Tensor],
        data: ClientData,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        step_context: Callable[[], AbstractContextManager],
    ) -> None:
        self.net, self.params, self.data, self.loss_fn, self.step_context = net, params, data, loss_fn, step_context
        # where row indices into the store live: the store's device, or the host for a store kept there (HostRows)
        self.index_device: torch.device = getattr(data.x, "index_device", data.x.device)

    def batch(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``(x, y)`` of ``rows`` of the tensor store (rows held on the host, e.g. the server's, are copied to the
        store's device first; the clients' rows are there already)."""
        rows = rows.to(self.index_device)
        return self.data.x[rows], self.data.y[rows]

    def grad_at(self, params: Sequence[Tensor], rows: Tensor, create_graph: bool = False) -> list[Tensor]:
        """``grad f(params; rows)`` of ``loss_fn`` for the net's trainable parameters at ``params`` (not the net's
        values) (:func:`flx.autodiff.grad_at`)."""
        with self.step_context():
            return autodiff.grad_at(self.net, params, self.batch(rows), self.loss_fn, create_graph=create_graph)

    def value_and_grad_at(self, params: Sequence[Tensor], rows: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The loss (detached) and :meth:`grad_at` of ``rows`` at ``params``, from one forward and backward pass."""
        with self.step_context():
            return autodiff.value_and_grad_at(self.net, params, self.batch(rows), self.loss_fn)

    def hvp(
        self, v: Sequence[Tensor], rows: Tensor, mode: str = "exact", params: Sequence[Tensor] | None = None, **kw: Any
    ) -> list[Tensor]:
        """``H(params) v`` of ``loss_fn`` on ``rows`` (``params`` default: the net's current values); ``mode``:
        ``exact`` (double backward), ``fd`` (finite differences of gradients) or ``none`` (zeros)
        (:func:`flx.autodiff.hvp`)."""
        at = [p.detach() for p in self.params] if params is None else list(params)
        with self.step_context():
            return autodiff.hvp(self.net, at, list(v), self.batch(rows), self.loss_fn, mode=mode, **kw)

    def eval_loss(self, rows: Tensor, chunk: int = 4096) -> float:
        """Mean ``loss_fn`` of the net's current model over ``rows`` of the store, outside training.

        The net runs in eval mode (no dropout, no BatchNorm statistics update) inside the step context and is put
        back in its previous mode; no random number is drawn. ``loss_fn`` must return a batch mean.
        """
        return float(self.eval_loss_tensor(rows, chunk))

    @torch.no_grad()
    def eval_loss_tensor(self, rows: Tensor, chunk: int = 4096) -> Tensor:
        """:meth:`eval_loss` as a float64 scalar on the net's device (no host sync: for use inside local steps)."""
        was_training = self.net.training
        rows = rows.to(self.index_device)
        self.net.eval()
        try:
            with self.step_context():
                total = sum(
                    self.loss_fn(self.net(self.data.x[r]), self.data.y[r]).double() * len(r) for r in rows.split(chunk)
                )
        finally:
            self.net.train(was_training)
        return total / len(rows)
