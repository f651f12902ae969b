r"""Per-client training loss of the global model on evaluation rounds: the objective DRFA minimises.

Deng, Kamani, Mahdavi, "Distributionally Robust Federated Averaging", NeurIPS 2020. DRFA solves :math:`\min_w
\max_{\lambda \in \Lambda} \sum_i \lambda_i f_i(w)` (Eq. 2); over the simplex
the inner maximum is :math:`\Phi(w) = \max_i f_i(w)`, so the worst client's training loss is the objective itself:

.. math::
    f_i(w) = \frac{1}{n_i} \sum_{r \in D_i} \ell(w; x_r, y_r), \qquad
    \texttt{train/client\_loss\_max} = \max_i f_i(w^{t+1}), \qquad
    \texttt{train/client\_loss\_mean} = \frac{1}{N} \sum_{i=1}^{N} f_i(w^{t+1})

with :math:`D_i` client :math:`i`'s training rows, :math:`\ell` the training loss (``loss_fn``) and
:math:`w^{t+1}` the global model after the round, evaluated in eval mode (no dropout, no BatchNorm update) on every
round that Lightning validates (``eval_every``). The mean is unweighted over clients (each client one entry of
:math:`\lambda`), not over samples. Under N processes the clients are split over the ranks (client ``i`` on rank
``i mod N``) and the ``(N,)`` loss vector is summed with one reduce, so every rank logs the same numbers. That reduce
is an evaluation collective, on validated rounds only, like the per-client evaluation's: the losses of
:math:`w^{t+1}` exist only after the round's own all-reduce, so they cannot ride in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from flx.errors import check_fields
from flx.evaluation import client_losses
from flx.hooks import FederatedCallback
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import FederationView


@dataclass(frozen=True)
class ClientLossParams:
    """``enabled``: log the per-client training losses (``algo.client_loss``)."""

    enabled: bool = True


@torch.no_grad()
def client_train_losses(fed: FederationView) -> Tensor:
    """``f_i`` of the net's current model on each client's full training rows: a ``(N,)`` float64 tensor on CPU.

    Every rank computes its share of the clients, batched across them (:func:`flx.evaluation.client_losses`: a
    forward pass covers many clients' rows), and one sum over the ranks fills the rest, so all ranks return the same
    vector; call it on every rank.
    """
    out = torch.zeros(fed.num_clients, dtype=torch.float64, device=fed.params[0].device)
    for cid, loss in client_losses(fed, range(fed.rank, fed.num_clients, fed.world_size)).items():
        out[cid] = loss
    fed.all_reduce_(out)
    return out.cpu()


class ClientLoss(FederatedCallback):
    """Logs ``max_i f_i`` and ``mean_i f_i`` of the global model after each validated round."""

    traits = PartTraits(uploads={})  # measured on the server for the researcher (its metrics: set in __init__)

    def __init__(self, enabled: bool = True) -> None:
        self.params = ClientLossParams(enabled)
        check_fields(self.params, "algo.", {"enabled": "algo.client_loss"})
        self.last: Tensor | None = None  # the latest (N,) vector, for inspection
        metrics = ("train/client_loss_max", "train/client_loss_mean") if self.params.enabled else ()
        self.traits = PartTraits(uploads={}, metrics=metrics)
        self._fed: FederationView | None = None  # the federation of on_attach, read in Lightning's hooks

    @override
    def on_attach(self, fed: FederationView) -> None:
        self._fed = fed

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fed = self._fed
        # fed.rnd is None until the first round: a validation before any round has no global model to report on
        if not self.params.enabled or trainer.sanity_checking or fed is None or fed.rnd is None:
            return
        self.last = f = client_train_losses(fed)
        # identical on every rank after the sum; sync_dist only silences Lightning's distributed-logging advice
        pl_module.log_dict({"train/client_loss_max": f.max(), "train/client_loss_mean": f.mean()}, sync_dist=True)
