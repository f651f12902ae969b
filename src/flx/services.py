"""What parts call on the federation besides the round itself: the clients' sizes and minibatch streams, the round's
statistics and collectives, losses and derivatives on store rows.

These are the rows of the table "Core helpers for parts" in docs/round_protocol.md that do not drive the round;
:class:`flx.federation.Federation`, the round engine, inherits them, and parts see both through
:class:`flx.context.FederationView`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from torch import Tensor, nn

from flx.aggregation import ReduceFn
from flx.context import ClientContext, ClientData, FederationConfig, Round
from flx.datamodules.ragged import Ragged
from flx.probe import LossProbe
from flx.round_buffer import RoundBuffer
from flx.sampling import MINIBATCH_STREAMS


class PartServices:
    """The helpers parts call (see the module docstring).

    Args:
        cfg: the federation's settings.
        net: the (single, reused) net.
        params: its trainable parameters.
        data: the client store on the net's device.
        loss_fn: the task's batch-mean loss.
        step_context: the precision context of the local steps.
        rank, world_size: this process and the number of processes.
        broadcast: the process group's broadcast of rank 0's object (only called when ``world_size > 1``).
    """

    rnd: Round | None
    reduce_sum: ReduceFn | None  # the process group's all-reduce (sum), set by the federation

    def __init__(
        self,
        cfg: FederationConfig,
        net: nn.Module,
        params: list[Tensor],
        data: ClientData,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        step_context: Callable[[], AbstractContextManager],
        rank: int,
        world_size: int,
        broadcast: Callable[[Any], Any] | None,
    ) -> None:
        self.cfg, self.net, self.data, self.loss_fn, self.step_context = cfg, net, data, loss_fn, step_context
        self.rank, self.world_size, self._broadcast = rank, world_size, broadcast
        indices = data.client_indices  # a client's row count without its view (a Ragged reads two offsets)
        self._rows_of: Callable[[int], int] = indices.size if isinstance(indices, Ragged) else lambda c: len(indices[c])
        has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())
        policy = cfg.single_row_batch
        self.min_rows = 2 if policy == "drop" or (policy == "auto" and has_bn) else 1
        self.probe = LossProbe(net, params, data, loss_fn, step_context)
        self.buffer = RoundBuffer()

    # ------------------------------------------------------------------ the clients
    @property
    def num_clients(self) -> int:
        """The clients that train (client ids ``0..num_clients-1``); held-out evaluation clients follow them."""
        return self.data.num_train_clients

    def num_samples(self, cid: int) -> int:
        return self._rows_of(cid)

    @property
    def cohort(self) -> tuple[int, ...]:
        """The distinct clients sampled in the current round, or in the last round trained (the one the global model
        now being evaluated comes from); sorted; ``()`` before this process's first round."""
        return self.rnd.cohort if self.rnd is not None else ()

    def client_steps(self, cid: int) -> int:
        """The local steps ``tau_i`` client ``cid`` takes in the current round (the last one trained between rounds):
        what a part set for it while the round was planned (:meth:`flx.context.Round.set_steps`), else
        ``algo.local_steps``, or ``local_epochs * ceil(n_i / B)`` under ``algo.local_epochs``."""
        rnd = self.rnd
        if rnd is not None and cid in rnd.steps:
            return rnd.steps[cid]
        if self.cfg.local_epochs is None:
            return self.cfg.local_steps
        return self.cfg.local_epochs * -(-self.num_samples(cid) // self.cfg.batch_size)

    def client_batches(self, client: ClientContext) -> Iterator[Tensor]:
        """The default minibatch stream of ``client``: its ``num_steps`` minibatches (row indices into the store),
        drawn from ``client.generator`` as ``algo.minibatch`` says (reshuffled passes over its rows, or a fresh draw of
        ``B`` rows per step; :data:`flx.sampling.MINIBATCH_STREAMS`). The one source of the local steps' rows: both
        client runners and the parts that replace the local steps."""
        stream = MINIBATCH_STREAMS[self.cfg.minibatch]
        idx = self.data.client_indices[client.cid]
        return stream(idx, self.cfg.batch_size, client.num_steps, client.generator, self.min_rows)

    # ------------------------------------------------------------------ statistics and collectives
    def register_stat(self, name: str, like: Tensor | Sequence[Tensor]) -> None:
        """Declares a per-round statistic that rides in the round's single all-reduce (call it in ``on_attach``).

        ``fed.stat(name)`` then gives views shaped like ``like`` (a tensor, or a list of tensors), valid for the
        whole run: zeroed when each round starts (before ``on_round_start``), summed over ranks by the round's
        all-reduce, read in ``on_server_step`` and ``on_round_end``. Each rank writes its share in place
        (``stat[i] += x``). The buffer's dtype is the widest of the model's and the statistics' (fp64 statistics make
        it fp64).
        """
        self.buffer.register(name, like)

    def stat(self, name: str) -> Tensor | list[Tensor]:
        """The views of a registered statistic (see :meth:`register_stat`)."""
        return self.buffer.stats[name]

    @property
    def train_loss(self) -> float | None:
        """The round's mean local training loss over the aggregated clients of every rank (after the reduce)."""
        return self.buffer.train_loss

    def all_reduce_(self, t: Tensor) -> Tensor:
        """``t`` summed over the processes, in place (the process group's all-reduce, same dtype and device); returns
        ``t``. On one process, ``t`` as it is."""
        if self.world_size > 1 and self.reduce_sum is not None:
            t.copy_(self.reduce_sum(t))
        return t

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled through the process group; identity on one process)."""
        return obj if self.world_size == 1 or self._broadcast is None else self._broadcast(obj)

    def on_server(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on rank 0 only and returns its result on every rank: server-side work (training with a
        pretrained model on the server rows) runs once, not once per rank."""
        return self.broadcast(fn() if self.rank == 0 else None)

    # ------------------------------------------------------------------ the loss on store rows, at any parameters
    # (flx.probe.LossProbe: the training state is untouched)
    def batch(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """``(x, y)`` of ``rows`` of the tensor store (:meth:`flx.probe.LossProbe.batch`)."""
        return self.probe.batch(rows)

    def grad_at(self, params: Sequence[Tensor], rows: Tensor, create_graph: bool = False) -> list[Tensor]:
        """``grad f(params; rows)`` at any ``params`` (:meth:`flx.probe.LossProbe.grad_at`)."""
        return self.probe.grad_at(params, rows, create_graph)

    def value_and_grad_at(self, params: Sequence[Tensor], rows: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The loss and :meth:`grad_at` from one pass (:meth:`flx.probe.LossProbe.value_and_grad_at`)."""
        return self.probe.value_and_grad_at(params, rows)

    def hvp(
        self,
        v: Sequence[Tensor],
        rows: Tensor,
        mode: str = "exact",
        params: Sequence[Tensor] | None = None,
        eps: float | Tensor | None = None,
    ) -> list[Tensor]:
        """``H(params) v`` on ``rows``, ``mode`` exact / fd / none, ``eps`` the fd step
        (:meth:`flx.probe.LossProbe.hvp`)."""
        return self.probe.hvp(v, rows, mode, params, eps=eps)

    def eval_loss(self, rows: Tensor, chunk: int = 4096) -> float:
        """The net's mean loss on ``rows`` in eval mode, no RNG drawn (:meth:`flx.probe.LossProbe.eval_loss`)."""
        return self.probe.eval_loss(rows, chunk)

    def eval_loss_tensor(self, rows: Tensor, chunk: int = 4096) -> Tensor:
        """:meth:`eval_loss` as a float64 scalar on the net's device, no host sync."""
        return self.probe.eval_loss_tensor(rows, chunk)
