"""Per-client persistent state store (CPU- or disk-resident) and the explicit server state.

Per-client state (duals, personal models, moving averages, Fisher history) never lives as one model copy
per client on the accelerator: parts ``get`` a client's tensors when the client starts and ``put`` them
back when it ends. The store is checkpointed with the Lightning checkpoint at round boundaries.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

ClientState = dict[str, Tensor]


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
        self._mem: dict[int, ClientState] = {}
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

    def _path(self, cid: int) -> str:
        return os.path.join(str(self.directory), f"client_{cid}.pt")

    def get(self, cid: int, device: torch.device | str = "cpu") -> ClientState:
        """A copy of the client's state on ``device`` (empty dict for a client never seen)."""
        if self.backend == "disk":
            raw = torch.load(self._path(cid), weights_only=True) if cid in self._on_disk else {}
        else:
            raw = self._mem.get(cid, {})
        return {k: v.to(device, copy=True) for k, v in raw.items()}

    def put(self, cid: int, state: ClientState) -> None:
        cpu = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        if self.backend == "disk":
            os.makedirs(str(self.directory), exist_ok=True)
            torch.save(cpu, self._path(cid))
            self._on_disk.add(cid)
        else:
            self._mem[cid] = cpu

    def state_dict(self) -> dict[str, Any]:
        return {"clients": {cid: self.get(cid) for cid in self.client_ids()}}

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
