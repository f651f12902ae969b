"""Per-client persistent state store (CPU- or disk-resident) and the explicit server state.

Per-client state (duals, personal models, moving averages, Fisher history) never lives as one model copy
per client on the accelerator: parts ``get`` a client's tensors when the client starts and ``put`` them
back when it ends. The store is checkpointed with the Lightning checkpoint at round boundaries.

In memory a client costs its tensors' bytes plus under a kilobyte (docs/performance.md#memory): its tensors are
packed into one flat CPU buffer per dtype, and the names, shapes and dtypes (the layout, the same for every client of a
part) are kept once for the store, not per client.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

ClientState = dict[str, Tensor]
_FILE = re.compile(r"client_(\d+)\.(\d+)\.pt")  # a disk store's file: client_<cid>.<tag>.pt


def _mkdir(folder: str) -> str:
    os.makedirs(folder, exist_ok=True)
    return folder


def fsync(path: str) -> None:
    """Makes a file (or a folder's entries, e.g. a rename) durable; best effort for folders, which not every file system
    opens or syncs."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if os.path.isdir(path):
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not os.path.isdir(path):
            raise
    finally:
        os.close(fd)


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

    def unpack_packed(self, state: ClientState) -> ClientState:
        """``state`` copied to the host as views of :meth:`pack`'s buffers."""
        return self.unpack(self.pack(state))

    def unpack(self, buffers: tuple[Tensor, ...]) -> ClientState:
        """Views of ``buffers`` under the client's names and shapes."""
        return {
            name: buffers[b].narrow(0, start, n).view(shape)
            for name, shape, (b, start, n) in zip(self.names, self.shapes, self.slots)
        }


class ClientStateStore:
    """Maps ``client_id -> {name: tensor}``; tensors are kept on the CPU (``backend="memory"``) or on disk.

    On disk a client's state is a file ``client_<cid>.<tag>.pt`` that is never rewritten once a checkpoint may refer
    to it: ``tag`` is the number of snapshots (:meth:`state_dict`) taken before the ``put`` that wrote it, so a
    ``put`` after a snapshot writes a new file and the snapshot's stays. A snapshot holds only the ``(cid, tag)``
    table, not the tensors: a checkpoint costs O(clients) small integers, not every client's state. Files a kept
    checkpoint no longer needs are released by :meth:`retain` (called by ``flx.callbacks.checkpoint`` after each
    round checkpoint with the rounds of the checkpoints it keeps).

    Args:
        backend: ``"memory"`` (default) or ``"disk"`` (files under ``directory``).
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
        # disk: the tag new files get, each client's current tag, superseded files a snapshot may still need
        # ((tag, superseded at tag)), the snapshots taken (tag -> round, -1 when unlabelled), the clients written since
        # the last snapshot (fsynced at the next), and files found at a load that nothing refers to
        self._gen = 0
        self._tag: dict[int, int] = {}
        self._old: dict[int, list[tuple[int, int]]] = {}
        self._snapshots: dict[int, int] = {}
        self._unsynced: set[int] = set()
        self._stale: list[str] = []

    def bind_rank(self, rank: int, world_size: int) -> None:
        """Under N processes each rank keeps a full copy; on disk, in its own sub-folder."""
        if self.backend == "disk" and world_size > 1 and not str(self.directory).endswith(f"rank{rank}"):
            if self._tag:  # its files are in the folder it had: the state would silently be another rank's, or none
                raise RuntimeError(f"state store: bound to rank {rank} after storing client state in {self.directory}")
            self.directory = os.path.join(str(self.directory), f"rank{rank}")

    def __contains__(self, cid: int) -> bool:
        return cid in self._mem or cid in self._tag

    def __len__(self) -> int:
        return len(self._mem) + len(self._tag)

    def client_ids(self) -> list[int]:
        return sorted(set(self._mem) | set(self._tag))

    def nbytes(self) -> int:
        """The bytes of client state held: the tensors' bytes in memory, the current files' sizes on disk."""
        if self.backend == "disk":
            return sum(os.path.getsize(self._path(cid, tag)) for cid, tag in self._tag.items())
        return sum(buf.nbytes for _, buffers in self._mem.values() for buf in buffers)

    def _path(self, cid: int, tag: int, directory: str | None = None) -> str:
        return os.path.join(str(directory or self.directory), f"client_{cid}.{tag}.pt")

    def _stored(self, cid: int) -> ClientState:
        """The stored tensors themselves (views of the packed buffers in memory), or {} for a client never seen."""
        if self.backend == "disk":
            return torch.load(self._path(cid, self._tag[cid]), weights_only=True) if cid in self._tag else {}
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
        """Stores a copy of ``state`` (a new buffer or file: tensors handed out earlier, or saved, never change)."""
        if self.backend == "disk":
            os.makedirs(str(self.directory), exist_ok=True)
            prev = self._tag.get(cid)
            if prev is not None and prev != self._gen:  # a snapshot may refer to the previous file: keep it for now
                self._old.setdefault(cid, []).append((prev, self._gen))
            self._tag[cid] = self._gen
            # written in place: a file of this tag is in no snapshot yet, and a kill mid-write leaves a file that
            # nothing refers to (removed after the resume, see load_state_dict)
            # one host copy per dtype (views of it saved: torch.save writes the shared buffer once)
            torch.save(self._layout(state).unpack_packed(state), self._path(cid, self._gen))
            self._unsynced.add(cid)
            return
        layout = self._layout(state)
        self._mem[cid] = (layout, layout.pack(state))

    def _layout(self, state: ClientState) -> _Layout:
        """The layout of ``state``'s names, shapes and dtypes (one per kind of state, shared by its clients)."""
        key = _Layout.of(state)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout.build(key)
        return layout

    def state_dict(self, round: int | None = None) -> dict[str, Any]:
        """A snapshot of the store for a checkpoint, labelled with ``round`` (what :meth:`retain` keeps by).

        In memory: every client's tensors on the CPU, views of the stored buffers, not copies (``put`` replaces a
        client's buffers and never writes into them, so a checkpoint written later sees these values). On disk: the
        table of each client's current file, once the files written since the last snapshot are durable (fsync),
        so a checkpoint on disk never refers to a file that is not.
        """
        if self.backend == "memory":
            return {"clients": {cid: self._stored(cid) for cid in self.client_ids()}}
        for cid in sorted(self._unsynced):
            fsync(self._path(cid, self._tag[cid]))
        if self._unsynced:
            fsync(str(self.directory))
        self._unsynced.clear()
        snapshot, self._gen = self._gen, self._gen + 1
        self._snapshots[snapshot] = -1 if round is None else int(round)
        old = [(cid, t, until) for cid, versions in self._old.items() for t, until in versions]
        return {
            "disk": {
                "directory": os.path.abspath(str(self.directory)),
                "snapshot": snapshot,
                "cids": torch.tensor(list(self._tag), dtype=torch.int64),
                "tags": torch.tensor(list(self._tag.values()), dtype=torch.int64),
                "old": torch.tensor(old, dtype=torch.int64).reshape(-1, 3),
                "snapshots": torch.tensor(list(self._snapshots.items()), dtype=torch.int64).reshape(-1, 2),
            }
        }

    def retain(self, rounds: Collection[int]) -> list[str]:
        """Forgets the snapshots not labelled with one of ``rounds`` and returns the files that neither the current
        state nor a kept snapshot needs (and files a load found that nothing refers to), for the caller to remove once
        its newest checkpoint is on disk. In memory nothing is kept apart from the current state: returns []."""
        if self.backend == "memory":
            return []
        self._snapshots = {s: r for s, r in self._snapshots.items() if r in rounds}
        doomed, self._stale = self._stale, []
        for cid in list(self._old):
            keep = []
            for t, until in self._old[cid]:
                # the file of tag t was current for the snapshots t .. until - 1
                if any(t <= s < until for s in self._snapshots):
                    keep.append((t, until))
                else:
                    doomed.append(self._path(cid, t))
            if keep:
                self._old[cid] = keep
            else:
                del self._old[cid]
        return doomed

    @staticmethod
    def files_of(state: dict[str, Any]) -> list[str]:
        """The files a disk snapshot (a checkpoint's ``["flx"]["store"]``) refers to: what must travel with the
        checkpoint to resume it elsewhere ([] for a memory snapshot, which holds its tensors)."""
        if "disk" not in state:
            return []
        table = state["disk"]
        folder = str(table["directory"])
        return [
            os.path.join(folder, f"client_{c}.{t}.pt") for c, t in zip(table["cids"].tolist(), table["tags"].tolist())
        ]

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> ClientStateStore:
        """A memory store holding a snapshot of either backend, e.g. a checkpoint's ``["flx"]["store"]`` (a disk
        snapshot's files are read from the folder it names)."""
        store = cls()
        store.load_state_dict(state)
        return store

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a snapshot of either backend (a memory store reads a disk snapshot's files)."""
        self._mem.clear()
        self._tag.clear()
        self._old.clear()
        self._snapshots.clear()
        self._unsynced.clear()
        if "clients" in state:  # tensors in the checkpoint (backend=memory, or written before disk tables)
            for cid, s in state["clients"].items():
                self.put(int(cid), s)
            return
        table = state["disk"]
        source = str(table["directory"])
        current = dict(zip(table["cids"].tolist(), table["tags"].tolist()))
        missing = [self._path(c, t, source) for c, t in current.items() if not os.path.exists(self._path(c, t, source))]
        if missing:
            raise FileNotFoundError(
                f"state_store: {len(missing)} client state file(s) of this checkpoint are gone, e.g. {missing[0]} "
                "(on disk, only the round checkpoints kept (checkpoint.keep_last, best.ckpt) keep their client state)"
            )
        if self.backend == "memory":
            for cid, tag in current.items():
                self.put(cid, torch.load(self._path(cid, tag, source), weights_only=True))
            return
        # every file of this folder the snapshot does not refer to is removed at the next retain: files written after
        # the snapshot by a killed run (no checkpoint older than the one this run writes next refers to them) or cut
        # short by the kill. New tags start above every tag on disk, so none of them is overwritten before then.
        own = _mkdir(str(self.directory))
        on_disk = {}
        for entry in os.scandir(own):
            m = _FILE.fullmatch(entry.name)
            if m:
                on_disk[entry.path] = int(m.group(2))
        self._gen = max([int(table["snapshot"]), *on_disk.values()]) + 1
        if os.path.isdir(source) and os.path.samefile(source, own):
            self._tag.update(current)
            for cid, t, until in table["old"].tolist():
                self._old.setdefault(cid, []).append((t, until))
            self._snapshots.update(dict(table["snapshots"].tolist()))
        else:  # another folder (another run's, or rank 0's under N processes): a copy of the current files
            for cid, tag in current.items():
                self.put(cid, torch.load(self._path(cid, tag, source), weights_only=True))
        known = {self._path(c, t) for c, t in self._tag.items()}
        known |= {self._path(c, t) for c, versions in self._old.items() for t, _ in versions}
        self._stale = sorted(path for path in on_disk if path not in known)


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


def _copy(dst: list[Tensor], src: Sequence[Tensor]) -> None:
    """In-place list copy (``_foreach_copy_`` rejects empty lists, e.g. a net without buffers)."""
    if dst:
        torch._foreach_copy_(dst, list(src))


class GlobalModel:
    """The net's tensors and the round-start snapshot of them, the global model :math:`w^t`.

    Every rank holds one net: each client trains in it from the snapshot (:meth:`load`), and the server step writes
    the new global model back (:meth:`commit`). Copies are in place: nothing is allocated per round.

    Attributes:
        params: the net's trainable parameters.
        float_buffers: its floating-point buffers (BatchNorm statistics): uploaded and averaged like parameters.
        other_buffers: the other buffers (integer counters): kept from the global model.
        local_state: ``params`` then ``float_buffers``: what a client uploads.
        global_params: the snapshot of ``params``, :math:`w^t`, which the server optimizer steps.
        global_state: the snapshot of ``local_state`` (``global_params`` then the float buffers').
    """

    def __init__(self, net: nn.Module) -> None:
        self.params: list[Tensor] = [p for p in net.parameters() if p.requires_grad]
        buffers = list(net.buffers())
        self.float_buffers = [b for b in buffers if b.is_floating_point()]
        self.other_buffers = [b for b in buffers if not b.is_floating_point()]
        self.local_state = self.params + self.float_buffers
        self._live = self.params + self.float_buffers + self.other_buffers
        self._snapshot = [t.detach().clone() for t in self._live]
        n, f = len(self.params), len(self.float_buffers)
        self.global_params, self.global_state = self._snapshot[:n], self._snapshot[: n + f]
        self._global_other = self._snapshot[n + f :]

    @torch.no_grad()
    def snapshot(self) -> None:
        """The net's current tensors become the global model (at the start of a round)."""
        _copy(self._snapshot, [t.detach() for t in self._live])

    @torch.no_grad()
    def load(self) -> None:
        """Copies the global model into the net (a client's start; a round that aggregated nothing)."""
        _copy(self._live, self._snapshot)

    @torch.no_grad()
    def commit(self, float_means: Sequence[Tensor]) -> None:
        """After the server step: the net takes the stepped ``global_params``, the clients' mean float buffers
        (``float_means``, cast to the buffers' dtypes) and the global model's other buffers."""
        floats = [m.to(b.dtype) for b, m in zip(self.float_buffers, float_means)]
        _copy(self._live, [*self.global_params, *floats, *self._global_other])


def share_states(
    store: ClientStateStore, updates: dict[int, Any], gather: Callable[[Any], list[Any]], rank: int
) -> None:
    """Under N processes, every rank's ``store`` receives the client states updated on the other ranks this round
    (``updates``: the ids this rank stored; ``gather``: the all-gather of a picklable object, rank order).

    A client may train on another rank next time it is sampled, so each rank keeps every client's state. The caller
    runs this only in rounds where some rank stored a state (the reduced ``stored`` counter), so parts without
    per-client state cost no collective beyond the round's reduce. A client drawn more than once keeps its last copy's
    state, as on one process: copies are numbered in rank order, so a later rank's copy wins and an earlier rank's
    does not replace this rank's own.
    """
    mine = {cid: store.get(cid) for cid in updates}  # the store's host copies: no device read per tensor
    for other, theirs in enumerate(gather(mine)):
        if other == rank:
            continue
        for cid, state in theirs.items():
            if other > rank or cid not in updates:
                store.put(cid, state)
