r"""pFedFBE: FedAvg on the forward-backward envelopes of the clients' composite losses.

Anonymous, "Personalized Federated Composite Learning with Forward-Backward Envelopes", ICLR submission under
double-blind review. Client :math:`i`'s loss :math:`f_i` plus a shared convex
nonsmooth :math:`h = \mu R` is replaced by its forward-backward envelope (FBE, Eqs. 4-5), smooth for
:math:`\lambda > 0`:

.. math::
    F_i(w) = f_i(w) - \tfrac{1}{2\lambda} \lVert \nabla f_i(w) \rVert^2 + H(w - \nabla f_i(w) / \lambda),
    \qquad H(v) = h(p) + \tfrac{\lambda}{2} \lVert p - v \rVert^2, \quad p = \mathrm{prox}_{h/\lambda}(v),

and FedAvg runs on :math:`F = \frac1N \sum_i F_i` (Eq. 7). One local step (Algorithm 1 lines 8-13, Eqs. 6 and 9):

.. math::
    g = \nabla f_i(w; D), \quad \theta = \mathrm{prox}_{h/\lambda}(w - g / \lambda), \quad u = w - \theta, \quad
    G = \lambda u - \nabla^2 f_i(w; \hat D)\, u, \quad w \leftarrow w - \eta G.

The core's backward puts :math:`g` in ``p.grad`` (the task loss on the step's minibatch :math:`D`); ``on_local_grad``
replaces it with :math:`G` and the core's SGD step is line 13. Client :math:`i`'s personalised model is one
proximal-gradient step from the global model (line 16; Eq. 8 with the :math:`1/\lambda` of Alg. 1 and Eq. 6, which
Eq. 8 omits): :math:`\theta_i(w) = \mathrm{prox}_{h/\lambda}(w - \nabla f_i(w)/\lambda)`, installed by ``personalize``
during evaluation, so the core logs ``val/personal_*``. No client state (Alg. 1).

Choices the paper leaves open, all options: the Hessian-vector product ``hessian`` (``exact`` double
backward, the default; ``fd`` the paper's finite difference, here central with step norm ``fd_eps``; ``none`` the
first-order variant :math:`G = \lambda u`), the Hessian batch :math:`\hat D` (``independent``, the theory's setting and
the default, drawn without replacement from a ``(seed, round, client)`` stream of its own so the gradient batches
:math:`D` are FedAvg's; or ``same`` = :math:`D`), its size (``hessian_batch_size``, default the batch size) and the
gradient of :math:`\theta_i` (``personal_batch``: all the client's training rows, or a fixed seeded subset). The
Hessian is that of the task loss ``fed.loss_fn``: parts that change the local objective (``local_loss``) or
``p.grad`` before this part change :math:`g` only; list FedProx's ``Prox`` after this part to add
:math:`\mu (w - w^t)` to :math:`G` (FedProx as the outer solver, Sec. 2.2).

Symbols: ``lam`` (:math:`\lambda`), ``eta`` (``algo.lr``), ``mu`` (the regulariser's weight), ``g``, ``theta``, ``u``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from flx.autodiff import FD_EPS, HVP_MODES, sq_norm
from flx.errors import bad_value, check_fields
from flx.hooks import PERSONAL_HEADLINE, FederatedCallback
from flx.regularizers import Regularizer, make_regularizer
from flx.sampling import derive_seed, fresh_rows
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView

HESSIAN_BATCHES = ("independent", "same")
_HAT_TAG, _PERSONAL_TAG = 0xFBE1, 0xFBE2
_HAT = "fbe/hat_generator"


def as_regularizer(regularizer: Regularizer | Mapping[str, Any] | None) -> Regularizer:
    """A :class:`Regularizer` as given, or built from its config ``{name, mu, params, ...}`` (a Hydra node becomes
    plain Python values; ``None``: no regulariser)."""
    if isinstance(regularizer, Regularizer):
        return regularizer
    if regularizer is None:
        return make_regularizer(None)
    return make_regularizer(regularizer)  # which checks every value, the params patterns included


def full_grad(fed: FederationView, w: Sequence[Tensor], rows: Tensor, chunk: int = 4096) -> list[Tensor]:
    """:math:`\\nabla f(w)` of the batch-mean task loss over ``rows``, in chunks of at most ``chunk`` rows."""
    if len(rows) <= chunk:
        return fed.grad_at(w, rows)
    total = [torch.zeros_like(t) for t in w]
    for part in rows.split(chunk):
        torch._foreach_add_(total, fed.grad_at(w, part), alpha=len(part) / len(rows))
    return total


def personal_model(reg: Regularizer, w: Sequence[Tensor], g: Sequence[Tensor], lam: float) -> list[Tensor]:
    """:math:`\\theta = \\mathrm{prox}_{h/\\lambda}(w - g/\\lambda)` (Alg. 1 lines 9 and 16)."""
    return reg.prox(torch._foreach_add(list(w), list(g), alpha=-1.0 / lam), 1.0 / lam)


def fbe_direction(
    fed: FederationView,
    w: Sequence[Tensor],
    g: Sequence[Tensor],
    rows_hat: Tensor | None,
    lam: float,
    reg: Regularizer,
    mode: str = "exact",
    eps: float = FD_EPS,
) -> list[Tensor]:
    """:math:`G = \\lambda u - \\nabla^2 f(w; \\hat D)\\, u` with :math:`u = w - \\mathrm{prox}_{h/\\lambda}(w -
    g/\\lambda)` (Alg. 1 lines 9-12, Eq. 9); ``rows_hat`` (:math:`\\hat D`) is unused with ``mode="none"``.

    :math:`u` is formed as :math:`g/\\lambda + (v - \\mathrm{prox}(v))`, :math:`v = w - g/\\lambda` (the same number
    in exact arithmetic): on tensors the prox leaves alone the second term is exactly 0, so :math:`u` keeps every digit
    of :math:`g/\\lambda` instead of the difference of two nearly equal models (:math:`\\lambda = 2000`).
    """
    v = torch._foreach_add(list(w), list(g), alpha=-1.0 / lam)
    u = torch._foreach_add(torch._foreach_sub(v, reg.prox(v, 1.0 / lam)), list(g), alpha=1.0 / lam)
    direction = torch._foreach_mul(u, lam)
    if mode != "none":
        if rows_hat is None:
            raise ValueError(f"fbe_direction: mode={mode!r} needs the Hessian rows rows_hat")
        torch._foreach_sub_(direction, fed.hvp(u, rows_hat, mode=mode, params=list(w), eps=eps))
    return list(direction)


def fbe_value(fed: FederationView, rows: Tensor, lam: float, reg: Regularizer | None = None) -> Tensor:
    """The FBE :math:`F(w)` (Eq. 5) of the task loss over ``rows`` at the net's parameters, in eval mode, float64."""
    reg = reg if reg is not None else Regularizer()
    was_training = fed.net.training
    fed.net.eval()
    try:
        w = [p.detach() for p in fed.params]
        g = full_grad(fed, w, rows)
        f = fed.eval_loss_tensor(rows)  # on the device: no host read per client
    finally:
        fed.net.train(was_training)
    v = torch._foreach_add(w, g, alpha=-1.0 / lam)
    p = reg.prox(v, 1.0 / lam)
    return f - sq_norm(g) / (2 * lam) + reg.value(p).double() + lam / 2 * sq_norm(torch._foreach_sub(p, v))


def fbe_objective(fed: FederationView, lam: float, reg: Regularizer | None = None) -> float:
    """:math:`F(w) = \\frac1N \\sum_i F_i(w)` (Eq. 7) of the net's parameters, each :math:`F_i` (:func:`fbe_value`)
    on client :math:`i`'s full training rows (a client without rows counts 0, as in ``train/objective``). Client
    :math:`i` on rank :math:`i \\bmod` world size, one sum over the ranks: call it on every rank."""
    with torch.inference_mode(False), torch.enable_grad():  # Lightning evaluates under inference mode
        out = torch.zeros(fed.num_clients, dtype=torch.float64, device=fed.params[0].device)
        for cid in range(fed.rank, fed.num_clients, fed.world_size):
            rows = fed.data.client_indices[cid]
            if len(rows):
                out[cid] = fbe_value(fed, rows, lam, reg).detach()
        fed.all_reduce_(out)
        return float(out.mean())


def fbe_gradient(
    fed: FederationView, rows: Tensor, lam: float, reg: Regularizer | None = None, mode: str = "exact"
) -> list[Tensor]:
    """:math:`\\nabla F(w)` (Eq. 6) over ``rows`` at the net's parameters: :func:`fbe_direction` with full batches."""
    w = [p.detach() for p in fed.params]
    return fbe_direction(fed, w, full_grad(fed, w, rows), rows, lam, reg if reg is not None else Regularizer(), mode)


@dataclass(frozen=True)
class FBEParams:
    """``lam`` (:math:`\\lambda`), the Hessian mode and batch, the finite-difference step, the personal batch."""

    lam: float = 200.0
    hessian: str = "exact"
    fd_eps: float = FD_EPS
    hessian_batch: str = "independent"
    hessian_batch_size: int | None = None  # None: algo.batch_size
    personal_batch: int | None = None  # None: all the client's training rows


class FBE(FederatedCallback):
    """pFedFBE's local step (``on_local_grad``) and personalised model (``personalize``); ``regularizer``: a
    :class:`~flx.regularizers.Regularizer` or its config ``{name, mu, params, ...}`` (None: :math:`h = 0`). At every
    validation and at the test it logs ``train/fbe_objective``, :math:`F(w)` of Eq. 7 (:func:`fbe_objective`)."""

    traits = PartTraits(uploads={}, headline=PERSONAL_HEADLINE, metrics=("train/fbe_objective",))  # theta_i stays

    def __init__(self, regularizer: Regularizer | Any = None, **params: Any) -> None:
        self.params = p = FBEParams(**params)
        check_fields(p, "algo.")
        if not p.lam > 0:
            raise bad_value("algo.lam", p.lam, "the FBE parameter lambda, > 0 (the theory wants lambda > L)")
        if p.hessian not in HVP_MODES:
            raise bad_value("algo.hessian", p.hessian, f"allowed: {', '.join(HVP_MODES)}")
        if not p.fd_eps > 0:
            raise bad_value("algo.fd_eps", p.fd_eps, "the finite-difference step norm, > 0")
        if p.hessian_batch not in HESSIAN_BATCHES:
            raise bad_value("algo.hessian_batch", p.hessian_batch, f"allowed: {', '.join(HESSIAN_BATCHES)}")
        for key in ("hessian_batch_size", "personal_batch"):
            if getattr(p, key) is not None and getattr(p, key) < 1:
                raise bad_value(f"algo.{key}", getattr(p, key), ">= 1, or null")
        self.reg = as_regularizer(regularizer)
        self._fed: FederationView | None = None  # set by on_attach

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.reg.bind(fed.net)
        self._fed = fed  # read in Lightning's evaluation hooks

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_objective(trainer, pl_module)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_objective(trainer, pl_module)

    def _log_objective(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``train/fbe_objective`` (:func:`fbe_objective`) of the global model, once it exists."""
        fed = self._fed
        if trainer.sanity_checking or fed is None or fed.rnd is None:
            return
        value = fbe_objective(fed, self.params.lam, self.reg)  # the same on every rank after the sum
        pl_module.log("train/fbe_objective", value, sync_dist=True, add_dataloader_idx=False)

    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        if self.params.hessian != "none" and self.params.hessian_batch == "independent":
            seed = derive_seed(fed.cfg.seed, client.round.round, client.cid, client.copy, _HAT_TAG)
            client.extras[_HAT] = torch.Generator().manual_seed(seed)

    def _hessian_rows(self, fed: FederationView, client: ClientContext) -> Tensor:
        """:math:`\\hat D`: the step's rows (``same``, whichever part chose them) or ``hessian_batch_size`` rows drawn
        without replacement, anew at every step (all the client's rows when it has no more; under
        ``algo.minibatch=fresh`` through :func:`~flx.sampling.fresh_rows`, in random order)."""
        if self.params.hessian_batch == "same":
            assert client.rows is not None, "on_local_grad runs inside a local step"
            return client.rows
        rows = fed.data.client_indices[client.cid]
        size = self.params.hessian_batch_size or fed.cfg.batch_size
        if fed.cfg.minibatch == "fresh":  # drawn as the core's fresh minibatches are (cheap for big clients)
            return fresh_rows(rows, size, client.extras[_HAT])
        if size >= len(rows):
            return rows
        return rows[torch.randperm(len(rows), generator=client.extras[_HAT])[:size].to(rows.device)]  # host draw

    @override
    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        p = self.params
        w = [q.detach() for q in fed.params]
        g = [q.grad if q.grad is not None else torch.zeros_like(q) for q in fed.params]
        rows_hat = self._hessian_rows(fed, client) if p.hessian != "none" else None
        direction = fbe_direction(fed, w, g, rows_hat, p.lam, self.reg, p.hessian, p.fd_eps)
        for q, d in zip(fed.params, direction):
            q.grad = d

    @override
    def personalize(self, fed: FederationView, cid: int) -> Any:
        rows = fed.data.client_indices[cid]
        return self._personal(fed, cid, rows) if len(rows) else None

    @contextmanager
    def _personal(self, fed: FederationView, cid: int, rows: Tensor) -> Iterator[None]:
        """The net as :math:`\\theta_i(w)`; the federation restores :math:`w` on exit."""
        size = self.params.personal_batch
        if size is not None and size < len(rows):  # a fixed subset per client: theta_i stays a function of w
            gen = torch.Generator().manual_seed(derive_seed(fed.cfg.seed, cid, _PERSONAL_TAG))
            rows = rows[torch.randperm(len(rows), generator=gen)[:size]]
        w = [q.detach() for q in fed.params]
        theta = personal_model(self.reg, w, full_grad(fed, w, rows), self.params.lam)
        with torch.no_grad():
            torch._foreach_copy_(fed.params, theta)
        yield
