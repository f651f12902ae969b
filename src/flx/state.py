"""Per-client persistent state store (CPU- or disk-resident) and the explicit server state.

Per-client state (duals, personal models, moving averages, Fisher history) never lives as one model copy
per client on the accelerator: parts ``get`` a client's tensors when the client starts and ``put`` them
back when it ends. The store is checkpointed with the Lightning checkpoint at round boundaries.

In memory a client costs its tensors' bytes plus ~0.7-0.9 KB (measured; docs/state_and_resume.md): its tensors are
packed into one flat CPU buffer per dtype, and the names, shapes and dtypes (the layout, the same for every client of a
part) are kept once for the store, not per client.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

ClientState = dict[str, Tensor]


@dataclass(frozen=True)
class _Layout:
    """How one flat buffer per dtype unpacks into a client's named tensors (shared by the clients that use it)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]  # the buffers' dtypes, in buffer order
    slots: tuple[tuple[int, int, int], ...]  # per name: (buffer index, start, numel)

    @staticmethod
    def of(state: ClientState) -> tuple:
        return tuple((name, tuple(t.shape), t.dtype) for name, t in state.items())

    @classmethod
    def build(cls, key: tuple) -> _Layout:
        dtypes = tuple(dict.fromkeys(dtype for _, _, dtype in key))
        fill = [0] * len(dtypes)
        slots = []
        for _, shape, dtype in key:
            b, n = dtypes.index(dtype), int(torch.Size(shape).numel())
            slots.append((b, fill[b], n))
            fill[b] += n
        return cls(tuple(k[0] for k in key), tuple(torch.Size(k[1]) for k in key), dtypes, tuple(slots))

    def pack(self, state: ClientState) -> tuple[Tensor, ...]:
        """One new flat CPU buffer per dtype holding ``state``'s tensors (one host copy per dtype)."""
        groups: list[list[Tensor]] = [[] for _ in self.dtypes]
        for (b, _, _), t in zip(self.slots, state.values()):
            groups[b].append(t.detach().reshape(-1))
        # torch.cat makes a new tensor (moved to the CPU when it is on a device); a lone tensor is copied
        return tuple(torch.cat(g).to("cpu") if len(g) > 1 else g[0].to("cpu", copy=True) for g in groups)

    def unpack(self, buffers: tuple[Tensor, ...]) -> ClientState:
        """Views of ``buffers`` under the client's names and shapes."""
        return {
            name: buffers[b].narrow(0, start, n).view(shape)
            for name, shape, (b, start, n) in zip(self.names, self.shapes, self.slots)
        }


class ClientStateStore:
    """Maps ``client_id -> {name: tensor}``; tensors are kept on the CPU (``backend="memory"``) or on disk.

    Args:
        backend: ``"memory"`` (default) or ``"disk"`` (one file per client under ``directory``).
        directory: where ``"disk"`` keeps its files.
    """

    def __init__(self, backend: str = "memory", directory: str | None = None) -> None:
        if backend not in ("memory", "disk"):
            raise ValueError(f"state store backend={backend!r}: allowed 'memory' or 'disk'")
        if backend == "disk" and not directory:
            raise ValueError("state store backend='disk' needs a directory")
        self.backend = backend
        self.directory = directory
        self._layouts: dict[tuple, _Layout] = {}
        self._mem: dict[int, tuple[_Layout, tuple[Tensor, ...]]] = {}
        self._on_disk: set[int] = set()

    def bind_rank(self, rank: int, world_size: int) -> None:
        """Under N processes each rank keeps a full copy; on disk, in its own sub-folder."""
        if self.backend == "disk" and world_size > 1 and not str(self.directory).endswith(f"rank{rank}"):
            self.directory = os.path.join(str(self.directory), f"rank{rank}")

    def __contains__(self, cid: int) -> bool:
        return cid in self._mem or cid in self._on_disk

    def __len__(self) -> int:
        return len(self._mem) + len(self._on_disk)

    def client_ids(self) -> list[int]:
        return sorted(set(self._mem) | self._on_disk)

    def nbytes(self) -> int:
        """The bytes of client state held: the tensors' bytes in memory, the files' sizes on disk."""
        if self.backend == "disk":
            return sum(os.path.getsize(self._path(cid)) for cid in self._on_disk)
        return sum(buf.nbytes for _, buffers in self._mem.values() for buf in buffers)

    def _path(self, cid: int) -> str:
        return os.path.join(str(self.directory), f"client_{cid}.pt")

    def _stored(self, cid: int) -> ClientState:
        """The stored tensors themselves (views of the packed buffers in memory), or {} for a client never seen."""
        if self.backend == "disk":
            return torch.load(self._path(cid), weights_only=True) if cid in self._on_disk else {}
        if cid not in self._mem:
            return {}
        layout, buffers = self._mem[cid]
        return layout.unpack(buffers)

    def get(self, cid: int, device: torch.device | str = "cpu") -> ClientState:
        """A copy of the client's state on ``device`` (empty dict for a client never seen)."""
        if self.backend == "memory" and cid in self._mem:
            layout, buffers = self._mem[cid]
            return layout.unpack(tuple(buf.to(device, copy=True) for buf in buffers))
        return {k: v.to(device, copy=True) for k, v in self._stored(cid).items()}

    def put(self, cid: int, state: ClientState) -> None:
        """Stores a copy of ``state`` (a new buffer: tensors handed out earlier, or saved, never change)."""
        if self.backend == "disk":
            os.makedirs(str(self.directory), exist_ok=True)
            torch.save({k: v.detach().to("cpu", copy=True) for k, v in state.items()}, self._path(cid))
            self._on_disk.add(cid)
            return
        key = _Layout.of(state)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout.build(key)
        self._mem[cid] = (layout, layout.pack(state))

    def state_dict(self) -> dict[str, Any]:
        """Every client's tensors on the CPU; in memory these are views of the stored buffers, not copies (``put``
        replaces a client's buffers and never writes into them, so a checkpoint written later sees these values)."""
        return {"clients": {cid: self._stored(cid) for cid in self.client_ids()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._mem.clear()
        self._on_disk.clear()
        for cid, s in state["clients"].items():
            self.put(int(cid), s)


@dataclass
class ServerState:
    """What the server carries from round to round besides the global model (which is the module's net).

    Server-side quantities of a part (lambda, merged buffers, ...) are the part's own ``state_dict``,
    saved by Lightning with the callback.

    Attributes:
        round: rounds completed.
        optimizer: the server optimizer's ``state_dict``.
    """

    round: int = 0
    optimizer: dict[str, Any] = field(default_factory=dict)
