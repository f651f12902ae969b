"""Reads an offline W&B run back from the files the wandb library wrote: what the dashboard would show.

A run folder (``<output_dir>/wandb/offline-run-*``) holds ``run-<id>.wandb``, the run's transaction log, and
``files/`` (tables under ``files/media/table/*.table.json``). The log is a 7-byte header (``:W&B``, the magic
``0xBEE1`` little-endian, a version byte) followed by LevelDB-log records: 32 KiB blocks of chunks, each chunk a
7-byte header (CRC-32 of the type byte and the data, little-endian; the data length, 2 bytes; the type: 1 full,
2 first, 3 middle, 4 last), a block's tail shorter than a chunk header is zero padding. Each record is a
``wandb.proto.wandb_internal_pb2.Record`` (the wandb library's own protobuf), decoded here with the library.

Used by the tests (the W&B content of a run, read as W&B would sync it) and by ``scripts/dashboards.py``.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_CHUNK = struct.Struct("<IHB")  # crc32, length, type
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_chunks(data: bytes) -> Iterator[bytes]:
    """The records' payloads of a ``.wandb`` file's bytes, in order.

    Raises:
        ValueError: not a W&B transaction log, or a chunk whose checksum does not match.
    """
    ident, magic, _ = _HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError("not a W&B run file (no :W&B header)")
    pos, parts = _HEADER.size, []
    while pos + _CHUNK.size <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _CHUNK.size:  # the block's zero-padded tail
            pos += room
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of a file still being written
            break
        payload = data[pos + _CHUNK.size : pos + _CHUNK.size + length]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"W&B run file: bad checksum at byte {pos}")
        pos += _CHUNK.size + length
        parts.append(payload)
        if kind in (_FULL, _LAST):
            yield b"".join(parts)
            parts = []


def read_records(path: str | Path) -> list[Any]:
    """Every record of a ``.wandb`` file as a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for payload in read_chunks(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        out.append(record)
    return out


def _items(items: Any, into: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{key: value}`` of protobuf items (``value_json`` decoded); an item with a ``nested_key`` (media: a table's
    ``path``; W&B's ``_wandb`` config) goes into nested dicts."""
    out = {} if into is None else into
    for item in items:
        path = [item.key] if item.key else list(item.nested_key)
        node = out
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = json.loads(item.value_json)
    return out


@dataclass
class OfflineRun:
    """An offline run as W&B would sync it.

    Attributes:
        folder: the run folder (``offline-run-*``).
        name, group: the run's display name and group.
        config: the run config (nested dicts as logged; ``_wandb`` holds W&B's own, e.g. custom charts).
        history: the history rows in order (``_step`` and the logged keys; media as their JSON references).
        summary: the summary (last values).
        metrics: the ``define_metric`` definitions by name or glob (``step_metric`` etc.).
    """

    folder: Path
    name: str = ""
    group: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)

    def series(self, key: str, x: str = "fl/round") -> list[tuple[float, float]]:
        """``(x, value)`` of every history row that logs ``key`` (and ``x``)."""
        return [(row[x], row[key]) for row in self.history if key in row and x in row]

    def tables(self, key: str) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """Every table logged under ``key``: ``(history row, rows as dicts by column)``."""
        out = []
        for row in self.history:
            ref = row.get(key)
            if isinstance(ref, dict) and ref.get("_type") in ("table-file", "table"):
                table = json.loads((self.folder / "files" / ref["path"]).read_text())
                out.append((row, [dict(zip(table["columns"], values)) for values in table["data"]]))
        return out


def load_run(folder: str | Path) -> OfflineRun:
    """Reads the run in ``folder``: an ``offline-run-*`` folder, or an output folder holding ``wandb/`` with one
    run (the latest when there are several)."""
    folder = Path(folder)
    if not list(folder.glob("run-*.wandb")):
        runs = sorted((folder / "wandb").glob("offline-run-*")) or sorted(folder.glob("offline-run-*"))
        if not runs:
            raise FileNotFoundError(f"no offline W&B run under {folder}")
        folder = runs[-1]
    (path,) = folder.glob("run-*.wandb")
    run = OfflineRun(folder)
    for record in read_records(path):
        _apply(run, record)
    return run


def _apply(run: OfflineRun, record: Any) -> None:
    kind = record.WhichOneof("record_type")
    if kind == "run":
        run.name, run.group = record.run.display_name, record.run.run_group
        _items(record.run.config.update, run.config)
    elif kind == "config":
        _items(record.config.update, run.config)
        for item in record.config.remove:
            run.config.pop(item.key or "/".join(item.nested_key), None)
    elif kind == "history":
        row = _items(record.history.item)
        if record.history.HasField("step"):
            row.setdefault("_step", record.history.step.num)
        run.history.append(row)
    elif kind == "summary":
        _items(record.summary.update, run.summary)
    elif kind == "metric":
        m = record.metric
        run.metrics[m.name or m.glob_name] = {"step_metric": m.step_metric, "step_sync": m.options.step_sync}
