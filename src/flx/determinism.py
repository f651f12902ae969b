"""Deterministic runs on CUDA (``trainer.deterministic=true``): what CUDA needs set before it starts.

Lightning's ``deterministic=True`` calls ``torch.use_deterministic_algorithms(True)`` (``"warn"``: warn-only) and sets
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, overwriting a value the user chose. cuBLAS reads that variable when its first
handle is made (the first matrix product on the GPU) and is bitwise repeatable only with a fixed workspace
(``:4096:8`` or ``:16:8``: NVIDIA, cuBLAS documentation, "Results reproducibility"); cuDNN picks its convolution
algorithms by benchmark unless told not to. :func:`cuda_determinism` sets all of it around the Trainer's construction,
before anything runs on the GPU: the user's ``CUBLAS_WORKSPACE_CONFIG`` is kept (``:16:8`` uses less memory),
``:4096:8`` is the default, cuDNN is deterministic and not benchmarked.

The one op of flx's own nets without a deterministic CUDA kernel, ``AdaptiveAvgPool2d``'s backward (ResNet's global
pool), is computed as a mean under deterministic mode on CUDA (:class:`flx.models.resnet_cifar.GlobalAvgPool`); the
other accumulating ops flx uses on the device (``index_add_``, ``index_copy``, ``scatter_add_``, ``gather``) have
deterministic CUDA kernels that ``torch.use_deterministic_algorithms`` selects. docs/loop.md, "Devices".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DEFAULT = ":4096:8"


def wants_determinism(setting: Any) -> bool:
    """Whether ``trainer.deterministic`` asks for deterministic algorithms (``true`` or ``"warn"``)."""
    return setting is True or setting == "warn"


@contextmanager
def cuda_determinism(setting: Any) -> Iterator[None]:
    """Around the Trainer's construction: with ``trainer.deterministic`` on, ``CUBLAS_WORKSPACE_CONFIG`` (the user's
    value, else ``:4096:8``) and cuDNN deterministic without benchmarking; nothing otherwise.

    Args:
        setting: ``trainer.deterministic`` (``true``, ``false``, ``"warn"`` or None).
    """
    if not wants_determinism(setting):
        yield
        return
    chosen = os.environ.get(CUBLAS_ENV) or CUBLAS_DEFAULT
    if torch.cuda.is_initialized() and CUBLAS_ENV not in os.environ:
        print(
            f"flx: warning: CUDA started before trainer.deterministic could set {CUBLAS_ENV}; set it in the "
            f"environment ({CUBLAS_ENV}={CUBLAS_DEFAULT}) for bitwise-repeatable matrix products",
            file=sys.stderr,
            flush=True,
        )
    os.environ[CUBLAS_ENV] = chosen
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        os.environ[CUBLAS_ENV] = chosen  # Lightning writes :4096:8 over the user's value
