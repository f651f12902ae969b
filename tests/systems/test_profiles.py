"""Device profiles and the device-time formula against the authors' table (WHALE-FL's released code,
``device_list/*.csv``).

``T_i = t(type_i, rho) * B * K + q * rho^2 / R_i`` with ``q = 12,352,000`` bit; under ``static`` dynamics ``u = 1``
and the link is the device's initial one, so the expected values below are the table's numbers put in the formula.
"""

from __future__ import annotations

import doctest

import pytest

from flx.systems import profiles
from flx.systems.simulator import LatencySimulator

B, K, Q = 64, 10, 12_352_000  # the code's MNIST batch size and local iterations, the full-model upload bits
CODE = {"link_rates_mbps": [80, 40, 20, 15], "dynamics": "static"}  # system=mobile20_code


def test_doctests() -> None:
    assert doctest.testmod(profiles).failed == 0


@pytest.mark.parametrize(
    ("device", "t_full", "t_unit", "mbps"),
    [
        (0, 0.0083647, 0.0009867, 80),  # MacBookPro2018, first rate
        (6, 0.04070369, 0.002557199, 40),  # Xavier (6 mod 5 = 1), second rate (6 // 5 = 1)
        (12, 0.046046102, 0.002453266, 20),  # TX2, third rate
        (19, 0.051820623, 0.002569063, 15),  # RaspberryPi 4, fourth rate
    ],
)
def test_device_time_at_full_and_smallest_width(device: int, t_full: float, t_unit: float, mbps: float) -> None:
    sim = LatencySimulator(B, K, **CODE)
    assert sim.device_time(device, 0, 1.0) == pytest.approx(t_full * B * K + Q / (mbps * 1e6), rel=1e-12)
    assert sim.device_time(device, 7, 1 / 16) == pytest.approx(t_unit * B * K + Q / 256 / (mbps * 1e6), rel=1e-12)
    assert sim.unit_times(device, 3) == pytest.approx((t_unit * B * K, Q / 256 / (mbps * 1e6)), rel=1e-12)


def test_upload_times_of_the_code() -> None:
    """The code's full-model upload: 0.1544 s at 80 Mbps, 0.3088 at 40, 0.6176 at 20, 0.8235 at 15."""
    sim = LatencySimulator(B, K, **CODE)
    got = [sim.upload_time(d, 0) for d in (0, 5, 10, 15)]
    assert got == pytest.approx([0.1544, 0.3088, 0.6176, 0.8235], abs=5e-5)


def test_the_code_table_has_every_type_at_every_rate_once() -> None:
    """``mobile20_code``: 5 types x 4 rates, one device per pair, as the authors' ``device_list`` csv."""
    sim = LatencySimulator(B, K, **CODE)
    pairs = {(sim.device_type(d), sim.link_rate(d, 0) / 1e6) for d in range(20)}
    assert pairs == {(t, r) for t in profiles.TYPES for r in (80, 40, 20, 15)}


def test_mobile20_has_four_devices_of_each_type() -> None:
    sim = LatencySimulator(B, K)
    types = [sim.device_type(d) for d in range(sim.num_devices)]
    assert sorted(types) == sorted(profiles.TYPES * 4)
    assert {sim.link_rate(d, 0) / 1e6 for d in range(20)} == {80, 20, 10}  # the paper's rates


def test_profile_is_monotone_in_width() -> None:
    """A narrower model computes faster on every type (a sanity check of the transcription)."""
    for times in profiles.PROFILES["cnn_mnist"].values():
        assert list(times) == sorted(times, reverse=True)


def test_unprofiled_width_is_rejected() -> None:
    with pytest.raises(ValueError, match="0.3.*allowed: 1, 0.5, 0.25, 0.125, 0.0625"):
        LatencySimulator(B, K).device_time(0, 0, 0.3)
