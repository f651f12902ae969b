"""``LatencySimulator``: compute / upload / device / round times as formulas of the profile and the trace."""

from __future__ import annotations

import pytest

from flx.errors import ConfigError
from flx.systems.profiles import iteration_time
from flx.systems.simulator import LatencySimulator

B, K = 32, 5


def test_compute_divides_by_the_load_and_upload_by_the_rate() -> None:
    """``T^co = t B K / u`` and ``T^tr = q rho^2 / R`` with this round's ``u`` and ``R`` from the trace."""
    sim = LatencySimulator(B, K, load_min=0.2, switch_prob=0.5)
    for client, r, w in [(0, 0, 1.0), (7, 13, 0.25), (19, 200, 0.0625)]:
        t = iteration_time("cnn_mnist", sim.device_type(client), w)
        assert sim.compute_time(client, r, w) == pytest.approx(t * B * K / sim.load(client, r), rel=1e-12)
        assert sim.upload_time(client, r, w) == pytest.approx(12_352_000 * w**2 / sim.link_rate(client, r), rel=1e-12)
        assert sim.compute_time(client, r, w, steps=2 * K) == pytest.approx(2 * sim.compute_time(client, r, w))


def test_round_time_is_the_slowest_client() -> None:
    sim = LatencySimulator(B, K)
    widths = {0: 1.0, 4: 0.0625, 9: 0.5, 13: 0.25}
    steps = {9: 20}
    expected = max(sim.device_time(c, 5, w, steps.get(c)) for c, w in widths.items())
    assert sim.round_time(5, widths, steps) == expected
    assert sim.round_time(5, {}) == 0.0


def test_clients_beyond_the_device_list_wrap_around() -> None:
    """Client ``i`` runs on device ``i mod M``: client 23 of ``mobile20`` sees device 3's type and trace."""
    sim = LatencySimulator(B, K)
    assert sim.device(23) == 3 and sim.device_type(23) == sim.device_type(3)
    assert [sim.device_time(23, r) for r in range(10)] == [sim.device_time(3, r) for r in range(10)]


def test_upload_bits_from_the_parameter_count() -> None:
    """``upload_bits=null``: ``q = bits_per_param x num_params`` (fp32: 32 bits)."""
    sim = LatencySimulator(B, K, num_params=1000, upload_bits=None, dynamics="static")
    assert sim.upload_bits == 32_000
    assert sim.upload_time(0, 0) == pytest.approx(32_000 / 80e6)
    with pytest.raises(ValueError, match="num_params"):
        LatencySimulator(B, K, upload_bits=None)


def test_bad_settings_are_one_line_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"^system.switch_prob=2: must be in \[0, 1\]$"):
        LatencySimulator(B, K, switch_prob=2)
    with pytest.raises(ConfigError, match=r"^system.speed=1: unknown key; allowed: name, types"):
        LatencySimulator(B, K, speed=1)
