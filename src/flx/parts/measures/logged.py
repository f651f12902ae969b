"""``LoggedMetrics``: a part that logs a few numbers of the current global model at every validation and test."""

from __future__ import annotations

import lightning.pytorch as pl
from typing_extensions import override

from flx.context import FederationView
from flx.hooks import FederatedCallback
from flx.traits import PartTraits


class LoggedMetrics(FederatedCallback):
    """Subclasses give :meth:`values`; each is logged as ``{split}/<key>`` (``val`` at each validation, ``test`` at
    the test), never during Lightning's sanity check. The values are of the federation the part was attached to
    (:meth:`on_attach`)."""

    # evaluation only (nothing sent); any key under each split, ``{split}/*``: a subclass that knows its keys names them
    traits = PartTraits(uploads={}, metrics=("{split}/*",))
    _fed: FederationView | None = None

    def values(self, fed: FederationView) -> dict[str, float]:
        raise NotImplementedError

    @override
    def on_attach(self, fed: FederationView) -> None:
        self._fed = fed

    def _log(self, split: str, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        if self._fed is None:  # a subclass's on_attach that does not call this one's
            raise RuntimeError(f"{type(self).__name__}: evaluated before on_attach gave it the federation")
        for key, value in self.values(self._fed).items():
            pl_module.log(f"{split}/{key}", value, add_dataloader_idx=False)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log("val", trainer, pl_module)

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log("test", trainer, pl_module)
