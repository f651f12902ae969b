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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from flx.callbacks.client_loss import client_train_losses
from flx.hooks import FederatedCallback
from flx.regularizers import Regularizer, make_regularizer

if TYPE_CHECKING:
    from flx.federation import Federation


@torch.no_grad()
def composite_objective(fed: Federation, h: Regularizer) -> tuple[float, float]:
    """``(mean_i f_i(w), h(w))`` of the net's current model; ``h`` bound to ``fed.net``. Call it on every rank."""
    value = float(h.value([p.detach().double() for p in fed.params]))
    return float(client_train_losses(fed).mean()), value


class Objective(FederatedCallback):
    """Logs ``train/h`` and ``train/objective`` (see the module docstring).

    Args:
        regularizer: the ``algo.regularizer`` mapping of :math:`h` (``name``, ``mu``, ``params``, options).
    """

    def __init__(self, regularizer: Mapping[str, Any] | None = None) -> None:
        self.h = make_regularizer(regularizer)
        self.bound = False

    @override
    def metric_names(self) -> tuple[str, ...]:
        return ("train/h", "train/objective")

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        fed = getattr(pl_module, "federation", None)
        if trainer.sanity_checking or fed is None or fed.rnd is None:
            return
        if not self.bound:
            self.h.bind(fed.net)
            self.bound = True
        f, h = composite_objective(fed, self.h)
        pl_module.log_dict({"train/h": h, "train/objective": f + h}, sync_dist=True)
