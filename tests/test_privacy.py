"""The privacy accountant (:mod:`flx.privacy`): the library's own numbers for hand-picked mechanisms, below a
closed-form RDP bound computed here, calibration that meets its target tightly, and the adaptive-clipping noise
split."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from flx import privacy
from flx.privacy import Mechanism

CASES = [  # (N, expected cohort m, sigma, rounds, delta): q = m / N from 0.01 to 0.2
    (1000, 10, 1.1, 100, 1e-5),
    (100, 10, 1.0, 30, 1e-5),
    (500, 100, 2.0, 50, 1e-6),
    (10_000, 100, 0.8, 1000, 1e-5),
]


def rdp_bound(q: float, sigma: float, rounds: int, delta: float) -> float:
    """A closed-form bound on the epsilon of ``rounds`` Poisson-subsampled Gaussian rounds, written here from the
    formula, not the library: at an integer order ``a`` one round's RDP is
    ``log(sum_k C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2))) / (a - 1)`` (Mironov, Talwar, Zhang 2019,
    arXiv:1908.10530, Sec. 3.3), composition adds it over rounds, and ``eps = T rho(a) + log(1 / delta) / (a - 1)``
    (Mironov 2017, Prop. 3) is minimised over ``a = 2..256``."""
    best = math.inf
    for a in range(2, 257):
        terms = [
            math.lgamma(a + 1) - math.lgamma(k + 1) - math.lgamma(a - k + 1)
            + (a - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma**2)
            for k in range(a + 1)
        ]  # fmt: skip
        top = max(terms)
        rho = (top + math.log(sum(math.exp(t - top) for t in terms))) / (a - 1)
        best = min(best, rounds * rho + math.log(1 / delta) / (a - 1))
    return best


@pytest.mark.parametrize("n, m, sigma, rounds, delta", CASES)
def test_epsilon_is_the_library_s_and_below_the_closed_form_bound(n, m, sigma, rounds, delta) -> None:
    mech = Mechanism("poisson", sigma, n, m)
    q = m / n
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(event, rounds)  # composed by count, not by a self-composed event: another path through the library
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=privacy.PLD_DISCRETIZATION)
    pld.compose(event, rounds)
    ours_rdp, ours_pld = privacy.epsilon(mech, rounds, delta, "rdp"), privacy.epsilon(mech, rounds, delta, "pld")
    assert ours_rdp == pytest.approx(rdp.get_epsilon(delta), rel=1e-9)
    assert ours_pld == pytest.approx(pld.get_epsilon(delta), rel=1e-6)
    bound = rdp_bound(q, sigma, rounds, delta)
    assert ours_rdp <= bound * (1 + 1e-9)  # the library's orders include the integers; its conversion is tighter
    assert ours_pld <= ours_rdp * 1.001  # PLD is the tighter accountant (up to its discretization)
    assert 0 < ours_pld < math.inf


def test_without_subsampling_the_bound_is_the_gaussian_s() -> None:
    """q = 1: every round is the Gaussian mechanism, RDP ``a / (2 sigma^2)`` exactly (Mironov 2017, Prop. 7)."""
    sigma, rounds, delta = 5.0, 10, 1e-5
    closed = min(rounds * a / (2 * sigma**2) + math.log(1 / delta) / (a - 1) for a in range(2, 257))
    assert rdp_bound(1.0 - 1e-12, sigma, rounds, delta) == pytest.approx(closed, rel=1e-6)
    assert privacy.epsilon(Mechanism("poisson", sigma, 10, 10), rounds, delta, "rdp") <= closed


def test_fixed_size_sampling_is_replace_one_with_twice_the_sensitivity() -> None:
    """``fixed``: the RDP accountant's sampling without replacement, at ``sigma / 2`` (a replaced client moves the sum
    by up to 2C), which costs more than Poisson sampling at the same rate and noise."""
    n, m, sigma, rounds, delta = 200, 20, 1.5, 40, 1e-5
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(sigma / 2)), rounds)
    fixed = privacy.epsilon(Mechanism("fixed", sigma, n, m), rounds, delta, "rdp")
    assert fixed == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    assert fixed > privacy.epsilon(Mechanism("poisson", sigma, n, m), rounds, delta, "rdp")


def test_epsilon_grows_with_rounds_and_starts_at_zero() -> None:
    mech = Mechanism("poisson", 1.0, 100, 10)
    values = [privacy.epsilon(mech, t, 1e-5, "pld") for t in range(0, 6)]
    assert values[0] == 0.0 and all(a < b for a, b in zip(values, values[1:]))
    assert privacy.epsilon(Mechanism("poisson", 0.0, 100, 10), 3, 1e-5) == math.inf


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibration_meets_the_target_and_no_less_noise_would(accountant: str) -> None:
    mech, rounds, delta, target = Mechanism("poisson", 1.0, 100, 10), 30, 1e-5, 8.0
    sigma = privacy.calibrate(target, mech, rounds, delta, accountant)
    at = privacy.epsilon(Mechanism("poisson", sigma, 100, 10), rounds, delta, accountant)
    below = privacy.epsilon(Mechanism("poisson", sigma * (1 - 1e-3), 100, 10), rounds, delta, accountant)
    assert at <= target < below


def test_adaptive_clipping_noise_split_costs_one_gaussian() -> None:
    """Andrew et al. 2021, Theorem 1: ``sigma_update^-2 + (2 sigma_b)^-2 = sigma^-2``."""
    sigma, sigma_b = 1.2, 0.9
    s = privacy.update_noise(sigma, sigma_b)
    assert s**-2 + (2 * sigma_b) ** -2 == pytest.approx(sigma**-2, rel=1e-12) and s > sigma
    with pytest.raises(ValueError, match="privacy.count_noise=0.5: must exceed noise_multiplier / 2 = 1"):
        privacy.update_noise(2.0, 0.5)


def test_pairings() -> None:
    privacy.check_pairing("poisson", "pld")
    privacy.check_pairing("fixed", "rdp")
    with pytest.raises(ValueError, match="privacy.accountant=pld: fixed-size sampling .* rdp only"):
        privacy.check_pairing("fixed", "pld")
    with pytest.raises(ValueError, match="privacy.sampling=shuffle: allowed: poisson, fixed"):
        privacy.check_pairing("shuffle", "rdp")


def test_the_numbers_pfl_research_and_flower_document() -> None:
    """scripts/reproduce/privacy_compare.py's documented rows that pose the same question to the same accountant:
    Flower's RDP accountant's reference values (bit-equal to 1e-12: the same dp-accounting computation) and
    pfl-research's tutorial's calibrated noise (PLD, 0.4975 as printed to 4 digits)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "reproduce" / "privacy_compare.py"
    spec = importlib.util.spec_from_file_location("privacy_compare", path)
    compare = importlib.util.module_from_spec(spec)
    sys.modules["privacy_compare"] = compare  # dataclasses look their module up
    spec.loader.exec_module(compare)
    rows = {c.name: c for c in compare.CASES}
    for name in ("Flower RDP ref., no amplification", "Flower RDP ref., Poisson", "same, flx sigma = 2 x 1.5"):
        assert rows[name].flx() == pytest.approx(rows[name].theirs, rel=1e-12), name
    assert rows["pfl tutorial, PLD calibration"].flx() == pytest.approx(0.4975, abs=5e-5)


def test_an_accountant_failure_is_one_line_naming_the_key_and_the_fix() -> None:
    """Noise far below the floor: the PLD accountant raises (a grid too large); :func:`privacy.accounted`, asked at the
    run's check, turns it into one line naming privacy.noise_multiplier, and calibration names the target."""
    from flx.errors import ConfigError

    mech = privacy.Mechanism("poisson", 1e-12, 100, 10)
    with pytest.raises(ConfigError, match=r"^privacy\.noise_multiplier=1e-12: the accountant \(pld\) cannot account"):
        privacy.accounted(mech, 30, 1e-5, "pld")
    with pytest.raises(
        ConfigError, match=r"^privacy\.target_epsilon=1000000\.0: met with noise_multiplier=0\.1 already"
    ):
        privacy.calibrate(1e6, privacy.Mechanism("poisson", 1.0, 100, 10), 30, 1e-5, "pld")


@pytest.mark.parametrize(
    ("noise", "target", "match"),
    [
        (0.05, None, r"^privacy\.noise_multiplier=0\.05: must be >= 0\.1"),
        (0.0, None, r"^privacy\.noise_multiplier=0\.0: must be >= 0\.1 \(no noise is no privacy\)"),
        (None, -1.0, r"^privacy\.target_epsilon=-1\.0: > 0"),
    ],
)
def test_budget_keys_below_their_ranges_are_one_line(noise: float | None, target: float | None, match: str) -> None:
    from flx.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        privacy.check_budget_keys(noise, target, 1e-5, "poisson", "pld")
