"""What the two privacy parts share: their common ``privacy.*`` keys and their checks (:class:`BudgetParams`), and
after each round ``privacy/epsilon`` in the logs, the budget's stop, epsilon in the final line (:class:`Budgeted`;
:mod:`flx.parts.central_dp`, :mod:`flx.parts.local_dp`)."""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
from typing_extensions import override

from flx import privacy
from flx.clipping import CLIP_MODES
from flx.errors import bad_value, check_fields
from flx.hooks import FederatedCallback


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


class Budgeted(FederatedCallback):
    """A privacy part with a ledger: logs :meth:`logged` every round and, with ``params.target_epsilon`` set, stops
    the run (one line) before a round whose :meth:`upcoming` epsilon would pass it. Subclasses keep ``params`` (a
    :class:`BudgetParams`) and ``rounds`` (the rounds accounted) and give :meth:`spent`."""

    params: BudgetParams
    rounds: int

    def spent(self) -> float:
        """:math:`\\varepsilon` at ``privacy.delta`` spent so far."""
        raise NotImplementedError

    def upcoming(self) -> tuple[float, str]:
        """The epsilon the next round would (or could) reach, and how the stop says so, a template with ``{eps}``:
        ``"would spend {eps}"``, or ``"could spend {eps} for client 3"``."""
        raise NotImplementedError

    def logged(self) -> dict[str, float]:
        """What the part logs every round (the keys :meth:`metric_names` gives)."""
        return {"privacy/epsilon": self.spent()}

    @override
    def metric_names(self) -> tuple[str, ...]:
        return ("privacy/epsilon",)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pl_module.log_dict(self.logged(), on_epoch=True)
        budget = self.params.target_epsilon
        if budget is None or trainer.should_stop or self.rounds >= (trainer.max_epochs or 0):
            return
        epsilon, how = self.upcoming()
        if epsilon > budget:
            trainer.should_stop = True
            if trainer.is_global_zero:
                print(
                    f"flx: privacy budget: round {self.rounds + 1} {how.format(eps=f'epsilon={epsilon:.4f}')} > "
                    f"privacy.target_epsilon={budget:g} (delta={self.params.delta:g}); stopped after round "
                    f"{self.rounds} at epsilon={self.spent():.4f}",
                    flush=True,
                )

    @override
    def final_values(self) -> dict[str, float]:
        return {"epsilon": self.spent()}
