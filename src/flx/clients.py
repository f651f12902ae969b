"""How a rank trains its shard of the round: one interface, two implementations.

:class:`Sequential` (the default) trains client after client through the one net; :class:`flx.vectorized.Stacked`
(``algo.vectorize=true``) trains the shard at once, the clients' models stacked. Both share what makes a client the
same client on either path:

- :meth:`ClientRunner.make_client`: its seeds, weight and stored state (the round plan, :class:`flx.context.Round`);
- :meth:`ClientRunner.step_rows`: each step's rows, the one minibatch dispatch (a part's ``sample_batch``, else the
  client's default stream ``fed.client_batches``);
- ``torch.optim.SGD``'s update rule: :class:`Sequential` steps ``fed.local_opt`` (through
  :func:`flx.local_sgd.sgd_update` when it is plain SGD), ``Stacked`` steps with ``sgd_update``, that rule;
- :meth:`ClientRunner.collect`: the client's end (``on_client_end``, the fault checks, the aggregate, the stored
  state).

The sequential steps run one loop, with the per-step client context (``client.step``, ``.rows``, ``.batch``,
``.outputs``) and the step hooks only when a part hooks a step; docs/round_protocol.md, step 4.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from flx.context import ClientContext, Core, Round
from flx.faults import all_finite
from flx.hooks import STEP_HOOKS, first_answer
from flx.local_sgd import clear_grads, is_plain_sgd, minibatches, sgd_step
from flx.sampling import derive_seed


class ClientRunner:
    """Trains a rank's clients of the round; built once per run by the federation (``fed.runner``)."""

    def __init__(self, fed: Core) -> None:
        self.fed = fed
        self.generator = torch.Generator()  # reseeded for every client: its minibatch stream

    def train(self, cids: Sequence[int], after: Callable[[int], None] | None = None) -> None:
        """Trains ``cids`` (this rank's shard, in order); ``after(cid)`` runs after each client's end."""
        raise NotImplementedError

    def make_client(self, cid: int) -> ClientContext:
        """The next local run of ``cid`` on this rank: its weight, seeded streams and stored state."""
        fed = self.fed
        rnd, cfg = self.round, fed.cfg
        copy = rnd.next_copy(cid)
        stands_for = 1 if cfg.duplicates == "repeat" else rnd.draws[cid]
        # copy 0 keeps the 3-word seed, so a client drawn once trains bitwise alike in both modes
        if copy or cid not in rnd.seeds:  # copy 0 of the shard's clients: drawn at once in begin_round
            seed = derive_seed(cfg.seed, rnd.round, cid, *((copy,) if copy else ()))
        else:
            seed = rnd.seeds[cid]
        # dropout & co. depend only on (seed, round, client). Not torch.manual_seed: on CUDA builds it records a
        # stack trace per call for lazy CUDA seeding (costly under Lightning's deep call stack)
        torch.default_generator.manual_seed(seed)
        if fed.params[0].is_cuda:
            torch.cuda.manual_seed(seed)
        self.generator.manual_seed(seed)
        if cid in rnd.start_states:  # a repeated client: every copy starts from the round-start state
            state = {k: v.clone() for k, v in rnd.start_states[cid].items()}
        else:
            state = fed.store.get(cid, fed.params[0].device) if cid in fed.store else {}
        weight = float(rnd.weights[cid] * stands_for)
        n, steps = fed.num_samples(cid), fed.client_steps(cid)
        return ClientContext(cid, rnd, n, steps, weight, self.generator, state, stands_for=stands_for, copy=copy)

    def start(self, cid: int) -> ClientContext:
        """:meth:`make_client` and the parts' ``on_client_start``, with the global model in the net."""
        fed = self.fed
        client = self.make_client(cid)
        for part in fed.parts_with("on_client_start"):
            part.on_client_start(fed, client)
        return client

    def step_rows(self, client: ClientContext, k: int, stream: Iterator[Tensor]) -> Tensor:
        """Client ``client``'s rows at step ``k``: the first part's ``sample_batch``, else its default stream's next
        (which advances only when used)."""
        client.step = k
        rows = first_answer(self.fed.parts_with("sample_batch"), "sample_batch", self.fed, client)
        return next(stream) if rows is None else rows

    def train_client(self, cid: int) -> Tensor | None:
        """Local training of one client alone, from the global model; adds its weighted model to the round's
        aggregate (:meth:`collect`). Returns the mean local training loss (detached scalar), or None for a client left
        out (skipped for too few rows, or dropped as not finite: docs/round_protocol.md)."""
        fed = self.fed
        if fed.num_samples(cid) < fed.min_rows:  # empty, or one row with BatchNorm: nothing to train on
            return self.collect(cid, None, None)
        fed.load_global()
        if not fed.net.training:  # evaluation and parts switch the whole net (its root) to eval and back
            fed.net.train()
        client = self.start(cid)
        return self.collect(cid, client, self.local_update(client))

    def collect(self, cid: int, client: ClientContext | None, loss: Tensor | None) -> Tensor | None:
        """A client's end, with its local model in the net: ``on_client_end``, the fault checks, the aggregate
        (``fed.buffer``), the stored state; ``client`` None: skipped for too few rows. Returns ``loss``, or None for a
        client left out."""
        fed = self.fed
        if client is None or loss is None:  # the runners pass both None for a client without enough rows
            self._leave_out(cid, "skipped")
            return None
        # checked before on_client_end, so parts do not record a faulty client's statistics (scores, losses), and
        # after it when parts may have changed the upload
        if not all_finite([*fed.local_state, loss]):
            self._leave_out(cid, "dropped")
            return None
        ends = fed.parts_with("on_client_end")
        for part in ends:
            part.on_client_end(fed, client)
        if ends and not all_finite(fed.local_state):
            self._leave_out(cid, "dropped")
            return None
        fed.buffer.add(fed.local_state, client.weight, client.masks, loss)
        if client.state:
            fed.store.put(cid, client.state)
            if fed.world_size > 1:  # for the all-gather at the round end (one process holds no second copy)
                self.round.state_updates[cid] = client.state
            fed.buffer.count("stored")
        return loss

    def _leave_out(self, cid: int, why: str) -> None:
        """Leaves a client out of the round's aggregate and state updates; counted in the round's collective."""
        self.round.left_out[why].append(cid)
        self.fed.buffer.count(why)

    @property
    def round(self) -> Round:
        """The round the clients train in (``fed.rnd``: set by ``begin_round`` before any client trains)."""
        rnd = self.fed.rnd
        if rnd is None:
            raise RuntimeError("clients train inside a round: Federation.begin_round comes first")
        return rnd

    def local_update(self, client: ClientContext) -> Tensor:
        """The client's local update: a part's ``local_update``, else ``K`` SGD steps. Returns the mean loss."""
        fed = self.fed
        loss = first_answer(fed.parts_with("local_update"), "local_update", fed, client)
        if loss is None:
            return self.local_steps(client) / max(client.num_steps, 1)
        if isinstance(loss, Tensor):  # on the net's device, as the default steps' loss is
            return loss.detach().to(torch.float64).reshape(())
        return torch.full((), float(loss), dtype=torch.float64, device=fed.params[0].device)

    def local_steps(self, client: ClientContext) -> Tensor:
        """``client.num_steps`` SGD steps of the net on the client's minibatches; returns the sum of their losses.

        Each step: ``sample_batch`` → forward → ``local_loss`` → ``backward`` (or a part's ``local_grad`` for these
        three) → ``on_local_grad`` → the step → ``on_local_step_end``. With no part hooking a step, the per-step
        client context is not set and the minibatch
        stream is drawn ahead, its integer labels gathered at once (:func:`flx.local_sgd.minibatches`).
        """
        fed = self.fed
        opt = fed.local_opt
        opt.state.clear()  # a fresh local optimizer per client
        # plain SGD (FedAvg's default) steps without torch.optim's per-call bookkeeping (flx.local_sgd)
        plain = is_plain_sgd(opt)
        zero_grad = (lambda: clear_grads(opt)) if plain else (lambda: opt.zero_grad(set_to_none=True))
        step = (lambda: sgd_step(opt)) if plain else opt.step
        hooked = any(fed.parts_with(h) for h in STEP_HOOKS)  # else the steps skip their bookkeeping
        rules, loss_parts, grad_parts, end_parts = (
            fed.parts_with(h) for h in ("local_grad", "local_loss", "on_local_grad", "on_local_step_end")
        )
        net, loss_fn = fed.net, fed.loss_fn
        losses: list[Tensor] = []  # summed once after the steps: one op per client, not one per step
        with fed.step_context():
            for xb, yb in self._batches(client, hooked):  # exactly client.num_steps minibatches
                zero_grad()
                loss = first_answer(rules, "local_grad", fed, client)  # a part's own gradient (local DP-SGD)
                if loss is None:
                    outputs = net(xb)
                    loss = loss_fn(outputs, yb)
                    if hooked:
                        client.outputs = outputs
                        for part in loss_parts:
                            loss = part.local_loss(fed, client, loss)
                    loss.backward()
                for part in grad_parts:
                    part.on_local_grad(fed, client)
                step()
                for part in end_parts:
                    part.on_local_step_end(fed, client)
                losses.append(loss.detach())
        client.rows = client.batch = client.outputs = None
        return torch.stack(losses).sum() if losses else torch.zeros((), device=fed.params[0].device)

    def _batches(self, client: ClientContext, hooked: bool) -> Iterator[tuple[Tensor, Tensor]]:
        """The steps' ``(x, y)``: with step hooks, each step's rows from :meth:`step_rows` (``client.step``, ``.rows``
        and ``.batch`` set); else the default stream through :func:`flx.local_sgd.minibatches`."""
        x, y, default = self.fed.data.x, self.fed.data.y, self.fed.client_batches(client)
        if not hooked:
            yield from minibatches(x, y, default)
            return
        for k in range(client.num_steps):
            rows = self.step_rows(client, k, default)
            client.rows, client.batch = rows, (x[rows], y[rows])
            yield client.batch


class Sequential(ClientRunner):
    """Client after client through the one net (:meth:`ClientRunner.train_client`)."""

    def train(self, cids: Sequence[int], after: Callable[[int], None] | None = None) -> None:
        for cid in cids:
            self.train_client(cid)
            if after is not None:
                after(cid)
