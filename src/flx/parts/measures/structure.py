"""Structure of the learned model against the ground truth of generated data: support recovery and rank.

pFedFBE §4.1-4.2: for the Lasso, precision, recall, F1 and density of
the support (entries with :math:`|w_k| < \\tau` count as zero, :math:`\\tau = 0.01`); for matrix completion, the rank
(singular values above :math:`\\tau`) and the recovery error :math:`\\|W - W^\\star_j\\|_F`
(:mod:`flx.metrics.sparse`). A per-client truth of shape ``(d,)`` gives the support scores, one of shape ``(d, d)``
the rank and the error.

Measured at every validation and at the test, for

- the global model against every client's truth, averaged over the clients: ``{split}/support_f1``, ...,
  ``{split}/rank``, ``{split}/recovery_error``;
- each client's personalised model (the parts' ``personalize``; the global model when no part personalises, as the
  paper does for methods without personalisation) against its own truth: ``{split}/personal_<metric>_mean``.
  Clients are spread over the ranks and summed with one collective.

The truth comes from the data (:func:`flx.datamodules.pfedfbe_data.client_truth`: ``data=lasso_synthetic`` or
``matrix_completion`` with ``partition=by_group``).
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from typing_extensions import override

from flx.datamodules.pfedfbe_data import client_truth
from flx.errors import bad_value, number_error
from flx.metrics.sparse import THRESHOLD, numerical_rank, recovery_error, support_scores
from flx.parts.measures.logged import LoggedMetrics
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import FederationView
    from flx.hooks import Build

SUPPORT = ("support_precision", "support_recall", "support_f1", "density")
LOW_RANK = ("rank", "recovery_error")


class Structure(LoggedMetrics):
    """Logs the support or rank metrics of the global and the personalised models (see the module docstring).

    Args:
        param: name pattern (``fnmatch`` on ``named_parameters``) of the ONE parameter measured, e.g. ``*weight``.
        threshold: :math:`\\tau`; entries / singular values below it count as zero.
    """

    def __init__(self, param: str = "*weight", threshold: float = THRESHOLD) -> None:
        err = number_error("algo.parts.structure.threshold", threshold)
        if err is not None:
            raise err
        if not threshold > 0:
            raise bad_value("algo.parts.structure.threshold", threshold, "must be > 0")
        self.param, self.threshold = param, float(threshold)
        self.truths: Tensor | None = None
        self._declare()

    def _declare(self) -> None:
        keys = (SUPPORT, LOW_RANK) if self.truths is None else (SUPPORT if self.truths.dim() == 2 else LOW_RANK,)
        names = tuple(f"{{split}}/{p}{k}{s}" for ks in keys for k in ks for p, s in (("", ""), ("personal_", "_mean")))
        self.traits = PartTraits(uploads={}, metrics=names)

    @override
    def check(self, build: Build) -> None:
        if build.datamodule is not None:  # the data's ground truth (a client store alone has none)
            self.truths = client_truth(build.datamodule.data, build.datamodule.client_train).double()
            self._declare()

    def _index(self, fed: FederationView) -> int:
        names = [n for n, p in fed.net.named_parameters() if p.requires_grad]
        hits = [i for i, n in enumerate(names) if fnmatch.fnmatch(n, self.param)]
        if len(hits) != 1:
            raise bad_value("algo.parts.structure.param", self.param, f"must match one of {names}, matched {len(hits)}")
        return hits[0]

    def scores(self, w: Tensor, truth: Tensor) -> list[float]:
        """The metrics of :data:`SUPPORT` (a vector truth) or :data:`LOW_RANK` (a matrix truth) of ``w``."""
        w = w.detach().double().reshape(truth.shape)
        if truth.dim() == 1:
            s = support_scores(w, truth, self.threshold)
            return [s["precision"], s["recall"], s["f1"], s["density"]]
        return [float(numerical_rank(w, self.threshold)), recovery_error(w, truth)]

    def values(self, fed: FederationView) -> dict[str, float]:
        """Every metric of the global model (mean over the clients' truths) and of the personalised models."""
        if self.truths is None:  # no ground truth: a federation built directly from a client store
            return {}
        truths, i = self.truths.to(fed.params[0].device), self._index(fed)
        keys = SUPPORT if truths.dim() == 2 else LOW_RANK
        glob = torch.tensor([self.scores(fed.params[i], t) for t in truths], dtype=torch.float64).mean(0)
        rows = [[0.0] * len(keys) for _ in truths]  # plain floats: the personalised block leaves inference mode
        for cid in range(fed.rank, len(truths), fed.world_size):
            with fed.personalize(cid):
                rows[cid] = self.scores(fed.params[i], truths[cid])
        personal = torch.tensor(rows, dtype=torch.float64, device=fed.params[0].device)
        fed.all_reduce_(personal)
        out = {k: float(v) for k, v in zip(keys, glob)}
        return out | {f"personal_{k}_mean": float(v) for k, v in zip(keys, personal.mean(0).cpu())}
