"""The CSV logger appends to a resumed run's ``metrics.csv`` (flx.loggers) and first cuts a row a kill left half
written back to the last whole row, so that no appended row is glued onto a broken line."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
from runs import flx_lines, run, trained_rounds

from flx.loggers import repair_torn


@pytest.mark.parametrize(
    ("written", "kept", "removed"),
    [
        (b"a,b\r\n1,2\r\n3,", b"a,b\r\n1,2\r\n", 2),  # cut in a row: the row goes
        (b"a,b\r\n1,2\r\n3,4\r", b"a,b\r\n1,2\r\n3,4\r\n", 0),  # only the row's \n lost: the row is whole
        (b"a,b\r\n1,2\r\n", b"a,b\r\n1,2\r\n", 0),  # whole
        (b"a,", b"", 2),  # cut in the header
        (b"", b"", 0),
    ],
)
def test_repair_torn_keeps_every_whole_row(written: bytes, kept: bytes, removed: int, tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_bytes(written)
    assert repair_torn(str(path)) == removed
    assert path.read_bytes() == kept


@pytest.mark.slow
def test_a_torn_metrics_csv_is_cut_to_its_last_whole_row_before_a_resume_appends(
    two_rounds: Path, tmp_path: Path
) -> None:
    """The 2-round run with ``metrics.csv`` cut in the middle of its last row (the final test's, as a kill while it
    was written leaves it), continued to 3 rounds with ``ckpt_path=auto``: the broken row is cut (a warning line),
    every byte before it is kept, every row of the file has the header's fields, and the training rows are those of
    rounds 1, 2, 3."""
    out = tmp_path / "run"
    shutil.copytree(two_rounds, out)
    metrics = out / "csv" / "metrics.csv"
    data = metrics.read_bytes()
    start = data.rstrip(b"\r\n").rfind(b"\n") + 1  # the last row's first byte
    cut = start + (len(data) - start) // 2
    metrics.write_bytes(data[:cut])
    proc = run(out, "algo.rounds=3", "ckpt_path=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert flx_lines(proc.stderr) == [
        f"flx: {metrics} ended in a row cut short (a killed run): removed its {cut - start} bytes before appending"
    ]
    assert metrics.read_bytes().startswith(data[:start])
    with open(metrics, newline="") as f:
        rows = list(csv.reader(f))
    assert all(len(row) == len(rows[0]) for row in rows)
    assert trained_rounds(out) == [1, 2, 3]
