"""The simulated wall-clock of a run: ``T_r`` per round and its running sum (checkpointed with the federation).

.. math::
    \\text{clock}_r = \\sum_{s \\le r} T_s, \\qquad T_s = \\max_{i \\in S_s} T_{i,s}(\\rho_{i,s})

The federation advances it at every round end (:meth:`flx.federation.Federation.end_round`) and saves it in
``checkpoint["flx"]["sim_clock"]``, so a resumed run continues the clock where the checkpoint left it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flx.systems.simulator import LatencySimulator


class SimClock:
    """Simulated seconds so far (``elapsed``) and the last round's time (``round_time``).

    Args:
        system: the simulator that prices a round.
    """

    def __init__(self, system: LatencySimulator) -> None:
        self.system = system
        self.elapsed = 0.0
        self.round_time = 0.0

    def advance(self, round_idx: int, widths: Mapping[int, float], steps: Mapping[int, int] | None = None) -> float:
        """Adds round ``round_idx``'s time over the clients of ``widths`` (:meth:`LatencySimulator.round_time`)."""
        self.round_time = self.system.round_time(round_idx, widths, steps)
        self.elapsed += self.round_time
        return self.round_time

    def state_dict(self) -> dict[str, Any]:
        return {"elapsed": self.elapsed, "round_time": self.round_time}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.elapsed, self.round_time = float(state["elapsed"]), float(state["round_time"])
