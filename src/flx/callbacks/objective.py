"""The composite objective of the global model: ``F(w) = (1/N) sum_i f_i(w) + h(w)``, logged at every validation.

Federated composite optimisation (pFedFBE digest ``shared/papers/pfedfbe.md`` §1.1; FedMiD, FedDualAvg): ``f_i`` is
the task's loss averaged over client ``i``'s training rows (a mean, not the paper's sum over rows: §5 item 10 and
``task=half_mse``), averaged over the ``N`` clients with equal weights as the paper's ``1/N``; ``h`` is the
algorithm's regulariser (``algo.regularizer``, :mod:`flx.regularizers`). Logged as ``{split}/objective``,
``{split}/smooth`` (the mean of the ``f_i``) and ``{split}/regularizer`` (``h(w)``). Every rank computes the same
numbers from the whole training store, with no collective (cheap for the convex models it is meant for; a full pass
over the training rows for a network).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flx.callbacks.logged import LoggedMetrics
from flx.regularizers import make_regularizer


class Objective(LoggedMetrics):
    """Logs ``F(w) = (1/N) sum_i f_i(w) + h(w)`` of the global model (see the module docstring).

    Args:
        regularizer: the ``algo.regularizer`` config (``null``: ``h = 0``).
    """

    def __init__(self, regularizer: Mapping[str, Any] | None = None) -> None:
        self.reg = make_regularizer(regularizer)
        self.bound = False

    def values(self, fed: Any) -> dict[str, float]:
        """``objective``, ``smooth`` and ``regularizer`` of the net's current model."""
        if not self.bound:
            self.reg.bind(fed.net)
            self.bound = True
        clients = [rows for rows in fed.data.client_indices if len(rows)]
        smooth = sum(fed.eval_loss(rows) for rows in clients) / len(clients)
        h = float(self.reg.value(fed.params))
        return {"objective": smooth + h, "smooth": smooth, "regularizer": h}
