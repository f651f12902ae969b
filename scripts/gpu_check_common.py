"""What the sections of ``scripts/gpu_check.py`` share: the table's row, where the checks run, the timed row.

``gpu_check.py`` (sections a, b, f and the table), ``gpu_check_procs.py`` (c, d) and ``gpu_check_speed.py`` (e) all
import from here and never from each other, so no two scripts import each other in a circle.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUIET = ("callbacks.progress_bar=null", "trainer.enable_progress_bar=false")
#: (c): max |parameter difference| between 1 and 2 processes (the all-reduce sums in another order)
MODEL_TOL = 1e-4


@dataclass
class Row:
    """One line of the table.

    Attributes:
        section: ``a`` .. ``f``.
        check: what was checked or measured.
        status: ``passed``, ``FAILED``, ``measured`` (speed) or ``skipped: <reason>``.
        value: what was measured (max difference, rounds per second, ...).
        limit: the tolerance or target it is held to.
        seconds: wall-clock seconds of the check.
        detail: everything else, for the JSON file.
    """

    section: str
    check: str
    status: str
    value: str = ""
    limit: str = ""
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Setup:
    """Where and how large the checks run.

    Attributes:
        device: ``cuda`` or ``cpu`` (the device under test; the reference is always the CPU).
        small: the CPU analogue (fewer configs and rounds, tiny speed workloads).
        work: a scratch folder for the runs' outputs.
        deadline: ``time.monotonic()`` after which remaining configs of (a) are skipped.
        algos: the configs of (a).
    """

    device: str
    small: bool
    work: Path
    deadline: float
    algos: tuple[str, ...]


def progress(line: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {line}", flush=True)


def timed_row(section: str, check: str, fn: Callable[[], Row]) -> Row:
    """``fn()``'s row with its seconds; an exception becomes a FAILED row naming it (the other checks still run)."""
    start = time.monotonic()
    try:
        row = fn()
    except Exception as err:  # noqa: BLE001 - one failed check must not hide the others
        row = Row(section, check, "FAILED", value=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
    row.seconds = round(time.monotonic() - start, 1)
    progress(f"({section}) {row.check}: {row.status} {row.value}".rstrip())
    return row
