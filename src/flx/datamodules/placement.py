"""Where the training store lives during a run: on the net's device, or in pinned host memory when it does not fit.

The rule (docs/loop.md, "Devices"): at fit start the store (inputs, targets) and every client's row indices go to
the net's device when the store takes at most :data:`DEVICE_STORE_FRACTION` of the device's free memory; each
minibatch is then a gather on the device. A larger store stays on the host, in page-locked memory, as
:class:`HostRows`: a minibatch is gathered on the host into a pinned buffer and copied to the device without
blocking the host (the row indices stay on the host with it). On the CPU nothing moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from flx.datamodules.ragged import Ragged

DEVICE_STORE_FRACTION = 0.5
"""The share of a GPU's free memory (at fit start) the training store may take there; the rest is left to the model,
its activations and the optimizer."""


def fits_on(device: torch.device, nbytes: int) -> bool:
    """Whether a store of ``nbytes`` goes to ``device``: always on the CPU and on devices other than CUDA; on CUDA
    when it takes at most :data:`DEVICE_STORE_FRACTION` of the free memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= DEVICE_STORE_FRACTION * free


class HostRows:
    """A store tensor kept on the host for a net on ``device``: ``self[rows]`` is ``host[rows]`` on ``device``.

    The rows are gathered into a page-locked buffer (``pin``: on CUDA) and copied with ``non_blocking=True``, so the
    host goes on drawing the next minibatch while the copy runs; torch's pinned-memory allocator keeps the buffer until
    the copy is done. Row indices may be on any device (a device index costs a copy to the host).

    Args:
        host: ``(N, ...)`` the tensor, on the CPU.
        device: where the minibatches go.
        pin: page-lock the tensor and the gather buffers (default: on CUDA).
    """

    index_device = torch.device("cpu")
    """Where row indices into this store live (a tensor's own device for a store on the device)."""

    def __init__(self, host: Tensor, device: torch.device, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin
        self.host = host.pin_memory() if self.pin else host

    @property
    def shape(self) -> torch.Size:
        return self.host.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.host.dtype

    def __len__(self) -> int:
        return len(self.host)

    def is_floating_point(self) -> bool:
        return self.host.is_floating_point()

    def __getitem__(self, rows: Tensor) -> Tensor:
        flat = rows.reshape(-1).cpu()
        buffer = torch.empty((len(flat), *self.host.shape[1:]), dtype=self.host.dtype, pin_memory=self.pin)
        torch.index_select(self.host, 0, flat, out=buffer)
        return buffer.to(self.device, non_blocking=self.pin).view(*rows.shape, *self.host.shape[1:])


def index_bytes(rows: Sequence[Tensor]) -> int:
    """The bytes of per-client int64 row indices (a :class:`Ragged`'s without making its views)."""
    return 8 * (len(rows.values) if isinstance(rows, Ragged) else sum(len(r) for r in rows))


def rows_on(rows: Sequence[Tensor], device: torch.device) -> Ragged[Tensor]:
    """Per-client row indices as one :class:`Ragged` on ``device``: one flat copy, not one tensor per client."""
    if isinstance(rows, Ragged):
        return rows.to(device)
    flat = [torch.as_tensor(r, dtype=torch.long).cpu() for r in rows]
    values = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long)
    return Ragged.from_sizes(values, [len(r) for r in flat]).to(device)
