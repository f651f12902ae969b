"""What the two privacy parts share: their common ``privacy.*`` keys and their checks (:class:`BudgetParams`), and
after each round ``privacy/epsilon`` in the logs, the budget's stop, epsilon in the final line (:class:`Budgeted`;
:mod:`flx.parts.privacy.central_dp`, :mod:`flx.parts.privacy.local_dp`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from typing_extensions import override

from flx import privacy
from flx.clipping import CLIP_MODES
from flx.errors import bad_value, check_fields
from flx.hooks import FederatedCallback
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import FederationView, Round


@dataclass(frozen=True)
class BudgetParams:
    """The ``privacy.*`` keys both modes have: the clip (what it bounds differs: a client's update, or a row's
    gradient), the noise or the budget that calibrates it, and the accountant's settings."""

    clip: float = 1.0
    clip_mode: str = "flat"
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    sampling: str = "poisson"
    accountant: str = "pld"

    def check(self, clipped: str) -> None:
        """One line for a bad value (:class:`flx.errors.ConfigError`); ``clipped`` says what the clip bounds. The
        values of every field (the subclass's too) are checked for their types first: finite numbers, booleans."""
        check_fields(self, "privacy.")
        if not self.clip > 0:
            raise bad_value("privacy.clip", self.clip, f"the L2 clip of {clipped}, > 0")
        if self.clip_mode not in CLIP_MODES:
            raise bad_value("privacy.clip_mode", self.clip_mode, f"allowed: {', '.join(CLIP_MODES)}")
        keys = (self.noise_multiplier, self.target_epsilon, self.delta, self.sampling, self.accountant)
        privacy.check_budget_keys(*keys)

    def budget(self) -> float:
        """``target_epsilon``, which calibrates the noise when no ``noise_multiplier`` is given."""
        if self.target_epsilon is None:
            raise bad_value("privacy.target_epsilon", None, "a budget, or set privacy.noise_multiplier")
        return self.target_epsilon


class Budgeted(FederatedCallback):
    """A privacy part with a ledger: logs :meth:`logged` every round and, with ``params.target_epsilon`` set, refuses
    a round (:meth:`refuse_round`, before it runs: the first of a fresh run, of a resumed, requeued or extended one
    alike) whose :meth:`after` epsilon would pass the budget. Subclasses keep ``params`` (a :class:`BudgetParams`) and
    ``rounds`` (the rounds accounted) and give :meth:`spent` and :meth:`after`."""

    traits = PartTraits(uploads={}, metrics=("privacy/epsilon",))  # what the two modes declare in common
    params: BudgetParams
    rounds: int
    rounds_run: int = 0  # the rounds the run has run (rnd.round + 1 after each): all private when equal to rounds

    def spent(self) -> float:
        """:math:`\\varepsilon` at ``privacy.delta`` spent so far."""
        raise NotImplementedError

    def after(self, fed: FederationView, rnd: Round) -> tuple[float, str]:
        """The epsilon once the planned round ``rnd`` (its draws known) has run, and how the stop says so, a
        template with ``{eps}``: ``"would spend {eps}"``, or ``"could spend {eps} for client 3"``."""
        raise NotImplementedError

    def logged(self) -> dict[str, float]:
        """What the part logs every round (the keys ``traits.metrics`` gives)."""
        return {"privacy/epsilon": self.spent()}

    @override
    def refuse_round(self, fed: FederationView, rnd: Round) -> str | None:
        budget = self.params.target_epsilon
        if budget is None:
            return None
        epsilon, how = self.after(fed, rnd)
        if epsilon <= budget:
            return None
        return (
            f"privacy budget: round {rnd.round + 1} {how.format(eps=f'epsilon={epsilon:.4f}')} > "
            f"privacy.target_epsilon={budget:g} (delta={self.params.delta:g}): the budget is spent, the run ends with "
            f"the {rnd.round} round(s) it ran (epsilon={self.spent():.4f})"
        )

    @override
    def on_round_end(self, fed: FederationView, rnd: Round) -> None:
        self.rounds += 1
        self.rounds_run = rnd.round + 1

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log_dict(self.logged(), on_epoch=True)

    @override
    def final_values(self) -> dict[str, float | str]:
        """``epsilon`` and ``private``: ``all`` when the ledger holds every round the run ran, else ``k/n``."""
        private = "all" if self.rounds == self.rounds_run else f"{self.rounds}/{self.rounds_run}"
        return {"epsilon": self.spent(), "private": private}
