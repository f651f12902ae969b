"""The offline W&B run reader on hand-built transaction logs: records across 32 KiB blocks, the block tail padding,
and a corrupt chunk stopping with an error (the real files: tests/test_wandb_logging.py)."""

from __future__ import annotations

import struct
import zlib

import pytest

from flx.wandb_files import read_chunks

BLOCK = 32 * 1024


def write_log(payloads: list[bytes]) -> bytes:
    """The W&B / LevelDB log layout: a 7-byte file header, then chunks of (crc, length, type) + data that never
    cross a 32 KiB block; a record longer than a block's room is split into first / middle / last chunks."""
    out = bytearray(struct.pack("<4sHB", b":W&B", 0xBEE1, 0))
    for payload in payloads:
        rest, first = payload, True
        while True:
            room = BLOCK - len(out) % BLOCK
            if room < 7:
                out += b"\0" * room
                continue
            part, rest = rest[: room - 7], rest[room - 7 :]
            kind = (1 if first else 4) if not rest else (2 if first else 3)
            out += struct.pack("<IHB", zlib.crc32(part, zlib.crc32(bytes([kind]))), len(part), kind) + part
            first = False
            if not rest:
                break
    return bytes(out)


def test_records_come_back_whole_across_blocks() -> None:
    payloads = [b"a" * 10, b"b" * (BLOCK * 2 + 100), b"", b"c" * (BLOCK - 7 - 7 - 3), b"d" * 50]
    assert list(read_chunks(write_log(payloads))) == payloads


def test_a_corrupt_chunk_or_a_foreign_file_raises() -> None:
    data = bytearray(write_log([b"hello", b"world"]))
    data[-1] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        list(read_chunks(bytes(data)))
    with pytest.raises(ValueError, match="W&B"):
        list(read_chunks(b"PK\3\4" + bytes(20)))


def test_finish_waits_for_the_exit_record(tmp_path) -> None:
    """``WandbLogger.finish`` returns once the run file holds its exit record (wandb's service may still be writing
    it when ``finish`` returns); a file that never gets one is reported after the timeout."""
    from wandb.proto import wandb_internal_pb2

    from flx.wandb_logging import wait_for_exit_record

    def record(kind: str) -> bytes:
        r = wandb_internal_pb2.Record()
        getattr(r, kind).SetInParent()
        return r.SerializeToString()

    path = tmp_path / "run-x.wandb"
    path.write_bytes(write_log([record("run"), record("history")]))
    with pytest.warns(UserWarning, match="no exit record"):
        assert not wait_for_exit_record(str(path), timeout_s=0.2)
    path.write_bytes(write_log([record("run"), record("history"), record("exit")]))
    assert wait_for_exit_record(str(path), timeout_s=0.2)
    assert not wait_for_exit_record(None)
