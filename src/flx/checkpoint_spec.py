"""The ``checkpoint.*`` settings and their checks, with no torch: the pre-run check (:mod:`flx.config`) and the round
checkpoint callback (:class:`flx.callbacks.checkpoint.RoundCheckpoint`) run the same check, owned here."""

from __future__ import annotations

import math
import signal
from typing import Any

from flx.errors import bad_value


def check_checkpoint(
    every_rounds: Any,
    every_seconds: Any,
    keep_last: Any,
    mode: Any,
    requeue: Any,
    requeue_signal: Any,
    min_seconds: Any = None,
) -> None:
    """The ``checkpoint.*`` values (:class:`flx.callbacks.checkpoint.RoundCheckpoint`); one line per bad value."""
    for key, value in (("every_rounds", every_rounds), ("keep_last", keep_last)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise bad_value(f"checkpoint.{key}", value, "must be an integer >= 1 or null")
    ok = isinstance(every_seconds, (int, float)) and not isinstance(every_seconds, bool) and every_seconds > 0
    if every_seconds is not None and not ok:
        raise bad_value("checkpoint.every_seconds", every_seconds, "must be a number > 0 or null")
    ok = isinstance(min_seconds, (int, float)) and not isinstance(min_seconds, bool) and 0 <= min_seconds < math.inf
    if min_seconds is not None and not ok:
        raise bad_value("checkpoint.min_seconds", min_seconds, "must be a number >= 0 or null (0: every due round)")
    if mode not in ("max", "min"):
        raise bad_value("checkpoint.mode", mode, "allowed: max, min")
    if str(requeue).lower() not in ("auto", "true", "false"):
        raise bad_value("checkpoint.requeue", requeue, "allowed: auto, true, false")
    if not str(requeue_signal).startswith("SIG") or not hasattr(signal, str(requeue_signal)):
        raise bad_value("checkpoint.requeue_signal", requeue_signal, "must name a signal, e.g. SIGUSR1")
