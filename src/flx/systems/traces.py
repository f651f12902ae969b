"""Seeded, replayable per-round device conditions: the link rate ``R_{i,r}`` and the background load ``u_{i,r}``.

The paper assumes that rates and available compute change across rounds and stay constant within a round
(WHALE-FL paper, text after Eq. 4), and gives no generator: it does not say which device has which link nor how
links and loads change over time. Ours (docs/systems.md):

.. math::
    P(R_{i,r} = a \\mid R_{i,r-1} = b) = \\begin{cases} 1 - p & a = b \\\\ p / (n - 1) & a \\ne b \\end{cases},
    \\qquad u_{i,r} = 1 - (1 - u_{min})\\, U_{i,r},\\ U_{i,r} \\sim \\mathcal{U}[0, 1)

with ``R_{i,0}`` the device's initial link (rate ``(i // len(types)) mod n``), ``p = switch_prob`` and ``n`` rates.
Round ``r``'s draws come from ``numpy`` seeded by ``(trace_seed, TRACE_TAG, device, r // CHUNK)``, so a value depends
on ``(trace_seed, device, round)`` only: not on the algorithm, the cohort, the run seed or the order of queries.
``static`` dynamics keep the initial link and ``u = 1`` (the authors' code).
"""

from __future__ import annotations

import numpy as np

from flx.systems.params import SystemParams

TRACE_TAG = 0x5E5  # separates the trace streams from flx's other seeded streams
CHUNK = 128  # rounds drawn per generator


class Traces:
    """Link rates (bits/s) and load factors of every device in every round; computed lazily, cached per device.

    Args:
        params: the system settings (rates, dynamics, ``switch_prob``, ``load_min``, ``trace_seed``).
    """

    def __init__(self, params: SystemParams) -> None:
        self.params = params
        self.rates_bps = tuple(float(r) * 1e6 for r in params.link_rates_mbps)
        self._links: dict[int, list[int]] = {}  # device -> link index of rounds 0..len-1
        self._loads: dict[int, list[float]] = {}

    def initial_link(self, device: int) -> int:
        """Device ``d``'s link index at round 0: the ``d // len(types)``-th rate, cycled (each type over the rates)."""
        return (device // len(self.params.types)) % len(self.rates_bps)

    def link_index(self, device: int, round_idx: int) -> int:
        """The index into ``link_rates_mbps`` of ``device``'s link in round ``round_idx``."""
        if self.params.dynamics == "static":
            return self.initial_link(device)
        self._extend(device, round_idx)
        return self._links[device][round_idx]

    def link_rate(self, device: int, round_idx: int) -> float:
        """``R_{i,r}`` in bits per second."""
        return self.rates_bps[self.link_index(device, round_idx)]

    def load(self, device: int, round_idx: int) -> float:
        """``u_{i,r}`` in ``(load_min, 1]``: the share of the device's compute left to training."""
        if self.params.dynamics == "static":
            return 1.0
        self._extend(device, round_idx)
        return self._loads[device][round_idx]

    def _draws(self, device: int, chunk: int) -> np.ndarray:
        """``(CHUNK, 3)`` uniforms of rounds ``chunk * CHUNK ...``: switch?, which other rate, load."""
        rng = np.random.default_rng([self.params.trace_seed, TRACE_TAG, device, chunk])
        return rng.random((CHUNK, 3))

    def _extend(self, device: int, round_idx: int) -> None:
        """Runs ``device``'s chain up to ``round_idx`` (whole chunks, so any query order gives the same values)."""
        links, loads = self._links.setdefault(device, []), self._loads.setdefault(device, [])
        n, p, u_min = len(self.rates_bps), self.params.switch_prob, self.params.load_min
        while len(links) <= round_idx:
            draws = self._draws(device, len(links) // CHUNK)
            for switch, pick, load in draws.tolist():
                state = self.initial_link(device) if not links else links[-1]
                if links and n > 1 and switch < p:
                    other = min(int(pick * (n - 1)), n - 2)  # uniform over the n-1 other rates
                    state = other + (other >= state)
                links.append(state)
                loads.append(1.0 - (1.0 - u_min) * load)
