"""``LoggedMetrics``: a part that logs a few numbers of the current global model at every validation and test."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from flx.hooks import FederatedCallback
from flx.traits import PartTraits


class LoggedMetrics(FederatedCallback):
    """Subclasses give :meth:`values`; each is logged as ``{split}/<key>`` (``val`` at each validation, ``test`` at
    the test), never during Lightning's sanity check."""

    # evaluation only (nothing sent); any key under each split, ``{split}/*``: a subclass that knows its keys names them
    traits = PartTraits(uploads={}, metrics=("{split}/*",))

    def values(self, fed: Any) -> dict[str, float]:
        raise NotImplementedError

    def _log(self, split: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        for key, value in self.values(pl_module.federation).items():
            pl_module.log(f"{split}/{key}", value, add_dataloader_idx=False)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log("val", trainer, pl_module)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log("test", trainer, pl_module)
