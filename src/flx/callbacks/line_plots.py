"""``LinePlots``: chosen metrics over the rounds, drawn as W&B line plots when fit ends.

W&B charts each logged key on its own; a person comparing keys (FeDXL's AUROC with its partial AUROCs, pFedFBE's or
AugFL's personalised accuracy with the global model's) would rather look at them in one chart. Each plot is a name
and a list of keys: the callback records the keys' values of every round (as
:class:`~flx.callbacks.curves.RoundCurves` does: the round's value, 1-based; evaluation keys on validated rounds
only) and at the end of fit draws ``plots/<name>``, a ``wandb.plot.line_series`` with one line per key that was
logged (none: no plot). Only with a W&B logger (else it records nothing); the history is in its ``state_dict``, each
round in the checkpoint written at its end (:class:`~flx.callbacks.curves.RoundRecorder`), so a resumed run draws
every round.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from flx.callbacks.curves import RoundRecorder, record_round
from flx.wandb_logging import log_line_series, wandb_loggers


class LinePlots(RoundRecorder):
    """Line plots of logged keys over the rounds on W&B (see the module doc).

    Args:
        plots: ``{name: [key, ...]}``; the chart ``plots/<name>`` has a line per key.
        titles: optional chart titles by name (default: the name).
        require: optional keys by name: the plot is drawn only if one of them was logged (``personal_vs_global``
            needs a personalised accuracy; without one it would only repeat the global model's curve).
    """

    def __init__(
        self,
        plots: dict[str, list[str]],
        titles: dict[str, str] | None = None,
        require: dict[str, list[str]] | None = None,
    ) -> None:
        self.plots = {name: list(keys) for name, keys in plots.items()}
        self.titles, self.require = dict(titles or {}), {k: list(v) for k, v in (require or {}).items()}
        self.history: dict[str, list[tuple[int, float]]] = {}

    @override
    def _record(self, trainer: pl.Trainer, rnd: int) -> None:
        if wandb_loggers(trainer):
            record_round(self.history, trainer, dict.fromkeys(k for keys in self.plots.values() for k in keys), rnd)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.fast_dev_run:
            return
        for name, keys in self.plots.items():
            if name in self.require and not any(self.history.get(k) for k in self.require[name]):
                continue
            series = {key: self.history.get(key, []) for key in keys}
            log_line_series(trainer, f"plots/{name}", series, self.titles.get(name, name))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {k: [tuple(p) for p in v] for k, v in state_dict.get("history", {}).items()}
