"""The ``system.*`` settings of the device / latency simulator and their checks (torch- and numpy-free).

:func:`check_system` runs in the pre-run check (:func:`flx.checks.validate`); :class:`SystemParams` is what
:class:`flx.systems.simulator.LatencySimulator` is built from, so both apply the same rules and the same one-line
errors (``system.<key>=<value>: <what is allowed>``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from flx.errors import bad_value
from flx.systems.profiles import LINKS, PROFILES, TYPES, UPLOAD_BITS

DYNAMICS = ("markov", "static")
SIMULATOR = "flx.systems.simulator.LatencySimulator"


def _number(key: str, value: Any, ok: Any, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise bad_value(f"system.{key}", value, allowed)
    return value


def _integer(key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise bad_value(f"system.{key}", value, f"must be an integer >= {low}")
    return value


@dataclass(frozen=True)
class SystemParams:
    """The simulated devices and their dynamics (``configs/system/*.yaml``; docs/systems.md).

    Attributes:
        name: the device list's name (logs only).
        types: device types, cycled: device ``d`` is of type ``types[d % len(types)]``.
        num_devices: ``M``; client ``i`` runs on device ``i mod M``.
        profile: the compute table of :data:`flx.systems.profiles.PROFILES`.
        link_rates_mbps: the link rates a device switches between (Mbps).
        upload_bits: full-model upload size ``q`` in bits; None: ``bits_per_param`` x the net's trainable parameters.
        bits_per_param: bits per uploaded parameter when ``upload_bits`` is None.
        dynamics: ``markov`` (link switching and background load per round) or ``static`` (the initial link, no load,
            as in the authors' code).
        switch_prob: per round, the probability that a device's link moves to another rate (``markov``).
        load_min: the background-load factor ``u`` is uniform on ``(load_min, 1]`` each round (``markov``; 1: none).
        trace_seed: the traces depend on ``(trace_seed, device, round)`` only, never on the algorithm or the run seed.
    """

    name: str = "mobile20"
    types: tuple[str, ...] = TYPES
    num_devices: int = 20
    profile: str = "cnn_mnist"
    link_rates_mbps: tuple[float, ...] = LINKS["paper"]
    upload_bits: float | None = UPLOAD_BITS
    bits_per_param: int = 32
    dynamics: str = "markov"
    switch_prob: float = 0.1
    load_min: float = 0.5
    trace_seed: int = 0

    def __post_init__(self) -> None:
        for key in ("types", "link_rates_mbps"):
            value = getattr(self, key)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise bad_value(f"system.{key}", value, "must be a list")
            object.__setattr__(self, key, tuple(value))
        if not isinstance(self.profile, str):
            raise bad_value("system.profile", self.profile, f"allowed: {', '.join(PROFILES)}")
        self._check()

    def _check(self) -> None:
        if self.profile not in PROFILES:
            raise bad_value("system.profile", self.profile, f"allowed: {', '.join(PROFILES)}")
        known = PROFILES[self.profile]
        if not self.types or any(t not in known for t in self.types):
            raise bad_value("system.types", list(self.types), f"a non-empty list of: {', '.join(known)}")
        _integer("num_devices", self.num_devices, 1)
        rates = self.link_rates_mbps
        if not rates or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0 for r in rates):
            raise bad_value("system.link_rates_mbps", list(rates), "a non-empty list of rates > 0 (Mbps)")
        if self.upload_bits is not None:
            _number("upload_bits", self.upload_bits, lambda v: v > 0, "must be a number > 0 (bits), or null")
        _integer("bits_per_param", self.bits_per_param, 1)
        if self.dynamics not in DYNAMICS:
            raise bad_value("system.dynamics", self.dynamics, f"allowed: {', '.join(DYNAMICS)}")
        _number("switch_prob", self.switch_prob, lambda v: 0 <= v <= 1, "must be in [0, 1]")
        _number("load_min", self.load_min, lambda v: 0 < v <= 1, "must be in (0, 1] (1: no background load)")
        _integer("trace_seed", self.trace_seed, 0)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SystemParams:
        """Params from config values; an unknown key is a one-line error naming the known ones."""
        fields = [f.name for f in dataclasses.fields(cls)]
        for key, value in values.items():
            if key not in fields:
                raise bad_value(f"system.{key}", value, f"unknown key; allowed: {', '.join(fields)}")
        return cls(**values)


def check_system(cfg: DictConfig) -> None:
    """The ``system`` node (``system=none``: empty, nothing to check); one line naming the key on a bad value."""
    node = OmegaConf.select(cfg, "system")
    if node is None or (OmegaConf.is_dict(node) and len(node) == 0):
        return
    if not OmegaConf.is_dict(node):
        raise bad_value("system", node, "must be a system config (system=none or system=mobile20)")
    values = OmegaConf.to_container(node, resolve=True)
    target = values.pop("_target_", None)
    if target is None:
        raise bad_value("system", values, "no simulator selected (no _target_): choose system=mobile20 first")
    if target == SIMULATOR:  # another class checks its own keys when it is built
        SystemParams.from_mapping(values)
