"""Device profiles: per-iteration compute times per device type and width ratio, model size, link rates.

Su et al., "WHALE-FL: Wireless and Heterogeneity Aware Latency Efficient Federated Learning over Mobile Devices via
Adaptive Subnetwork Scheduling" (section "WHALE-FL Testbed"). The numbers are the authors' released code's
(github.com/BESTTOOLBOX/WHALE-FL, ``On-Server/main_train_fisher.py``, ``device_list/*.csv``): the profiled CNN@MNIST
table and the full-model upload size; the paper itself gives only the link rates of its testbed (Wi-Fi 5 / LTE /
Bluetooth 3.0 = 80 / 20 / 10 Mbps).

.. math::
    T^{co}(\\tau, \\rho) = t(\\tau, \\rho)\\, B\\, K, \\qquad T^{tr}(\\rho) = \\frac{q\\,\\rho^2}{R}

``t(tau, rho)``: the table below (seconds; the code multiplies it by batch size ``B`` and local iterations ``K``),
``q``: full-model upload size in bits, ``rho``: width ratio (parameters scale as ``rho^2``), ``R``: link rate.
Pure Python (no numpy, no torch): the pre-run config check imports it.
"""

from __future__ import annotations

import math

WIDTHS = (1.0, 0.5, 0.25, 0.125, 0.0625)
"""The profiled width ratios ``rho = s^(p-1)``, ``s = 1/2``, levels ``p = 1..5`` (largest first)."""

TYPES = ("MacBookPro2018", "Xavier", "TX2", "Nano", "RaspberryPi")
"""The testbed's device types, most to least capable (Jetson Xavier / TX2 / Nano, Raspberry Pi 4)."""

PROFILES: dict[str, dict[str, tuple[float, ...]]] = {
    # the authors' profiled CNN@MNIST times, one column of WIDTHS per type (``device_list/*.csv``)
    "cnn_mnist": {
        "MacBookPro2018": (0.0083647, 0.0038257, 0.0021069, 0.0014589, 0.0009867),
        "Xavier": (0.04070369, 0.0127832, 0.0057802, 0.003491786, 0.002557199),
        "TX2": (0.046046102, 0.014587217, 0.006172761, 0.003529953, 0.002453266),
        "Nano": (0.048899315, 0.015707265, 0.006548797, 0.003732, 0.002509417),
        "RaspberryPi": (0.051820623, 0.016849187, 0.006933952, 0.003939243, 0.002569063),
    },
}
"""Compute profiles by name: device type -> ``t(type, rho)`` for each ratio of :data:`WIDTHS`."""

UPLOAD_BITS = 12_352_000
"""The authors' full-model upload size (~1.55 M parameters x 8 bit): 0.1544 s at 80 Mbps."""

LINKS = {"paper": (80.0, 20.0, 10.0), "code": (80.0, 40.0, 20.0, 15.0)}
"""Link rates in Mbps: the paper's Wi-Fi 5 / LTE / Bluetooth 3.0, and the authors' code's four rates."""


def width_level(width: float) -> int:
    """The index of ``width`` in :data:`WIDTHS` (0 = full model).

    >>> width_level(0.25)
    2

    Raises:
        ValueError: ``width`` is not a profiled ratio.
    """
    for p, w in enumerate(WIDTHS):
        if math.isclose(width, w, rel_tol=1e-9):
            return p
    raise ValueError(f"width {width!r} is not profiled; allowed: {', '.join(f'{w:g}' for w in WIDTHS)}")


def iteration_time(profile: str, device_type: str, width: float) -> float:
    """``t(type, rho)``: the profiled compute time of ``device_type`` at width ratio ``width`` (seconds).

    >>> iteration_time("cnn_mnist", "Xavier", 0.5)
    0.0127832
    """
    return PROFILES[profile][device_type][width_level(width)]
