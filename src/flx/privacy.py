r"""Privacy accounting of user-level central DP (the DP-FedAvg family): what a run's rounds have cost, as
:math:`(\varepsilon, \delta)`, from Google's ``dp-accounting`` library.

A round releases the sum of the cohort's clipped model updates (each of L2 norm at most :math:`C`) plus Gaussian
noise of standard deviation :math:`\sigma C` (McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private
Recurrent Language Models", ICLR 2018, arXiv:1710.06963). The privacy unit is a client: all its rows. How the cohort
is drawn decides the neighbouring relation and so the event the accountant composes:

* ``poisson``: every client joins the round independently with probability :math:`q`. Neighbouring federations differ
  by one client being present or absent, the sum's sensitivity is :math:`C`, and a round is
  ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`` (PLD or RDP accountant).
* ``fixed``: :math:`m` of the :math:`N` clients without replacement. :math:`N` is public and neighbours replace one
  client's data, so the sum's sensitivity is :math:`2C`: a round is ``SampledWithoutReplacementDpEvent(N, m,
  GaussianDpEvent(sigma / 2))`` (Wang, Balle, Kasiviswanathan, AISTATS 2019, Theorem 27; the library has it for the
  RDP accountant only).

With adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive
Clipping", NeurIPS 2021, arXiv:1905.03871) a round releases a second Gaussian sum, the count of clients whose update
norm was at most :math:`C` (each reports :math:`b_i - 1/2`, so the sum's sensitivity is 1/2 under add/remove),
with noise :math:`\sigma_b`. The pair costs exactly one Gaussian mechanism with :math:`\sigma` when the update's
noise is raised to :math:`\sigma_\Delta = (\sigma^{-2} - (2\sigma_b)^{-2})^{-1/2}` (their Theorem 1; under
``fixed`` both sensitivities double and the same identity holds), so the accountant sees :math:`\sigma` in both
cases (:func:`update_noise`).

:math:`\varepsilon` after :math:`T` rounds is a pure function of :math:`(q, \sigma, T, \delta)` (:func:`epsilon`):
a resumed run computes what the uninterrupted one did, to the bit.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from flx.errors import ConfigError, bad_value

ACCOUNTANTS = ("pld", "rdp")
SAMPLINGS = ("poisson", "fixed")
PLD_DISCRETIZATION = 1e-3  # the PLD grid (the library default: 1e-4): an upper bound either way, and much faster
SIGMA_FLOOR = 0.1
"""The least noise multiplier (``privacy.noise_multiplier`` and calibration alike): below it a round alone costs an
epsilon in the hundreds (no guarantee left to state), and the PLD accountant's grid grows as 1 / sigma^2 (sigma 0.01:
more memory than a machine has; 1e-12: the library refuses)."""
NOISE_FLOOR_WHY = "below it epsilon is in the hundreds after one round and the accountant cannot follow"
ACCOUNTANT_ERRORS = (ValueError, OverflowError, FloatingPointError, ZeroDivisionError, MemoryError)
"""What ``dp_accounting`` raises where it cannot account for a mechanism (a PLD too large, an overflow)."""


@dataclass(frozen=True)
class Mechanism:
    """One round's release, as the accountant needs it.

    Attributes:
        sampling: ``poisson`` (each client with probability ``cohort / num_clients``) or ``fixed`` (``cohort`` of
            ``num_clients`` without replacement).
        noise_multiplier: :math:`\\sigma`, the noise's standard deviation over the clip :math:`C` (the total one with
            adaptive clipping: :func:`update_noise`).
        num_clients: :math:`N`, the clients that can be drawn.
        cohort: the expected cohort size :math:`qN` (``poisson``) or the cohort size :math:`m` (``fixed``).
    """

    sampling: str
    noise_multiplier: float
    num_clients: int
    cohort: int

    @property
    def q(self) -> float:
        """The sampling rate :math:`q = m / N`."""
        return self.cohort / self.num_clients


def check_budget_keys(
    noise_multiplier: float | None, target_epsilon: float | None, delta: float, sampling: str, accountant: str
) -> None:
    """Raises a one-line :class:`~flx.errors.ConfigError` for ``privacy.*`` keys no mechanism can run with: no noise
    and no target, a noise below :data:`SIGMA_FLOOR` or a target that is not positive, a delta outside (0, 1), an
    unaccountable sampling. The values are finite numbers already (:func:`flx.errors.check_fields`)."""
    if noise_multiplier is None and target_epsilon is None:
        raise bad_value("privacy.noise_multiplier", None, "set it (> 0) or privacy.target_epsilon to calibrate it")
    if noise_multiplier is not None and not noise_multiplier >= SIGMA_FLOOR:
        why = "no noise is no privacy" if not noise_multiplier > 0 else NOISE_FLOOR_WHY
        raise bad_value("privacy.noise_multiplier", noise_multiplier, f"must be >= {SIGMA_FLOOR:g} ({why})")
    if target_epsilon is not None and not target_epsilon > 0:
        raise bad_value("privacy.target_epsilon", target_epsilon, "> 0")
    if not 0 < delta < 1:
        raise bad_value("privacy.delta", delta, "in (0, 1), below 1 / (the population's size)")
    try:
        check_pairing(sampling, accountant)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_pairing(sampling: str, accountant: str) -> None:
    """Raises ``ValueError`` (one line) for a sampling the accountant cannot account for."""
    if sampling not in SAMPLINGS:
        raise ValueError(f"privacy.sampling={sampling}: allowed: {', '.join(SAMPLINGS)}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"privacy.accountant={accountant}: allowed: {', '.join(ACCOUNTANTS)}")
    if sampling == "fixed" and accountant != "rdp":
        raise ValueError(
            f"privacy.accountant={accountant}: fixed-size sampling (privacy.sampling=fixed) is accounted by rdp only "
            "(sampling without replacement); use privacy.accountant=rdp or privacy.sampling=poisson"
        )


def round_event(mech: Mechanism) -> Any:
    """The ``dp_accounting`` event of one round (see the module docstring)."""
    import dp_accounting

    if mech.sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(mech.q, dp_accounting.GaussianDpEvent(mech.noise_multiplier))
    gaussian = dp_accounting.GaussianDpEvent(mech.noise_multiplier / 2)  # replace-one: the sum moves by up to 2C
    return dp_accounting.SampledWithoutReplacementDpEvent(mech.num_clients, mech.cohort, gaussian)


@contextmanager
def _quiet() -> Iterator[None]:
    """The RDP accountant warns (absl) each time it drops a fractional order whose series does not converge (large
    ``q``); dropping an order only loosens the bound, so the warnings are kept out of the run's output."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _accountant(name: str, sampling: str) -> Any:
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    if name == "pld":
        return pld_privacy_accountant.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
    relation = dp_accounting.NeighboringRelation
    rel = relation.REPLACE_ONE if sampling == "fixed" else relation.ADD_OR_REMOVE_ONE
    return rdp_privacy_accountant.RdpAccountant(neighboring_relation=rel)


@lru_cache(maxsize=4096)
def epsilon(mech: Mechanism, rounds: int, delta: float, accountant: str = "pld") -> float:
    """:math:`\\varepsilon` at ``delta`` after ``rounds`` rounds of ``mech`` (0 before the first; ``inf`` without
    noise), computed afresh from ``(mech, rounds, delta)``: the same number whenever it is asked."""
    if rounds <= 0:
        return 0.0
    if mech.noise_multiplier <= 0:
        return math.inf
    import dp_accounting

    if accountant == "pld" and mech.sampling == "poisson":  # one round's PLD built once, composed per call
        return float(_round_pld(mech).self_compose(rounds).get_epsilon_for_delta(delta))
    acc = _accountant(accountant, mech.sampling)
    with _quiet():
        acc.compose(dp_accounting.SelfComposedDpEvent(round_event(mech), rounds))
        return float(acc.get_epsilon(delta))


@lru_cache(maxsize=64)
def _round_pld(mech: Mechanism) -> Any:
    """One Poisson round's privacy loss distribution, as the library's PLD accountant builds it for
    ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`` (add or remove one): built once per mechanism, so the
    per-round epsilon costs only the composition, not a fresh accountant."""
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=mech.noise_multiplier, value_discretization_interval=PLD_DISCRETIZATION, sampling_prob=mech.q
    )


def accounted(mech: Mechanism, rounds: int, delta: float, accountant: str, unit: str = "rounds") -> float:
    """:func:`epsilon`, with the accountant's failure to account for ``rounds`` events of ``mech`` (an overflow, a
    PLD too large) as one line naming ``privacy.noise_multiplier`` and the fix. Asked at the run's check, before
    anything is written, for the epsilon the ledger will ask for; ``unit``: what the events are (the message's)."""
    try:
        return epsilon(mech, rounds, delta, accountant)
    except ACCOUNTANT_ERRORS as e:
        what = f"the accountant ({accountant}) cannot account for {rounds} {unit} of it ({type(e).__name__}: {e})"
        raise bad_value("privacy.noise_multiplier", mech.noise_multiplier, f"{what}; raise it") from None


def calibrate(target_epsilon: float, mech: Mechanism, rounds: int, delta: float, accountant: str = "pld") -> float:
    """The smallest noise multiplier :math:`\\sigma` (to 1e-4 relative) whose ``rounds`` rounds cost at most
    ``target_epsilon`` at ``delta`` (``mech.noise_multiplier`` is ignored): a bracket by doubling from 1, then the
    library's Brent search inside it, then stepped up until the budget holds (Brent stops within its tolerance on
    either side).

    Raises:
        ConfigError: one line naming ``privacy.target_epsilon`` and the fix: the target is met even at
            :data:`SIGMA_FLOOR` (a target too large for the accountant), or the accountant fails on the way."""
    try:
        return _calibrate(target_epsilon, mech, rounds, delta, accountant)
    except ACCOUNTANT_ERRORS as e:
        if isinstance(e, ConfigError):
            raise
        what = f"the accountant ({accountant}) failed calibrating it over {rounds} rounds ({type(e).__name__}: {e})"
        raise bad_value("privacy.target_epsilon", target_epsilon, f"{what}; {CALIBRATION_FIX}") from None


CALIBRATION_FIX = "lower privacy.target_epsilon, or set privacy.noise_multiplier (>= 0.1) instead"


def _calibrate(target_epsilon: float, mech: Mechanism, rounds: int, delta: float, accountant: str) -> float:
    """:func:`calibrate`'s search."""
    import dp_accounting

    def spent(sigma: float) -> float:
        return epsilon(_with(mech, sigma), rounds, delta, accountant)

    low, high = 0.5, 1.0
    while spent(high) > target_epsilon:
        low, high = high, high * 2
    while spent(low) <= target_epsilon:
        if low <= SIGMA_FLOOR:
            why = f"met with noise_multiplier={SIGMA_FLOOR:g} already, the least noise calibrated ({NOISE_FLOOR_WHY})"
            raise bad_value("privacy.target_epsilon", target_epsilon, f"{why}; {CALIBRATION_FIX}")
        low, high = max(low / 2, SIGMA_FLOOR), low
    with _quiet():
        sigma = dp_accounting.calibrate_dp_mechanism(
            lambda: _accountant(accountant, mech.sampling),
            lambda s: dp_accounting.SelfComposedDpEvent(round_event(_with(mech, s)), rounds),
            target_epsilon,
            delta,
            dp_accounting.ExplicitBracketInterval(low, high),
            tol=1e-5,
        )
    while spent(sigma) > target_epsilon:
        sigma *= 1 + 1e-4
    return float(sigma)


def _with(mech: Mechanism, sigma: float) -> Mechanism:
    return Mechanism(mech.sampling, float(sigma), mech.num_clients, mech.cohort)


MAX_RUNS_PER_ROUND = 10**4
"""The largest ``privacy.runs_per_round`` (local DP's calibration): a client trains at most once per draw, and a round
draws ``algo.clients_per_round`` clients."""


def update_noise(sigma: float, count_noise: float) -> float:
    """:math:`\\sigma_\\Delta = (\\sigma^{-2} - (2\\sigma_b)^{-2})^{-1/2}`: the update's noise multiplier that, with the
    clipped-count release of noise ``count_noise`` (:math:`\\sigma_b`), costs one Gaussian of ``sigma``
    (Andrew et al. 2021, Theorem 1). Needs :math:`2\\sigma_b > \\sigma`."""
    if not 2 * count_noise > sigma:
        raise ValueError(
            f"privacy.count_noise={count_noise:g}: must exceed noise_multiplier / 2 = {sigma / 2:g} (the clipped "
            "count would spend the whole budget); raise it, or leave it null (the default, max(cohort / 20, sigma))"
        )
    return (sigma**-2 - (2 * count_noise) ** -2) ** -0.5
