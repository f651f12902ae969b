"""``--whatif``: the suggested flx fixes applied as runtime patches, to measure their gain before they land.

No flx file is edited: each patch replaces a method on the class for this process only. Once a fix is in flx
its patch is redundant (harmless), and the plain ``make bench`` numbers already include it.

* ``seed``: ``Federation.make_client`` seeds the CPU generator with ``torch.default_generator.manual_seed``
  instead of ``torch.manual_seed``. On a CUDA build of torch without an initialised CUDA context,
  ``torch.manual_seed`` queues a lazy CUDA seed and records ``traceback.format_stack()`` each call; under
  Lightning's ~60-frame stack that is ~0.5 ms per client. (With CUDA in use, seed that device's generator too.)
* ``log``: ``FederatedModule`` logs ``train/loss`` once per round (the mean of the clients' losses, what
  ``self.log(..., on_epoch=True, batch_size=1)`` per client produced) instead of calling ``self.log`` per client
  (each call costs ~0.4 ms: Lightning moves the result entry with ``apply_to_collection`` on every call).
* ``xfer``: ``FederatedModule.transfer_batch_to_device`` returns the client id as is (an int needs no transfer;
  Lightning otherwise walks it with ``apply_to_collection``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flx.federation import ClientContext, Federation
from flx.models.module import FederatedModule


def _cheap_seed(seed: int) -> torch.Generator:
    return torch.default_generator.manual_seed(int(seed))


def patch_seed() -> None:
    orig = Federation.make_client

    def make_client(self: Federation, cid: int) -> ClientContext:
        saved, torch.manual_seed = torch.manual_seed, _cheap_seed
        try:
            return orig(self, cid)
        finally:
            torch.manual_seed = saved

    Federation.make_client = make_client


def patch_log() -> None:
    orig_log, orig_end = FederatedModule.log, FederatedModule.on_train_epoch_end

    def log(self: FederatedModule, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if name == "train/loss" and kwargs.get("on_epoch") and not kwargs.get("on_step"):
            self.__dict__.setdefault("_whatif_losses", []).append(value.detach())
            return
        orig_log(self, name, value, *args, **kwargs)

    def on_train_epoch_end(self: FederatedModule) -> None:
        orig_end(self)
        losses = self.__dict__.pop("_whatif_losses", [])
        if losses:
            orig_log(self, "train/loss", torch.stack(losses).mean(), sync_dist=True)

    FederatedModule.log = log
    FederatedModule.on_train_epoch_end = on_train_epoch_end


def patch_xfer() -> None:
    orig = FederatedModule.transfer_batch_to_device

    def transfer_batch_to_device(self: FederatedModule, batch: Any, device: torch.device, idx: int) -> Any:
        return batch if isinstance(batch, int) else orig(self, batch, device, idx)

    FederatedModule.transfer_batch_to_device = transfer_batch_to_device


PATCHES: dict[str, Callable[[], None]] = {"seed": patch_seed, "log": patch_log, "xfer": patch_xfer}


def apply(names: list[str]) -> None:
    """Applies the named patches (see the module docstring)."""
    unknown = [n for n in names if n not in PATCHES]
    if unknown:
        raise SystemExit(f"--whatif: unknown patch(es) {unknown}; allowed: {', '.join(PATCHES)}")
    for name in names:
        PATCHES[name]()
