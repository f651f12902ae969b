r"""The composite training objective of the global model, :math:`F(w) = \frac1N \sum_i f_i(w) + h(w)`, per round.

Federated composite optimisation (pFedFBE; FedMiD / FedDualAvg, Yuan,
Zaheer, Reddi, ICML 2021) minimises

.. math::
    F(w) = \frac{1}{N} \sum_{i=1}^{N} f_i(w) + h(w), \qquad
    \texttt{train/h} = h(w^{t+1}), \qquad \texttt{train/objective} = F(w^{t+1})

with :math:`f_i` client :math:`i`'s task loss on its full training rows (:func:`client_train_losses`, unweighted over
clients as in the paper's Eq. 1) and :math:`h` the regulariser given here (:func:`flx.regularizers.make_regularizer`),
measured on every validated round after the round's update. The regulariser is the one the objective is defined
with, not the one the algorithm trains with: FedAvg (no :math:`h` in its steps) is scored on the same :math:`F`.

The mean personalised objective, with :math:`\theta_j` client :math:`j`'s personalised model (the parts'
``personalize``: pFedFBE's :math:`\theta_j(w)`, pFedMe's, Ditto's, ...; the global model where no part personalises
it, so it equals ``train/objective`` for FedAvg):

.. math::
    \texttt{train/personal\_objective} = \frac{1}{N} \sum_{j=1}^{N} f_j(\theta_j) + h(\theta_j), \qquad
    \texttt{\{split\}/personal\_objective} = \operatorname{mean}_j\, \hat f_j(\theta_j) + h(\theta_j)

with :math:`\hat f_j` the task loss on client :math:`j`'s evaluation rows of the split (``client_eval``; the mean runs
over the clients that have some), logged for each split with per-client rows. Clients are spread over the ranks
(client :math:`j` on rank :math:`j \bmod` world size) and summed with one collective per quantity; the clients whose
model is the global one reuse :math:`f_j(w)` (one batched pass, :func:`client_train_losses`). Every term is logged at
every validation and at the test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from flx.hooks import FederatedCallback
from flx.parts.robustness.client_loss import client_train_losses
from flx.regularizers import Regularizer, make_regularizer
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import FederationView
    from flx.datamodules.client_eval import ClientRows
    from flx.hooks import Build


@torch.no_grad()
def composite_objective(fed: FederationView, h: Regularizer) -> tuple[float, float]:
    """``(mean_i f_i(w), h(w))`` of the net's current model; ``h`` bound to ``fed.net``. Call it on every rank."""
    value = float(h.value([p.detach().double() for p in fed.params]))
    return float(client_train_losses(fed).mean()), value


def personal_terms(fed: FederationView, h: Regularizer) -> Tensor:
    """``(N, 3)`` float64 on the CPU: per client, :math:`f_j(\\theta_j)` on its training rows, :math:`h(\\theta_j)`
    and 1 where a part personalised it (0: the global model, the first two columns 0). Call it on every rank."""
    with torch.inference_mode(False):  # Lightning evaluates under inference mode; personalize may take gradients
        out = torch.zeros(fed.num_clients, 3, dtype=torch.float64, device=fed.params[0].device)
        for cid in range(fed.rank, fed.num_clients, fed.world_size):
            rows = fed.data.client_indices[cid]
            if not len(rows):
                continue
            with fed.personalize(cid) as own:
                if own:
                    value = h.value([p.detach() for p in fed.params]).double()
                    out[cid] = torch.stack([fed.eval_loss_tensor(rows), value, value.new_ones(())])
        fed.all_reduce_(out)
        return out.cpu()


def personal_objective(fed: FederationView, h: Regularizer, f: Tensor, h_w: float) -> tuple[float, Tensor]:
    """``(train/personal_objective, per-client h(theta_j))`` from :func:`personal_terms`; ``f``: the ``(N,)``
    :math:`f_j(w)` (:func:`client_train_losses`), ``h_w``: :math:`h(w)`."""
    if not fed.parts_with("personalize"):
        return float(f.mean()) + h_w, torch.full_like(f, h_w)
    terms = personal_terms(fed, h)
    own = terms[:, 2] > 0
    h_j = torch.where(own, terms[:, 1], torch.full_like(f, h_w))
    return float((torch.where(own, terms[:, 0], f) + h_j).mean()), h_j


def split_objective(fed: FederationView, data: ClientRows, h_j: Tensor) -> float:
    """:math:`\\operatorname{mean}_j \\hat f_j(\\theta_j) + h(\\theta_j)` over the clients with rows in ``data``
    (:meth:`~flx.federation.Federation.evaluate_clients` with the task loss)."""
    per_client = fed.evaluate_clients(data, fed.loss_fn)
    has = ~torch.isnan(per_client)
    return float((per_client[has] + h_j[has]).mean()) if bool(has.any()) else math.nan


class Objective(FederatedCallback):
    """Logs ``train/h``, ``train/objective``, ``train/personal_objective`` and ``{split}/personal_objective`` (see the
    module docstring).

    Args:
        regularizer: the ``algo.regularizer`` mapping of :math:`h` (``name``, ``mu``, ``params``, options).
    """

    traits = PartTraits(uploads={})  # evaluation only (its metrics: set in __init__ and check)

    def __init__(self, regularizer: Mapping[str, Any] | None = None) -> None:
        self.h = make_regularizer(regularizer)
        self.bound = False
        self._fed: FederationView | None = None  # set by on_attach
        self.splits: tuple[str, ...] = ("val", "test")  # the splits with per-client rows (check)
        self._declare()

    def _declare(self) -> None:
        own = tuple(f"{s}/personal_objective" for s in self.splits)
        self.traits = PartTraits(uploads={}, metrics=("train/h", "train/objective", "train/personal_objective", *own))

    @override
    def check(self, build: Build) -> None:
        if build.datamodule is not None:  # a federation built directly evaluates every split it is given
            self.splits = tuple(s for s in ("val", "test") if build.datamodule.has_client_rows(s))
            self._declare()

    @override
    def on_attach(self, fed: FederationView) -> None:
        self._fed = fed  # read in Lightning's evaluation hooks

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log("val", trainer, pl_module)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log("test", trainer, pl_module)

    def _log(self, stage: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fed = self._fed
        if trainer.sanity_checking or fed is None or fed.rnd is None:
            return
        if not self.bound:
            self.h.bind(fed.net)
            self.bound = True
        f = client_train_losses(fed)
        h_w = float(self.h.value([p.detach().double() for p in fed.params]))
        personal, h_j = personal_objective(fed, self.h, f, h_w)
        values = {"train/h": h_w, "train/objective": float(f.mean()) + h_w, "train/personal_objective": personal}
        dm = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector, undeclared
        for split in dict.fromkeys(loader.split for loader in dm.eval_plan(stage)):
            if dm.has_client_rows(split):
                data = dm.client_eval_data(split).to(fed.params[0].device, fed.params[0].dtype)
                values[f"{split}/personal_objective"] = split_objective(fed, data, h_j)
        pl_module.log_dict(values, sync_dist=True, add_dataloader_idx=False)
