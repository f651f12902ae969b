"""Random local work: systems heterogeneity as a number of local steps drawn per client and round.

Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020 (arXiv:2007.07481), Section 6 / Figure 1: every round each client runs ``E_i ~ U[2,
5]`` local epochs; Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous Networks"
(FedProx), MLSys 2020 (arXiv:1812.06127), Section 5.2 "systems heterogeneity": devices do variable amounts of local
work. Here every cohort client ``i`` does

.. math::
    \\tau_i^t = r_i^t \\, K_i,\\qquad r_i^t \\sim U\\{lo, \\dots, hi\\}

(``K_i``: its configured work, ``algo.local_steps`` or ``algo.local_epochs`` epochs), ``r_i^t`` drawn from a stream
of ``(seed, round, client)`` only: the same on every rank, after a resume, in the vectorised runner. It is set in
planning (``on_round_start``, :meth:`flx.context.Round.set_steps`), so a part that reads ``fed.client_steps`` (FedNova)
sees it when listed after this one. ``work=None``: nothing changes (no hook work; FedAvg bit for bit).

Departures: the draw multiplies the configured work (the papers draw epochs, ``r_i`` epochs when ``K_i`` is one epoch);
FedProx's stragglers that the FedAvg baseline drops are not dropped here: every client uploads its partial work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from typing_extensions import override

from flx.errors import bad_value, check_fields
from flx.hooks import FederatedCallback
from flx.sampling import derive_seed
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import FederationView, Round

WORK_TAG = 0x4E0A  # the random-work stream, apart from the client's minibatch stream (FedNova's draws, unchanged)


@dataclass(frozen=True)
class RandomWorkParams:
    """``work``: ``[lo, hi]`` integers, 1 <= lo <= hi, or None (the configured work)."""

    work: tuple[int, int] | None = None


def work_factor(seed: int, rnd: int, cid: int, work: tuple[int, int]) -> int:
    """``r_i`` of client ``cid`` in round ``rnd``: uniform on ``{lo, ..., hi}`` from the ``(seed, round, client)``
    stream."""
    rng = np.random.default_rng(derive_seed(seed, rnd, cid, WORK_TAG))
    return int(rng.integers(work[0], work[1] + 1))


class RandomWork(FederatedCallback):
    """Each cohort client does ``r_i ~ U{lo..hi}`` times its configured local work this round."""

    traits = PartTraits(
        uploads={},  # nothing uploaded: it only plans the steps
        steps="data_free",  # no step hook
        vectorizable=True,  # planning only: the stacked runner groups clients by their step counts
    )

    def __init__(self, work: tuple[int, int] | list[int] | None = None) -> None:
        listed = isinstance(work, Sequence) and not isinstance(work, str)  # a list, tuple or Hydra's ListConfig
        span = None if work is None else tuple(work) if listed else (work,)
        if span is not None and not _valid_range(span):
            raise bad_value("algo.random_work", work, "null or [lo, hi], integers with 1 <= lo <= hi")
        self.params = RandomWorkParams(work=span)  # type: ignore[arg-type]
        check_fields(self.params, "algo.")

    @override
    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        work = self.params.work
        if work is None:
            return
        for cid in rnd.cohort:  # r_i times the configured work (read before it is set)
            rnd.set_steps(cid, work_factor(fed.cfg.seed, rnd.round, cid, work) * fed.client_steps(cid))


def _valid_range(work: tuple) -> bool:
    ints = len(work) == 2 and all(isinstance(w, int) and not isinstance(w, bool) for w in work)
    return ints and 1 <= work[0] <= work[1]
