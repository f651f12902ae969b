"""Vectorised client execution (``algo.vectorize=true``): a rank's shard trained at once with ``torch.func``.

The sequential path (:class:`flx.clients.Sequential`) runs client after client through the one net.
Here the clients' models are stacked along a leading cohort dimension ``m``, and each local step is one stacked
forward, every client's own loss, one ``torch.autograd.grad`` of their sum (client ``i``'s loss depends on ``w_i``
only, so it gives every client's gradient) and the same update as ``torch.optim.SGD`` (weight decay, then momentum,
reset for every client) on all ``m`` clients:

.. math::
    d_i = \\nabla \\ell_i(w_i; \\xi_i^k) + \\lambda w_i,\\quad b_i \\leftarrow \\beta b_i + d_i
    \\;(b_i = d_i \\text{ at } k = 0),\\quad w_i \\leftarrow w_i - \\eta\\, b_i.

Every client keeps its own ``(seed, round, client)`` streams (seeds, minibatch rows drawn as in the sequential path),
its own weight and its own fault check, so the result equals the sequential path up to floating-point summation
order (``tests/test_vectorized.py``: allclose 1e-10 in float64 for FedAvg, FedProx, DRFA and FeDXL). Clients with the
same step count train as one stack. A net that maps rows on their own (:func:`foldable`) runs with the cohort folded
into the batch, short batches padded with the client's own rows (kept out of its loss); any other net ``vmap``-s its
forward over the clients (``torch.func.functional_call``), in sub-stacks of equal batch size. After the stacks have
trained, each client's model is loaded into the net in shard order for ``on_client_end``, the fault check and the
aggregate, exactly as on the sequential path.

What it needs: a net without BatchNorm or dropout (their training-mode state and randomness are per call, not per
client), and parts that either leave the client path alone or declare ``traits.vectorizable``. Such a part's
``on_client_start`` / ``on_client_end`` run per client as usual (the net holds the global model at the first, the
client's model at the second); its ``sample_batch`` and ``local_loss`` run per client inside each stacked step, with
``client.step``, ``client.rows``, ``client.batch`` and ``client.outputs`` set as on the sequential path and
``client.generator`` the client's own (a copy of the federation's, which is reseeded per client); and it implements
``on_cohort_grad`` / ``on_cohort_step_end`` in place of ``on_local_grad`` / ``on_local_step_end``. A part that
replaces the whole local update (``local_update``) cannot be vectorised: :func:`check` says which, in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from flx import composition
from flx.clients import ClientRunner
from flx.context import ClientContext, Cohort, Core
from flx.errors import ConfigError
from flx.hooks import FederatedCallback, first_answer
from flx.local_sgd import sgd_update

_RANDOM_OR_STATEFUL = (nn.modules.batchnorm._BatchNorm, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
# layers that map each row on its own: a net of these (and nn.Linear) runs with the cohort folded into the batch
ROWWISE = (
    nn.Sequential, nn.Linear, nn.Flatten, nn.Identity, nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU, nn.SiLU,
    nn.ELU, nn.Softplus, nn.Dropout,
)  # fmt: skip
# the stacked forward: the clients' outputs (m, B, ...), or with unequal batch sizes a list of their (B_i, ...)
Outputs = Tensor | list[Tensor]
Forward = Callable[[list[Tensor], Tensor, list[int]], Outputs]


def check(net: nn.Module, parts: Sequence[FederatedCallback] = ()) -> None:
    """Raises a one-line :class:`ConfigError` when ``algo.vectorize=true`` cannot train this net (a layer with
    per-call state or randomness) or these parts (:func:`flx.composition.check_vectorizable`)."""
    layer = next((m for m in net.modules() if isinstance(m, _RANDOM_OR_STATEFUL) and _active(m)), None)
    if layer is not None:
        raise ConfigError(
            f"algo.vectorize=true: the net has {type(layer).__name__} layers (per-call training state or randomness);"
            " allowed: nets without BatchNorm and dropout, or algo.vectorize=false"
        )
    composition.check_vectorizable(parts)


def _active(module: nn.Module) -> bool:
    return not isinstance(module, nn.modules.dropout._DropoutNd) or module.p > 0


class Stacked(ClientRunner):
    """The shard trained as stacked cohorts (clients with the same step count together); then, per client in shard
    order and with the client's model in the net, its end (:meth:`ClientRunner.collect`) and ``after(cid)``."""

    def train(self, cids: Sequence[int], after: Callable[[int], None] | None = None) -> None:
        fed = self.fed
        runs: list[tuple[int, ClientContext | None]] = []
        fed.load_global()
        if not fed.net.training:
            fed.net.train()
        for cid in cids:
            if fed.num_samples(cid) < fed.min_rows:
                runs.append((cid, None))
                continue
            client = self.make_client(cid)
            # make_client reseeds one generator per client; stacked clients draw all along, each from its own copy
            client.generator = _copy_of(client.generator)
            for part in fed.parts_with("on_client_start"):
                part.on_client_start(fed, client)
            runs.append((cid, client))
        groups: dict[int, list[int]] = {}
        for j, (_, run) in enumerate(runs):
            if run is not None:
                groups.setdefault(run.num_steps, []).append(j)
        trained: dict[int, tuple[list[Tensor], Tensor]] = {}
        for members in groups.values():
            params, losses = self._train_group([c for j in members if (c := runs[j][1]) is not None])
            trained.update({j: ([p[i] for p in params], losses[i]) for i, j in enumerate(members)})
        for j, (cid, run) in enumerate(runs):
            if run is None:
                self.collect(cid, None, None)
            else:
                local, loss = trained[j]
                with torch.no_grad():
                    torch._foreach_copy_(fed.params, local)
                self.collect(cid, run, loss)
            if after is not None:
                after(cid)

    def _train_group(self, clients: list[ClientContext]) -> tuple[list[Tensor], Tensor]:
        """``K`` local steps of ``m`` clients with the same step count; returns their parameters ``(m, ...)`` and
        mean losses ``(m,)``.

        Each step draws every client's rows as the sequential path does (:meth:`ClientRunner.step_rows`, from the
        client's own generator), runs the stacked forward, then each client's loss on its own rows: the task's loss
        and the parts' ``local_loss`` with ``client.rows``, ``client.batch``, ``client.outputs`` and ``client.step``
        set as in the sequential step; the step is :func:`flx.local_sgd.sgd_update` on the stacked tensors.
        """
        fed = self.fed
        m, cfg = len(clients), fed.cfg
        folded = foldable(fed.net)
        # a folded net's weights are stored transposed, (m, in, out): the gradient of baddbmm(x, W^T) then comes out
        # in the storage's own layout, and the SGD step adds contiguous tensors (not strided ones, through a transpose)
        flip = [folded and g.dim() == 2 for g in fed.global_params]
        leaves = [_stack(g.t().contiguous() if f else g, m).requires_grad_() for g, f in zip(fed.global_params, flip)]
        params = [w.mT if f else w for w, f in zip(leaves, flip)]  # (m, *p.shape): views of the leaves
        forward = _folded(fed, m) if folded else _vmapped(fed)
        rules = fed.parts_with("cohort_grad")
        cohort, momentum = Cohort(clients, params), None
        streams = [fed.client_batches(client) for client in clients]
        losses = params[0].new_zeros(m, requires_grad=False)
        steps = clients[0].num_steps
        with fed.step_context():
            for k in range(steps):
                own = [self.step_rows(client, k, stream) for client, stream in zip(clients, streams)]
                cohort.step, cohort.sizes = k, [len(r) for r in own]
                rows = cohort.rows = _padded(own, max(cohort.sizes))  # (m, B)
                ruled = first_answer(rules, "cohort_grad", fed, cohort)  # a part's own gradients (local DP-SGD)
                # (a part's gradients come shaped like params; the leaves take their transposed views)
                grads: Sequence[Tensor]
                if ruled is None:
                    out = forward(leaves, fed.data.x[rows], cohort.sizes)
                    loss = _cohort_loss(fed, clients, own, rows, out)
                    grads = torch.autograd.grad(loss.sum(), leaves)  # client i's loss depends on w_i only
                    cohort.grads = [g.mT if f else g for g, f in zip(grads, flip)]  # views: hooks edit leaves' grads
                else:  # a part's gradient (local DP-SGD)
                    loss, cohort.grads = ruled[0].detach(), ruled[1]
                    grads = [g.mT if f else g for g, f in zip(cohort.grads, flip)]
                for part in fed.parts_with("on_cohort_grad"):
                    part.on_cohort_grad(fed, cohort)
                momentum = sgd_update(leaves, list(grads), momentum, cfg.lr, cfg.momentum, cfg.weight_decay)
                cohort.grads = None
                for part in fed.parts_with("on_cohort_step_end"):
                    part.on_cohort_step_end(fed, cohort)
                losses += loss.detach().to(losses.dtype)
        for client in clients:
            client.rows = client.batch = client.outputs = None
        return [p.detach() for p in params], losses / max(steps, 1)


def _copy_of(gen: torch.Generator) -> torch.Generator:
    own = torch.Generator(gen.device)
    own.set_state(gen.get_state())
    return own


def _stack(w: Tensor, m: int) -> Tensor:
    """``m`` contiguous copies of ``w``, ``(m, *w.shape)``."""
    out = w.new_empty(m, *w.shape)
    out.copy_(w.unsqueeze(0).expand_as(out))
    return out


def _cohort_loss(fed: Core, clients: list[ClientContext], own: list[Tensor], rows: Tensor, out: Outputs) -> Tensor:
    """The clients' losses at this step, ``(m,)``, without ``local_loss`` parts in as few calls as the task allows:
    with a task's per-row loss (``loss_rows``, e.g. cross-entropy), one call on the whole stack, each client's mean over
    its own rows (padding left out); else the task's loss ``vmap``-ed over the clients of each batch size. Per client
    the same kernels up to summation order. With ``local_loss`` parts, or a loss that ``vmap`` cannot batch
    (data-dependent control flow), client by client (:func:`_client_loss`), which then raises what is really wrong."""
    if not fed.parts_with("local_loss") and isinstance(out, Tensor):
        sizes, y = [len(r) for r in own], fed.data.y[rows]
        per_row = getattr(getattr(fed.loss_fn, "__self__", None), "loss_rows", None)
        if per_row is not None:
            return _row_means(per_row(out.flatten(0, 1), y.flatten(0, 1)).view(len(own), -1), sizes)
        try:
            return _losses_by_size(fed.loss_fn, out, y, sizes)
        except RuntimeError:
            pass
    return torch.stack([_client_loss(fed, c, r, out[i][: len(r)]) for i, (c, r) in enumerate(zip(clients, own))])


def _row_means(losses: Tensor, sizes: list[int]) -> Tensor:
    """Each client's mean of its first ``sizes[i]`` row losses, ``(m,)``, from ``losses`` ``(m, B)``."""
    if all(size == losses.shape[1] for size in sizes):
        return losses.mean(1)
    n = torch.tensor(sizes).to(losses.device, non_blocking=True)  # made on the host, copied (docs/loop.md#devices)
    mask = torch.arange(losses.shape[1], device=losses.device) < n[:, None]
    return (losses * mask).sum(1) / n.to(losses.dtype)


def _losses_by_size(loss_fn: Callable[[Tensor, Tensor], Tensor], out: Tensor, y: Tensor, sizes: list[int]) -> Tensor:
    """``loss_fn(out[i, :sizes[i]], y[i, :sizes[i]])`` for every client ``i``, ``(m,)``: one ``vmap`` per size."""
    batched = torch.func.vmap(loss_fn)
    if len(set(sizes)) == 1:
        return batched(out[:, : sizes[0]], y[:, : sizes[0]])
    order: list[int] = []
    parts: list[Tensor] = []
    for size in sorted(set(sizes)):
        members = [i for i, s in enumerate(sizes) if s == size]
        idx = torch.tensor(members).to(out.device, non_blocking=True)
        parts.append(batched(out[idx, :size], y[idx, :size]))
        order += members
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return torch.cat(parts)[inverse.to(out.device)]


def _client_loss(fed: Core, client: ClientContext, rows: Tensor, outputs: Tensor) -> Tensor:
    """One client's local objective at this step: the task's loss of its rows, then the parts' ``local_loss``."""
    client.rows, client.batch, client.outputs = rows, fed.batch(rows), outputs
    loss = fed.loss_fn(outputs, client.batch[1])
    for part in fed.parts_with("local_loss"):
        loss = part.local_loss(fed, client, loss)
    return loss


def _padded(rows: list[Tensor], size: int) -> Tensor:
    """``(m, size)``: each client's rows, then copies of its first row (of the store's first row for an empty batch,
    which Poisson-sampled steps may draw)."""
    if all(len(r) == size for r in rows):
        return torch.stack(rows)
    pad = [r[:1] if len(r) else torch.zeros(1, dtype=r.dtype, device=r.device) for r in rows]
    return torch.stack([r if len(r) == size else torch.cat([r, p.expand(size - len(r))]) for r, p in zip(rows, pad)])


def foldable(net: nn.Module) -> bool:
    """Whether the net maps every input row on its own and holds its parameters in ``nn.Linear`` layers only, so
    the cohort can be folded into the batch (:func:`_folded`): every module is a row-wise layer
    (:data:`ROWWISE`) or declares ``rowwise = True`` (its forward only chains its children: flx's MLP and linear
    models)."""
    return all(_rowwise(mod) for mod in net.modules()) and all(
        isinstance(mod, nn.Linear) for mod in net.modules() if any(True for _ in mod.parameters(recurse=False))
    )


def _rowwise(mod: nn.Module) -> bool:
    if isinstance(mod, nn.Flatten):
        return mod.start_dim >= 1  # from the batch dimension (or counted from the end: unknown) it mixes clients
    return isinstance(mod, ROWWISE) or getattr(type(mod), "rowwise", False)


def _folded(fed: Core, m: int) -> Forward:
    """The cohort folded into the batch: ``x`` ``(m, B, ...)`` runs as ``(m B, ...)`` through the net, each linear
    layer a batched matrix product of client ``i``'s rows with client ``i``'s weights, given transposed,
    ``(m, in, out)``; returns ``(m, B, ...)``. Rows are mapped on their own, so padding rows change nothing."""
    names = [n for n, p in fed.net.named_parameters() if p.requires_grad]
    stacked = _StackedLinear(m)

    def forward(params: list[Tensor], x: Tensor, sizes: list[int]) -> Tensor:
        with stacked:
            out = torch.func.functional_call(fed.net, dict(zip(names, params)), (x.flatten(0, 1),))
        return out.unflatten(0, (m, -1))

    return forward


def _vmapped(fed: Core) -> Forward:
    """Any net: the forward ``vmap``-ed over the clients' parameters and rows; clients whose batches are shorter than
    the step's longest run as sub-stacks of their own size (the net may mix rows: no padding goes through it).
    Returns ``(m, B, ...)``, or with unequal sizes a list of the clients' ``(B_i, ...)`` outputs."""
    names = [n for n, p in fed.net.named_parameters() if p.requires_grad]

    def one(params: tuple[Tensor, ...], x: Tensor) -> Tensor:
        return torch.func.functional_call(fed.net, dict(zip(names, params)), (x,))

    batched = torch.func.vmap(one)

    def forward(params: list[Tensor], x: Tensor, sizes: list[int]) -> Tensor | list[Tensor]:
        if len(set(sizes)) == 1:
            return batched(tuple(params), x)
        outs: list[Tensor] = [x] * len(sizes)
        for size in set(sizes):
            members = [i for i, s in enumerate(sizes) if s == size]
            idx = torch.tensor(members).to(x.device)
            for i, y in zip(members, batched(tuple(p[idx] for p in params), x[idx, :size])):
                outs[i] = y
        return outs

    return forward


class _StackedLinear(TorchFunctionMode):
    """``F.linear`` with a weight stacked over ``m`` clients and stored transposed, ``(m, in, out)``, on the rows of
    ``m`` clients, ``(m B, ..., in)`` in client order: ``baddbmm`` of each client's rows with its own weight and
    bias."""

    def __init__(self, m: int) -> None:
        super().__init__()
        self.m = m

    def __torch_function__(
        self, func: Callable[..., Tensor], types: object, args: tuple[Tensor, ...] = (), kwargs: dict | None = None
    ) -> Tensor:
        kwargs = kwargs or {}
        if func is F.linear and args[1].dim() == 3:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.reshape(self.m, -1, x.shape[-1])  # (m, B..., in): client-major
            out = torch.bmm(rows, w) if b is None else torch.baddbmm(b.unsqueeze(1), rows, w)
            return out.reshape(*x.shape[:-1], w.shape[2])
        return func(*args, **kwargs)
