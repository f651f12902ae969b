"""flx's privacy accountant (:mod:`flx.privacy`) against the numbers pfl-research (apple/pfl-research) and Flower
(flwrlabs/flower, formerly adap/flower) publish for the same sampled Gaussian mechanism: the same sampling rate
``q``, noise multiplier ``sigma``, number of releases (rounds, or DP-SGD steps) and ``delta``.

Each case is data: the framework, the public file it comes from (repository, path, commit or release), the
parameters, their number (a noise multiplier calibrated to a target epsilon, or an epsilon) and which flx accountant
(``rdp`` or ``pld``) answers the same question. Two kinds of case:

* ``documented``: the number is written in the framework's repository (a tutorial's stored output, a test's
  reference value);
* ``rerun``: the framework documents the parameters but not the number; it was computed by running the framework's
  own accountant (pfl 0.6.0, Opacus 1.5.4) in a separate virtual environment on 2026-12-06 and is stored here as
  data, so this script needs neither package.

Prints a markdown table (case, parameters, their number, flx's number, relative difference) and the list of sources;
docs/results/privacy/compare.md holds its output with the reasons the numbers agree or differ.

Usage: ``PYTHONPATH=src python scripts/reproduce/privacy_compare.py``
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flx.privacy import Mechanism, calibrate, epsilon

SOURCES = {
    "pfl-tutorial": "apple/pfl-research, "
    "`tutorials/Introduction to Differential Privacy with Federated Learning.ipynb` (cells 19-23, stored output), "
    "read at commit c9d1f32f6e84fec984f448e2bc19a3e3fd5a4807 (file last changed in "
    "8baed22487a75c0fbd0ccaee5d85b11aa83f48ad)",
    "pfl-bench": "apple/pfl-research, `benchmarks/image_classification/configs/baseline.yaml` (central_epsilon 2.0, "
    "central_delta 1e-6, noise_cohort_size 1000, cohort_size 50, central_num_iterations 1500), "
    "`benchmarks/image_classification/pytorch/train.py` (population=1e6) and `benchmarks/utils/argument_parsing.py` "
    "(gaussian_moments_accountant = PLDPrivacyAccountant, q = noise_cohort_size / population), commit "
    "c9d1f32f6e84fec984f448e2bc19a3e3fd5a4807; numbers from pfl 0.6.0 (PyPI) with dp-accounting 0.5.1, "
    "prv-accountant 0.2.0",
    "flwr-rdp-test": "flwrlabs/flower, `framework/py/flwr/supercore/rdp_accountant_test.py`, "
    "`test_supported_models_match_reference_values` (TARGET_DELTA = 1e-6), commit "
    "42b22b66510e45fd8f0bcd45a7aed4e483cc31fa (the accountant ships in flwr 1.42.0 as "
    "`flwr/supercore/privacy_accounting/rdp_accountant.py`)",
    "flwr-opacus": "flwrlabs/flower, `examples/opacus/` (`pyproject.toml`: target-delta 1e-5, opacus==1.5.4; "
    "`opacus_fl/client_app.py`: noise 1.0 / 1.5 by partition parity, a new PrivacyEngine each round, 1 epoch; "
    "`opacus_fl/task.py`: CIFAR-10 IID partitions, 20% held out, batch 32), commit "
    "77068b8497df6ba8b114568e9f4c84808d010f98; 10 partitions = the default simulation's num_supernodes "
    "(`framework/py/flwr/supercore/constant.py`); numbers from Opacus 1.5.4 (PyPI)",
    "flwr-dp-sa": "flwrlabs/flower, `examples/fl-dp-sa/` (`pyproject.toml`: noise-multiplier 0.2, clipping-norm 10, "
    "num-sampled-clients 20; `fl_dp_sa/server_app.py`: fraction_fit 0.2, 3 rounds, "
    "DifferentialPrivacyClientSideFixedClipping, no accountant; README: 100 virtual clients), commit "
    "77068b8497df6ba8b114568e9f4c84808d010f98",
}


@dataclass(frozen=True)
class Case:
    """One published (or framework-computed) number and the flx question that matches it.

    Attributes:
        name: short label of the row.
        source: key into :data:`SOURCES`.
        kind: ``documented`` (written in the repository), ``rerun`` (their accountant run here) or ``none`` (the
            framework publishes no number for this setting).
        their_accountant: the accountant behind their number.
        theirs: their number (``None``: none published).
        mech: the matching flx mechanism (``mech.noise_multiplier`` is ignored when calibrating).
        steps: releases composed (rounds, or DP-SGD steps).
        delta: the delta.
        accountant: flx's accountant, ``rdp`` or ``pld``.
        target_epsilon: set: the row compares noise multipliers calibrated to this epsilon; unset: epsilons.
    """

    name: str
    source: str
    kind: str
    their_accountant: str
    theirs: float | None
    mech: Mechanism
    steps: int
    delta: float
    accountant: str
    target_epsilon: float | None = None

    def params(self) -> str:
        """The parameters, as one table cell."""
        sampling = "Poisson" if self.mech.sampling == "poisson" else "w/o replacement"
        head = f"q={self.mech.cohort}/{self.mech.num_clients:,} {sampling}"
        if self.mech.cohort == self.mech.num_clients:
            head = "q=1 (no sampling)"
        sigma = f"sigma={self.mech.noise_multiplier:g}"
        noise = f"eps={self.target_epsilon:g} -> sigma" if self.target_epsilon is not None else sigma
        return f"{head}, {noise}, T={self.steps}, delta={self.delta:g}"

    def flx(self) -> float:
        """flx's answer: the calibrated noise multiplier or the epsilon."""
        if self.target_epsilon is not None:
            return calibrate(self.target_epsilon, self.mech, self.steps, self.delta, self.accountant)
        return epsilon(self.mech, self.steps, self.delta, self.accountant)


def _poisson(sigma: float, population: int, sample: int) -> Mechanism:
    return Mechanism("poisson", sigma, population, sample)


def _fixed(sigma: float, population: int, sample: int) -> Mechanism:
    return Mechanism("fixed", sigma, population, sample)


PFL_TUTORIAL = _poisson(1.0, 1_000_000, 100)  # sampling_probability = 1e-4
PFL_BENCH = _poisson(1.0, 1_000_000, 1000)  # noise_cohort_size / population
OPACUS = (4000, 32)  # 50,000 / 10 partitions, 80% for training; batch 32: sample_rate = 1 / len(loader) = 1/125

CASES = [
    Case("pfl tutorial, PLD calibration", "pfl-tutorial", "documented", "pfl PLDPrivacyAccountant", 0.4975,
         PFL_TUTORIAL, 100, 1e-8, "pld", target_epsilon=2.0),
    Case("same, flx RDP", "pfl-tutorial", "documented", "pfl PLDPrivacyAccountant", 0.4975,
         PFL_TUTORIAL, 100, 1e-8, "rdp", target_epsilon=2.0),
    Case("same, pfl 0.6.0 rerun", "pfl-tutorial", "rerun", "pfl PLDPrivacyAccountant", 0.4974842071533203,
         PFL_TUTORIAL, 100, 1e-8, "pld", target_epsilon=2.0),
    Case("Flower RDP ref., no amplification", "flwr-rdp-test", "documented", "flwr RdpAccountant", 4.253499721177566,
         _poisson(1.2, 100, 100), 1, 1e-6, "rdp"),
    Case("Flower RDP ref., Poisson", "flwr-rdp-test", "documented", "flwr RdpAccountant", 0.975892494240961,
         _poisson(1.2, 1000, 10), 100, 1e-6, "rdp"),
    Case("same, flx PLD", "flwr-rdp-test", "documented", "flwr RdpAccountant", 0.975892494240961,
         _poisson(1.2, 1000, 10), 100, 1e-6, "pld"),
    Case("Flower RDP ref., w/o replacement", "flwr-rdp-test", "documented", "flwr RdpAccountant", 2.7582097098379643,
         _fixed(1.5, 1000, 100), 10, 1e-6, "rdp"),
    Case("same, flx sigma = 2 x 1.5", "flwr-rdp-test", "documented", "flwr RdpAccountant", 2.7582097098379643,
         _fixed(3.0, 1000, 100), 10, 1e-6, "rdp"),
    Case("pfl CIFAR-10 central DP, PLD", "pfl-bench", "rerun", "pfl PLDPrivacyAccountant", 0.616145133972168,
         PFL_BENCH, 1500, 1e-6, "pld", target_epsilon=2.0),
    Case("same, PRV", "pfl-bench", "rerun", "pfl PRVPrivacyAccountant", 0.6161689758300781,
         PFL_BENCH, 1500, 1e-6, "pld", target_epsilon=2.0),
    Case("same, RDP", "pfl-bench", "rerun", "pfl RDPPrivacyAccountant", 0.7137775421142578,
         PFL_BENCH, 1500, 1e-6, "rdp", target_epsilon=2.0),
    Case("Flower Opacus example, round 1, sigma 1.0", "flwr-opacus", "rerun", "Opacus PRVAccountant (default)",
         0.6239858173010774, _poisson(1.0, *OPACUS), 125, 1e-5, "pld"),
    Case("same, sigma 1.5", "flwr-opacus", "rerun", "Opacus PRVAccountant (default)", 0.26407416900748854,
         _poisson(1.5, *OPACUS), 125, 1e-5, "pld"),
    Case("same, sigma 1.0, RDP", "flwr-opacus", "rerun", "Opacus RDPAccountant", 1.1227253079496566,
         _poisson(1.0, *OPACUS), 125, 1e-5, "rdp"),
    Case("same, sigma 1.0, 3 rounds composed", "flwr-opacus", "rerun", "Opacus PRVAccountant (default)",
         0.9357522306715643, _poisson(1.0, *OPACUS), 375, 1e-5, "pld"),
    Case("Flower fl-dp-sa example", "flwr-dp-sa", "none", "no accountant", None,
         _fixed(0.2, 100, 20), 3, 1e-5, "rdp"),
]  # fmt: skip


def rel_diff(theirs: float | None, ours: float) -> str:
    """``(flx - theirs) / theirs`` as a table cell: a percentage, or the exponent form below 0.01%."""
    if theirs is None:
        return "-"
    d = (ours - theirs) / theirs
    return f"{d:+.1e}" if abs(d) < 1e-4 else f"{d:+.2%}"


def table(cases: list[Case]) -> list[str]:
    """The markdown table and the numbered sources under it."""
    keys = list(dict.fromkeys(c.source for c in cases))
    lines = [
        "| # | case | kind | parameters | quantity | their number (accountant) | flx (accountant) | rel. diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, c in enumerate(cases, 1):
        ours = c.flx()
        quantity = "sigma" if c.target_epsilon is not None else "epsilon"
        theirs = "none published" if c.theirs is None else f"{c.theirs:.10g}"
        mark = f"[{keys.index(c.source) + 1}]"
        ours_cell = f"{ours:.10g}" if math.isfinite(ours) else "inf"
        lines.append(
            f"| {i} | {c.name} {mark} | {c.kind} | {c.params()} | {quantity} | {theirs} ({c.their_accountant}) "
            f"| {ours_cell} ({c.accountant}, {c.mech.sampling}) | {rel_diff(c.theirs, ours)} |"
        )
    lines += ["", "Sources:", ""]
    lines += [f"{i}. {SOURCES[k]}" for i, k in enumerate(keys, 1)]
    return lines


def main() -> None:
    print("\n".join(table(CASES)))


if __name__ == "__main__":
    main()
