"""A test-only second device on the CPU: tensors that report ``meta`` as their device but hold real CPU values.

Under :class:`FakeDevice` (a ``TorchDispatchMode``), a ``.to("meta")`` moves a tensor to the fake device (a wrapper
subclass around a CPU tensor); every op on fake-device tensors runs on their CPU values and returns fake-device
tensors, factories called with ``device="meta"`` make them, and an op that mixes a fake-device tensor with a host
tensor of one or more dimensions raises :class:`DeviceMismatch`, as CUDA would (a 0-dim host tensor is allowed, as
CUDA allows CPU scalars). Copies between the devices are counted (``to_host``, ``to_device``), and so are host syncs
(``aten._local_scalar_dense``: what ``.item()``, ``float()``, ``bool()`` and ``.tolist()`` of a device tensor cost).
Row indices and CPU generators meet the device only through explicit copies, so a forgotten ``device=`` or a host
index into the store fails here exactly where it would cost a sync or fail on a GPU.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

FAKE = torch.device("meta")
aten = torch.ops.aten
_MOVES = (aten._to_copy.default, aten.copy_.default)


class DeviceMismatch(RuntimeError):
    """A fake-device tensor met a host tensor in one op."""


class OnDevice(Tensor):
    """A CPU tensor ``elem`` that reports the fake device."""

    elem: Tensor

    @staticmethod
    def __new__(cls, elem: Tensor) -> OnDevice:
        return Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            device=FAKE,
            requires_grad=elem.requires_grad,
        )

    def __init__(self, elem: Tensor) -> None:
        self.elem = elem

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        raise RuntimeError(f"{func}: fake-device tensors need the FakeDevice mode")


def _wants_fake(kwargs: dict[str, Any]) -> bool:
    dev = kwargs.get("device")
    return dev is not None and torch.device(dev).type == FAKE.type


class FakeDevice(TorchDispatchMode):
    """Runs fake-device ops on the CPU, refuses mixed-device ops, counts syncs and transfers.

    Attributes:
        syncs: ``_local_scalar_dense`` calls on fake-device tensors (host syncs).
        to_host: copies from the fake device to the host.
        to_device: copies from the host to the fake device.
        ops: every op on fake-device tensors, by name.
    """

    def __init__(self) -> None:
        super().__init__()
        self.syncs = self.to_host = self.to_device = 0
        self.ops: Counter[str] = Counter()

    def counts(self) -> tuple[int, int, int]:
        """``(syncs, to_host, to_device)`` so far."""
        return self.syncs, self.to_host, self.to_device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        on_device, host = False, []

        def unwrap(t: Any) -> Any:
            nonlocal on_device
            if isinstance(t, OnDevice):
                on_device = True
                return t.elem
            if isinstance(t, Tensor):
                if t.device.type == FAKE.type:  # made below the dispatcher, e.g. torch.tensor(data, device=...)
                    raise DeviceMismatch(
                        f"{func}: a tensor made on the device without values; make it with a factory "
                        "(torch.full, torch.zeros) or .to(device)"
                    )
                host.append(t)
            return t

        a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        fake_out = _wants_fake(k) if "device" in k and k["device"] is not None else on_device
        if fake_out and "device" in k:
            k["device"] = torch.device("cpu")
        if func in _MOVES:
            self._count_move(func, args, on_device, fake_out)
        elif on_device and any(t.dim() > 0 for t in host):
            shapes = [tuple(t.shape) for t in host if t.dim() > 0]
            raise DeviceMismatch(f"{func}: a device tensor meets host tensors of shapes {shapes}")
        if func is aten._local_scalar_dense.default and on_device:
            self.syncs += 1
        if on_device or fake_out:
            self.ops[str(func)] += 1
        out = func(*a, **k)
        if func is aten.copy_.default:
            return args[0]
        return tree_map(lambda t: OnDevice(t) if fake_out and isinstance(t, Tensor) else t, out)

    def _count_move(self, func: Any, args: tuple, on_device: bool, fake_out: bool) -> None:
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            to_dev, from_dev = isinstance(dst, OnDevice), isinstance(src, OnDevice)
        else:
            from_dev, to_dev = on_device, fake_out
        if from_dev and not to_dev:
            self.to_host += 1
        elif to_dev and not from_dev:
            self.to_device += 1
