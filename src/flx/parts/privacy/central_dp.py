r"""User-level central differential privacy: DP-FedAvg with clipping, Gaussian noise and an accountant.

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models", ICLR 2018
(arXiv:1710.06963), Algorithm 1 with the fixed-denominator estimator :math:`\tilde f_f`; adaptive clipping from
Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021
(arXiv:1905.03871), Algorithm 1. Round :math:`t`, global model :math:`w^t`, clip :math:`C`, noise multiplier
:math:`\sigma`, expected cohort size :math:`\bar m = qN`:

1. the cohort is drawn by this part (``privacy.sampling``): ``poisson``, every client independently with probability
   :math:`q = m / N` (``algo.clients_per_round`` is then the expected size), or ``fixed``, :math:`m` of :math:`N`
   without replacement; the accountant matches it (:mod:`flx.privacy`);
2. each client's update :math:`\Delta_i = w_i - w^t` (everything it uploads: trainable parameters and float buffers)
   is clipped, :math:`\hat\Delta_i = \Delta_i \min(1, C / \lVert \Delta_i \rVert_2)` (flat), or each of its
   :math:`L` tensors to :math:`C / \sqrt{L}` (``clip_mode=per_layer``: the whole still within :math:`C`); every
   client counts once (weight 1, whatever ``algo.weighting``);
3. the server adds noise once to the sum and divides by the expected cohort size, not the drawn one:
   :math:`w^{t+1} = w^t + \big(\sum_i \hat\Delta_i + \mathcal N(0, \sigma_\Delta^2 C^2 I)\big) / \bar m`, then the
   configured server optimizer steps towards it. The noise is drawn from a generator seeded by ``(seed, round)``,
   the same on every rank, so 2 processes give the run of 1 and a resumed run the uninterrupted one; a real
   deployment would draw it from a secure source on the server;
4. adaptive clipping (``adaptive=true``): clients also send :math:`b_i - 1/2` with
   :math:`b_i = [\lVert \Delta_i \rVert \le C]` (sensitivity 1/2), the server releases
   :math:`\tilde b = (\sum_i (b_i - 1/2) + \mathcal N(0, \sigma_b^2)) / \bar m + 1/2` and sets
   :math:`C \leftarrow C \exp(-\eta_C (\tilde b - \gamma))` (target quantile :math:`\gamma`); the update's noise is
   raised to :math:`\sigma_\Delta` so that both releases together cost one Gaussian of :math:`\sigma`
   (:func:`flx.privacy.update_noise`); without it :math:`\sigma_\Delta = \sigma`.

A round with an empty Poisson cohort leaves the model as it is (no release depends on the data) and is still
accounted. ``privacy/epsilon`` (at ``privacy.delta``) is logged every round and ends the final line; with
``target_epsilon`` and no ``noise_multiplier`` the noise is calibrated before round 1 so that ``algo.rounds`` rounds
spend it; with both, ``target_epsilon`` is a budget and the run stops before a round that would exceed it.

What this covers: the global model. Parts that upload more than the model update (scores, losses, Fisher values,
duals, personal models) are refused at start, naming the channel (``PartTraits.uploads``, :mod:`flx.composition`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from typing_extensions import override

from flx import privacy
from flx.aggregation import numel
from flx.clipping import clip_factors
from flx.errors import ConfigError, bad_value
from flx.parts.privacy.dp_budget import Budgeted, BudgetParams
from flx.sampling import derive_seed
from flx.traits import Channel, PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView, Round
    from flx.hooks import Build

_NOISE_TAG = 0x4450  # "DP": the round's noise stream, derive_seed(seed, round, tag)
_COUNT, _BELOW = "privacy/count", "privacy/below"  # clients aggregated; clients within the clip (adaptive)


@dataclass(frozen=True)
class PrivacyParams(BudgetParams):
    """The ``privacy.*`` keys (``configs/privacy/central.yaml``)."""

    clip: float = 0.1
    adaptive: bool = False
    target_quantile: float = 0.1  # not the paper's median: see docs/privacy.md, adaptive clipping
    clip_lr: float = 0.2
    count_noise: float | None = None


class CentralDP(Budgeted):
    """Clips every client's update, noises the cohort's sum once on the server, accounts for every round."""

    traits = PartTraits(
        uploads={  # released through this part's own noised count
            _COUNT: Channel("its share of the cohort count", "own"),
            _BELOW: Channel("whether its update was within the clip (adaptive clipping)", "own"),
        },
        vectorizable=True,  # on_client_end runs with each client's model in the net on both runners
        aggregator=("mean", "privacy=central noises the weighted mean: use mean"),
        protects=("uploads", "cohort"),
        metrics=("privacy/epsilon", "privacy/clip"),
    )

    def __init__(self, **params: Any) -> None:
        self.params: PrivacyParams = PrivacyParams(**params)
        p = self.params
        p.check("a client's update")
        if not 0 < p.target_quantile < 1:
            raise bad_value("privacy.target_quantile", p.target_quantile, "in (0, 1)")
        if not p.clip_lr > 0:
            raise bad_value("privacy.clip_lr", p.clip_lr, "> 0")
        if p.count_noise is not None and not p.count_noise > 0:
            raise bad_value("privacy.count_noise", p.count_noise, "> 0, or null for the expected cohort / 20")
        self.clip = float(p.clip)  # C, moved by adaptive clipping
        self.sigma: float | None = p.noise_multiplier  # sigma, or calibrated at the fit's start
        self.mechanism: privacy.Mechanism | None = None
        self.rounds = 0  # rounds accounted

    # ------------------------------------------------------------------ setup
    @override
    def check(self, build: Build) -> None:
        # the population the cohort is drawn from: the clients that train (evaluation-only clients never do)
        p, n, cfg = self.params, build.clients.num_train_clients, build.cfg
        if not cfg.clients_per_round <= n:
            raise bad_value("algo.clients_per_round", cfg.clients_per_round, f"at most the {n} clients")
        if p.delta >= 1 / n:
            raise bad_value("privacy.delta", p.delta, f"below 1 / N = {1 / n:g} (else one client may be exposed)")
        self._setup(n, cfg.clients_per_round, cfg.rounds)

    def _setup(self, num_clients: int, cohort: int, rounds: int) -> None:
        """The round's mechanism; the noise multiplier calibrated to ``target_epsilon`` over ``rounds`` rounds when
        none is set (once: a resumed run has it from its checkpoint, the same number)."""
        p = self.params
        mechanism = privacy.Mechanism(p.sampling, 1.0, num_clients, cohort)
        if self.sigma is None:
            self.sigma = privacy.calibrate(p.budget(), mechanism, rounds, p.delta, p.accountant)
        self.mechanism = dataclasses.replace(mechanism, noise_multiplier=float(self.sigma))
        privacy.accounted(self.mechanism, rounds, p.delta, p.accountant)  # the ledger's last ask, before any write
        if p.adaptive:
            try:
                self._update_sigma()
            except ValueError as e:
                raise ConfigError(str(e)) from None

    @property
    def _mech(self) -> privacy.Mechanism:
        """The round's mechanism, once :meth:`_setup` made it (at ``check``)."""
        if self.mechanism is None:
            raise RuntimeError("CentralDP: the mechanism is made at check (flx.composition.check)")
        return self.mechanism

    @property
    def _sigma(self) -> float:
        """:math:`\\sigma`, given or calibrated by :meth:`_setup`."""
        if self.sigma is None:
            raise RuntimeError("CentralDP: sigma is calibrated at check (flx.composition.check)")
        return self.sigma

    def _count_noise(self) -> float:
        """:math:`\\sigma_b`: ``privacy.count_noise``, default :math:`\\max(\\bar m / 20, \\sigma)`. Andrew et al.
        (2021, Sec. 4) take :math:`\\bar m / 20` for cohorts of hundreds; Theorem 1 needs :math:`2\\sigma_b > \\sigma`,
        which a small cohort's :math:`\\bar m / 20` misses for any :math:`\\sigma` above it, so the default is at least
        :math:`\\sigma`, where the update's noise grows by :math:`(1 - 1/4)^{-1/2} \\approx 1.155` at most."""
        p = self.params
        return float(p.count_noise) if p.count_noise is not None else max(self._mech.cohort / 20, self._sigma)

    @override
    def on_attach(self, fed: FederationView) -> None:
        mech = self._mech
        if (mech.num_clients, mech.cohort) != (fed.num_clients, fed.cfg.clients_per_round):  # the ledger's q is real
            raise RuntimeError(
                f"CentralDP: accounted for {mech.cohort} of {mech.num_clients} clients, the federation samples "
                f"{fed.cfg.clients_per_round} of {fed.num_clients}"
            )
        # counts and halves are exact in float32 (below 2^24 clients): an fp32 model keeps an fp32 round buffer
        dtype = torch.promote_types(fed.params[0].dtype, torch.float32)
        fed.register_stat(_COUNT, torch.zeros(1, dtype=dtype))
        fed.register_stat(_BELOW, torch.zeros(1, dtype=dtype))

    # ------------------------------------------------------------------ the round
    @override
    def sample_clients(self, fed: FederationView, round_idx: int, rng: np.random.Generator) -> list[int]:
        n, m = fed.num_clients, self._mech.cohort
        if self.params.sampling == "poisson":
            return np.flatnonzero(rng.random(n) < m / n).tolist()
        return sorted(rng.choice(n, size=m, replace=False).tolist())

    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        client.weight = 1.0  # user-level DP: every client counts once (the mean below is unweighted)

    @override
    @torch.no_grad()
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        """Clips the upload in place; the factors stay on the device (no host read per client)."""
        delta = torch._foreach_sub(fed.local_state, fed.global_state)
        norms = torch.stack([d.double().norm() for d in delta])  # float64, on the model's device
        total = norms.square().sum().sqrt()
        if self.params.clip_mode == "flat":  # min(1, C / ||Delta||); a zero update: C / 0 = inf -> 1
            factors = clip_factors(total, self.clip).expand(len(delta))
        else:  # each tensor to C / sqrt(L)
            factors = clip_factors(norms, self.clip / math.sqrt(len(delta)))
        for t, g, d, f in zip(fed.local_state, fed.global_state, delta, factors):
            t.copy_(g + d * f.to(d.dtype))
        fed.stat(_COUNT)[0] += 1
        fed.stat(_BELOW)[0] += (total <= self.clip).double() - 0.5  # b_i - 1/2: sensitivity 1/2 (add or remove one)

    @override
    @torch.no_grad()
    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        """``mean`` is :math:`w^t + \\frac1K \\sum_i \\hat\\Delta_i` (weights 1); it becomes
        :math:`w^t + (\\sum_i \\hat\\Delta_i + \\text{noise}) / \\bar m`."""
        count, m_bar = float(fed.stat(_COUNT)[0]), float(self._mech.cohort)
        noise = self._noise(fed, rnd.round, [t.numel() for t in mean])
        std = self._update_sigma() * self.clip  # sigma_Delta C
        for t, g, z in zip(mean, fed.global_state, noise):
            total = (t.double() - g.double()) * count + z.reshape(t.shape) * std
            t.copy_(g.double() + total / m_bar)
        if self.params.adaptive:  # b~ = (sum_i (b_i - 1/2) + sigma_b z) / m + 1/2
            below = (float(fed.stat(_BELOW)[0]) + float(noise[-1][0]) * self._count_noise()) / m_bar + 0.5
            p = self.params
            self.clip *= math.exp(-p.clip_lr * (below - p.target_quantile))

    def _update_sigma(self) -> float:
        """:math:`\\sigma_\\Delta`: the update's noise multiplier (raised under adaptive clipping)."""
        if not self.params.adaptive:
            return self._sigma
        return privacy.update_noise(self._sigma, self._count_noise())

    def _noise(self, fed: FederationView, round_idx: int, sizes: list[int]) -> list[Tensor]:
        """Standard normal draws for every entry of the upload, then one for the clipped count: from a generator
        seeded by ``(seed, round)``, in float64 on the host, the same on every rank."""
        g = torch.Generator().manual_seed(derive_seed(fed.cfg.seed, round_idx, _NOISE_TAG))
        z = torch.randn(sum(sizes) + 1, generator=g, dtype=torch.float64)
        device = fed.params[0].device
        return [part.to(device) for part in z.split([*sizes, 1])]

    def spent(self, rounds: int | None = None) -> float:
        """:math:`\\varepsilon` at ``privacy.delta`` after ``rounds`` rounds (default: the rounds run so far)."""
        p = self.params
        return privacy.epsilon(self.mechanism, self.rounds if rounds is None else rounds, p.delta, p.accountant)

    # ------------------------------------------------------------------ budget, logging, checkpoint
    @override
    def after(self, fed: FederationView, rnd: Round) -> tuple[float, str]:
        return self.spent(self.rounds + 1), "would spend {eps}"

    @override
    def logged(self) -> dict[str, float]:
        return {"privacy/epsilon": self.spent(), "privacy/clip": self.clip}

    @override
    def state_dict(self) -> dict[str, Any]:
        ledger = {"rounds": self.rounds, "rounds_run": self.rounds_run, "epsilon": self.spent()}
        return {"clip": self.clip, "sigma": self.sigma, **ledger}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes the ledger: the rounds accounted, the noise multiplier and the clip (epsilon is recomputed from
        them, the same number; the stored one is for readers of the checkpoint)."""
        self.clip, self.sigma, self.rounds = (
            float(state_dict["clip"]),
            float(state_dict["sigma"]),
            int(state_dict["rounds"]),
        )
        self.rounds_run = int(state_dict.get("rounds_run", self.rounds))  # a checkpoint of before the key: as many
        if self.mechanism is not None:
            self.mechanism = dataclasses.replace(self.mechanism, noise_multiplier=self.sigma)

    # ------------------------------------------------------------------ divergence
    @override
    def divergence_cause(self, fed: FederationView, step: int) -> str | None:
        """The noise, when it dominates: its std on the global model per round, :math:`\\sigma_\\Delta C / \\bar m`
        per coordinate, L2 norm :math:`\\sigma_\\Delta C \\sqrt d / \\bar m` (:meth:`noise_norm`) against the norm of
        step ``step``'s mean clipped update (``fed.update_norm(step)``, at most :math:`C`); None when the noise is
        smaller (the optimizer is the cause). The levers: the target (or the noise multiplier), the clip, the cohort."""
        update, mech = fed.update_norm(step), self.mechanism
        if update is None or mech is None:
            return None
        d, sigma, p = numel(fed.local_state), self._update_sigma(), self.params
        noise = self.noise_norm(d)
        if not noise > update:
            return None
        budget = (
            f"raise privacy.target_epsilon (now {p.target_epsilon:g})"
            if p.noise_multiplier is None
            else f"lower privacy.noise_multiplier (now {p.noise_multiplier:g})"
        )
        clip = (  # adaptive clipping moves C towards a quantile of the update norms: that quantile is the lever
            f"lower privacy.target_quantile (now {p.target_quantile:g}), or privacy.adaptive=false with a small "
            f"privacy.clip (now {p.clip:g})"
            if p.adaptive
            else f"lower privacy.clip (now {p.clip:g})"
        )
        return (
            f"the DP noise dominates the update: noise of std {sigma * self.clip / mech.cohort:.3g} per coordinate on "
            f"the global model per round (sigma {sigma:.3g} x clip {self.clip:.3g} / m {mech.cohort:g}), norm "
            f"{noise:.3g} over d = {d}, against the round's mean clipped update of norm {update:.3g} (clip "
            f"{self.clip:.3g}); {budget}, {clip} or raise algo.clients_per_round (now {fed.cfg.clients_per_round:g})"
        )

    def noise_norm(self, d: int) -> float:
        """The expected L2 norm of a round's noise on a global model of ``d`` entries,
        :math:`\\sigma_\\Delta C \\sqrt d / \\bar m` (:math:`E\\lVert z \\rVert \\approx \\sqrt d` for
        :math:`z \\sim \\mathcal N(0, I_d)`, to :math:`1/(4d)` relative)."""
        return self._update_sigma() * self.clip * math.sqrt(d) / self._mech.cohort
