"""The dtype logged values take: float64 in a float64 run, float32 otherwise (Lightning's).

Lightning turns a logged Python number into a tensor of the default dtype, which is float32 outside the precision
plugin's forward context (the epoch-end hooks where flx logs), and torchmetrics keeps its states in the dtype they
were built in when the module is cast to float64. A float64 run (``trainer.precision=64-true``) would so log
``0.8`` as ``0.800000011920929``; :class:`~flx.module.FederatedModule` logs its values, and has its metrics
compute, in :func:`logged_dtype` instead. Other runs log exactly what Lightning logs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

FLOAT64_PRECISIONS = ("64-true", "64")  # Lightning's names of its double-precision plugin


def logged_dtype(trainer: Any) -> torch.dtype:
    """``torch.float64`` when ``trainer`` runs in float64 (``trainer.precision=64-true``), else ``torch.float32``."""
    return torch.float64 if str(getattr(trainer, "precision", "")) in FLOAT64_PRECISIONS else torch.float32


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.get_default_dtype()`` is ``dtype`` inside the block (for library code that makes its tensors in the
    default dtype: torchmetrics' ROC curve); restored on exit."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
