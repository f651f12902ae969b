"""The device / latency simulator: what a client's round costs in simulated seconds on its device.

Su et al., WHALE-FL (paper, sections "Adaptive Subnetwork Selection Utility" and "WHALE-FL Testbed"; the authors'
released code github.com/BESTTOOLBOX/WHALE-FL, ``On-Server/main_train_fisher.py``): a device's round is its local
computing plus the upload of its (sub-)model; a synchronous round lasts as long as its slowest client; the clock is the
sum of the rounds.

.. math::
    T^{co}_{i,r}(\\rho) = \\frac{t(\\tau_i, \\rho)\\, B\\, K_i}{u_{i,r}}, \\qquad
    T^{tr}_{i,r}(\\rho) = \\frac{q\\, \\rho^2}{R_{i,r}}, \\qquad
    T_r = \\max_{i \\in S_r} \\big(T^{co}_{i,r}(\\rho_{i,r}) + T^{tr}_{i,r}(\\rho_{i,r})\\big), \\qquad
    \\text{clock}_r = \\sum_{s \\le r} T_s

Symbols: ``tau_i`` device type, ``rho`` width ratio, ``t`` the profiled table (:mod:`flx.systems.profiles`), ``B``
batch size, ``K_i`` local iterations, ``u`` background-load factor and ``R`` link rate (:mod:`flx.systems.traces`),
``q`` full-model upload bits, ``S_r`` the round's clients. The formulas are the authors' code's, with ``u`` and
``R`` varying per round (ours: the paper gives no latency model). Downlink and server time are not modelled, as in
the paper. Client ``i`` runs on device ``i mod M`` (``M = num_devices``); every method takes a client id, and a device
id ``d < M`` is client ``d``'s device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flx.systems.params import SystemParams
from flx.systems.profiles import WIDTHS, iteration_time, width_level
from flx.systems.traces import Traces


class LatencySimulator:
    """Simulated compute, upload and round times (see the module docstring). Stateless apart from trace caches:
    every answer is a function of the settings and ``(client, round, width)``, identical on every rank.

    Args:
        batch_size: ``B`` (the run's ``algo.batch_size``).
        local_steps: ``K`` when a query gives no ``steps`` (the run's ``algo.local_steps``).
        num_params: the net's trainable parameters, for ``upload_bits=None``.
        **params: the :class:`SystemParams` fields (``configs/system/*.yaml``).
    """

    widths = WIDTHS  # the width ratios with a compute profile, largest first

    def __init__(self, batch_size: int, local_steps: int, num_params: int | None = None, **params: Any) -> None:
        self.params = SystemParams.from_mapping(params)
        self.batch_size, self.local_steps = int(batch_size), int(local_steps)
        bits = self.params.upload_bits
        if bits is None:
            if num_params is None:
                raise ValueError("system.upload_bits=null needs the net's parameter count (num_params)")
            bits = self.params.bits_per_param * num_params
        self.upload_bits = float(bits)
        self.traces = Traces(self.params)

    @property
    def num_devices(self) -> int:
        return self.params.num_devices

    def device(self, client: int) -> int:
        """The device client ``client`` runs on: ``client mod M``."""
        return int(client) % self.params.num_devices

    def device_type(self, client: int) -> str:
        """``tau_i``: one of ``system.types`` (cycled over the devices)."""
        types = self.params.types
        return types[self.device(client) % len(types)]

    def link_rate(self, client: int, round_idx: int) -> float:
        """``R_{i,r}`` in bits per second."""
        return self.traces.link_rate(self.device(client), round_idx)

    def load(self, client: int, round_idx: int) -> float:
        """``u_{i,r}`` in ``(0, 1]``: the share of the device's compute left to training in round ``round_idx``."""
        return self.traces.load(self.device(client), round_idx)

    def check_width(self, width: float) -> None:
        """Raises ``ValueError`` unless ``width`` is one of :attr:`widths`."""
        width_level(width)

    def compute_time(self, client: int, round_idx: int, width: float = 1.0, steps: int | None = None) -> float:
        """``T^co_{i,r}(rho) = t(tau_i, rho) B K / u_{i,r}`` (``K``: ``steps``, default ``local_steps``)."""
        k = self.local_steps if steps is None else int(steps)
        t = iteration_time(self.params.profile, self.device_type(client), width)
        return t * self.batch_size * k / self.load(client, round_idx)

    def upload_time(self, client: int, round_idx: int, width: float = 1.0) -> float:
        """``T^tr_{i,r}(rho) = q rho^2 / R_{i,r}``."""
        self.check_width(width)
        return self.upload_bits * width**2 / self.link_rate(client, round_idx)

    def device_time(self, client: int, round_idx: int, width: float = 1.0, steps: int | None = None) -> float:
        """``T^co + T^tr``: the client's whole round at width ratio ``width``."""
        return self.compute_time(client, round_idx, width, steps) + self.upload_time(client, round_idx, width)

    def unit_times(self, client: int, round_idx: int, steps: int | None = None) -> tuple[float, float]:
        """``(T^co, T^tr)`` of the smallest width under round ``round_idx``'s conditions (WHALE-FL's SE inputs)."""
        unit = self.widths[-1]
        return self.compute_time(client, round_idx, unit, steps), self.upload_time(client, round_idx, unit)

    def round_time(self, round_idx: int, widths: Mapping[int, float], steps: Mapping[int, int] | None = None) -> float:
        """``T_r``: the largest device time over the clients of ``widths`` (client id -> width ratio; ``steps``:
        client id -> ``K_i``); 0 for no client."""
        steps = steps or {}
        times = (self.device_time(c, round_idx, w, steps.get(c)) for c, w in widths.items())
        return max(times, default=0.0)
