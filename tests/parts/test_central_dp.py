"""User-level central DP (:class:`flx.parts.privacy.central_dp.CentralDP`): a round computed by hand, the noise's mean
and variance over many rounds, clipping (flat and per layer), Poisson cohorts, adaptive clipping's step, the budget."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import linear, make_fed, run_rounds, toy_data
from torch import Tensor

from flx import privacy
from flx.composition import check_pairs
from flx.errors import ConfigError
from flx.hooks import FederatedCallback
from flx.parts.privacy.central_dp import _NOISE_TAG, CentralDP
from flx.parts.proximal.prox import Prox
from flx.parts.robustness.lambda_sampling import LambdaSampling
from flx.sampling import derive_seed
from flx.traits import PartTraits


class Uploads(FederatedCallback):
    """Records each client's model before the DP part clips it (it runs first)."""

    traits = PartTraits(uploads={})

    def __init__(self) -> None:
        self.models: dict[int, list[Tensor]] = {}

    def on_client_end(self, fed, client) -> None:
        self.models[client.cid] = [t.detach().clone() for t in fed.local_state]


def _dp(**kw) -> CentralDP:
    return CentralDP(**{"noise_multiplier": 1.0, "sampling": "fixed", "accountant": "rdp", **kw})


def test_one_round_by_hand() -> None:
    """``w^1 = w^0 + (sum_i clip(w_i - w^0) + sigma C z) / m`` with ``z`` the ``(seed, round)`` stream's normals."""
    sizes, m, clip, sigma = [20, 30, 25, 40, 35, 30], 3, 0.05, 0.7
    net = linear()
    w0 = [p.detach().clone() for p in net.parameters()]
    seen, dp = Uploads(), _dp(clip=clip, noise_multiplier=sigma)
    fed = make_fed(net, toy_data(sizes), [seen, dp], clients_per_round=m, rounds=1, lr=0.5, local_steps=5)
    run_rounds(fed, 1)
    assert sorted(seen.models) == list(fed.rnd.cohort) and len(seen.models) == m
    total = [torch.zeros_like(w, dtype=torch.float64) for w in w0]
    for model in seen.models.values():
        delta = [(t - w).double() for t, w in zip(model, w0)]
        norm = math.sqrt(sum(float(d.square().sum()) for d in delta))
        assert norm > clip  # the case clipping matters in
        for acc, d in zip(total, delta):
            acc += d * (clip / norm)
    g = torch.Generator().manual_seed(derive_seed(0, 0, _NOISE_TAG))
    z = torch.randn(sum(w.numel() for w in w0) + 1, generator=g, dtype=torch.float64)
    zs = z[:-1].split([w.numel() for w in w0])
    for p, w, s, zi in zip(net.parameters(), w0, total, zs):
        expected = w.double() + (s + sigma * clip * zi.reshape(w.shape)) / m
        torch.testing.assert_close(p.detach().double(), expected, rtol=0, atol=1e-6)
    assert dp.rounds == 1 and dp.spent() == pytest.approx(
        privacy.epsilon(privacy.Mechanism("fixed", sigma, 6, m), 1, 1e-5, "rdp")
    )


def test_noise_on_the_aggregate_has_the_configured_mean_and_variance() -> None:
    """Clients that do not move (lr 0): each round's global step is pure noise, ``N(0, (sigma C / m)^2)`` per entry.
    Over 300 rounds x 18 entries the sample mean and variance must lie in their 99.9% intervals."""
    sigma, clip, m, rounds = 2.0, 0.3, 4, 300
    net = linear()
    fed = make_fed(net, toy_data([10] * 8), [_dp(clip=clip, noise_multiplier=sigma)], clients_per_round=m, lr=0.0)
    steps = []
    for r in range(rounds):
        before = torch.cat([p.detach().reshape(-1).double() for p in net.parameters()])
        run_rounds(fed, 1, start=r)
        steps.append(torch.cat([p.detach().reshape(-1).double() for p in net.parameters()]) - before)
    x = torch.cat(steps)
    n, std = x.numel(), sigma * clip / m
    assert abs(float(x.mean())) < 3.3 * std / math.sqrt(n)
    # chi-square with n degrees of freedom: var / std^2 within 1 +- 3.3 sqrt(2 / n)
    ratio = float(x.square().mean()) / std**2
    assert abs(ratio - 1) < 3.3 * math.sqrt(2 / n)


class FakeFed:
    """What on_client_end reads: the upload, its round-start snapshot, the two statistics."""

    def __init__(self, local: list[Tensor], start: list[Tensor]) -> None:
        self.local_state, self.global_state = local, start
        self.stats = {"privacy/count": torch.zeros(1, dtype=torch.float64), "privacy/below": torch.zeros(1)}

    def stat(self, name: str) -> Tensor:
        return self.stats[name]


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_clipping_closed_form(mode: str) -> None:
    start = [torch.zeros(3), torch.zeros(4)]
    dp = _dp(clip=1.0, clip_mode=mode)
    big = FakeFed([torch.tensor([3.0, 0.0, 4.0]), torch.tensor([0.0, 0.0, 0.0, 0.5])], start)  # norms 5, 0.5
    dp.on_client_end(big, None)
    if mode == "flat":  # the whole update, norm sqrt(25.25), scaled to norm 1
        f = 1 / math.sqrt(25.25)
        torch.testing.assert_close(big.local_state[0], torch.tensor([3.0, 0.0, 4.0]) * f)
        torch.testing.assert_close(big.local_state[1], torch.tensor([0.0, 0.0, 0.0, 0.5]) * f)
    else:  # each tensor to 1 / sqrt(2): the first is clipped, the second (0.5 < 0.707) kept
        torch.testing.assert_close(big.local_state[0], torch.tensor([3.0, 0.0, 4.0]) / 5 / math.sqrt(2))
        torch.testing.assert_close(big.local_state[1], torch.tensor([0.0, 0.0, 0.0, 0.5]))
    small = FakeFed([torch.tensor([0.3, 0.0, 0.4]), torch.zeros(4)], start)  # norm 0.5: untouched either way
    dp.on_client_end(small, None)
    torch.testing.assert_close(small.local_state[0], torch.tensor([0.3, 0.0, 0.4]))
    assert float(big.stats["privacy/count"]) == 1 and float(big.stats["privacy/below"]) == -0.5  # b_i - 1/2
    assert float(small.stats["privacy/below"]) == 0.5


def test_poisson_cohorts_are_binomial() -> None:
    """Each client joins with probability q = m / N, independently: over 400 rounds the cohort size averages m
    and every client's share of rounds is q, within 99.9% intervals."""
    import numpy as np

    n, m, rounds = 50, 5, 400
    dp = CentralDP(noise_multiplier=1.0)
    fed = make_fed(linear(), toy_data([4] * n), [dp], clients_per_round=m, lr=0.0, local_steps=1)
    counts = np.zeros(n)
    sizes = []
    for r in range(rounds):
        cohort = fed.sample(r)
        assert len(set(cohort)) == len(cohort)
        sizes.append(len(cohort))
        counts[cohort] += 1
    q = m / n
    assert abs(np.mean(sizes) - m) < 3.3 * math.sqrt(n * q * (1 - q) / rounds)
    assert np.all(np.abs(counts / rounds - q) < 4.5 * math.sqrt(q * (1 - q) / rounds))  # 50 clients: a wider band


def test_adaptive_clip_follows_the_noised_count() -> None:
    """``C <- C exp(-eta (b~ - gamma))`` with ``b~ = (sum_i (b_i - 1/2) + sigma_b z) / m + 1/2`` (clients report
    ``b_i - 1/2``: sensitivity 1/2, what the noise split assumes), ``z`` the stream's last normal."""
    dp = _dp(clip=10.0, adaptive=True, target_quantile=0.5, clip_lr=0.2, count_noise=3.0, noise_multiplier=1.0)
    fed = make_fed(linear(), toy_data([20] * 6), [dp], clients_per_round=3, lr=0.1, local_steps=2)
    run_rounds(fed, 1)  # every update is far below C = 10: b_i = 1 for all 3
    g = torch.Generator().manual_seed(derive_seed(0, 0, _NOISE_TAG))
    z = torch.randn(sum(p.numel() for p in fed.params) + 1, generator=g, dtype=torch.float64)[-1]
    b = (3 * (1 - 0.5) + 3.0 * float(z)) / 3 + 0.5
    assert dp.clip == pytest.approx(10.0 * math.exp(-0.2 * (b - 0.5)), rel=1e-12)
    assert dp._update_sigma() ** -2 + (2 * 3.0) ** -2 == pytest.approx(1.0, rel=1e-12)


def test_composition_refuses_channels_it_does_not_cover() -> None:
    check_pairs([Prox(mu=0.1), CentralDP(noise_multiplier=1.0)])  # FedProx uploads only its model
    with pytest.raises(ConfigError, match="LambdaSampling sends its losses at the snapshot model"):
        check_pairs([LambdaSampling(), CentralDP(noise_multiplier=1.0)])
    check_pairs([LambdaSampling()])  # without privacy, nothing to check

    class ServerSide(FederatedCallback):
        def on_server_step(self, fed, rnd, mean) -> None: ...

    with pytest.raises(ConfigError, match="ServerSide changes the aggregate on the server"):
        check_pairs([ServerSide(), CentralDP(noise_multiplier=1.0)])


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"clip": 0}, "privacy.clip=0"),
        ({}, "privacy.noise_multiplier=None: set it"),
        ({"noise_multiplier": 1.0, "sampling": "fixed"}, "privacy.accountant=pld: fixed-size sampling"),
        ({"noise_multiplier": 1.0, "clip_mode": "tensor"}, "privacy.clip_mode='tensor'"),
        ({"noise_multiplier": 1.0, "delta": 1.5}, "privacy.delta=1.5"),
    ],
)
def test_bad_settings_are_one_line(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        CentralDP(**kw)


def test_stacked_clients_give_the_sequential_round() -> None:
    """``algo.vectorize=true``: the clipping runs in each client's end with its model in the net, as sequentially."""
    models = []
    for vectorize in (False, True):
        net = linear()
        fed = make_fed(net, toy_data([20, 30, 25, 40]), [_dp(clip=0.05)], clients_per_round=3, vectorize=vectorize)
        run_rounds(fed, 2)
        models.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*models):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_an_empty_poisson_cohort_keeps_the_model_and_is_accounted() -> None:
    """q = 1/50: about a third of the rounds draw nobody. Such a round releases nothing that depends on the data: the
    model stays as it was (no noise either), and the round still counts in the ledger."""
    dp = CentralDP(noise_multiplier=1.0)
    net = linear()
    fed = make_fed(net, toy_data([4] * 50), [dp], clients_per_round=1, lr=0.1, local_steps=1)
    empty = moved = 0
    for r in range(12):
        before = [p.detach().clone() for p in net.parameters()]
        run_rounds(fed, 1, start=r)
        same = all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
        if not fed.rnd.cohort:
            empty += 1
            assert same
        else:
            moved += 1
            assert not same
        assert dp.rounds == r + 1
    assert empty and moved  # both kinds of round happened (seeded: the same every run)


def test_noise_norm_is_the_norm_of_a_direct_draw() -> None:
    """``sigma C sqrt(d) / m``: 200 draws of the round's noise, ``sigma C z / m`` with ``z ~ N(0, I_d)``, d = 10^4,
    have a mean norm within 0.1% of it (``E||z|| = sqrt(d) (1 - 1/(4d) + ...)``, spread ``1/sqrt(2)`` per draw)."""
    sigma, clip, m, d = 3.0, 0.2, 4, 10_000
    fed = make_fed(linear(), toy_data([10] * 8), [dp := _dp(clip=clip, noise_multiplier=sigma)], clients_per_round=m)
    assert fed.num_clients == 8 and dp.noise_norm(d) == pytest.approx(sigma * clip * math.sqrt(d) / m, rel=1e-12)
    g = torch.Generator().manual_seed(0)
    draws = torch.randn(200, d, generator=g, dtype=torch.float64) * sigma * clip / m
    assert float(draws.norm(dim=1).mean()) == pytest.approx(dp.noise_norm(d), rel=1e-3)


@pytest.mark.parametrize("sigma", [0.1, 30.0])
def test_divergence_cause_claims_the_noise_only_when_it_outweighs_the_update(sigma: float) -> None:
    """test_one_round_by_hand's round: ``fed.update_norm(1)`` is ``||sum_i clip(Delta_i)|| / m`` by hand (weights 1,
    every client clipped: about C); d = 18. sigma 30: the noise's norm ``30 x 0.05 x sqrt(18) / 3`` = 2.12 outweighs
    it, and the line names the levers; sigma 0.1 (the floor): 7e-3 does not, no claim (the optimizer's cause stands)."""
    sizes, m, clip = [20, 30, 25, 40, 35, 30], 3, 0.05
    net = linear()
    w0 = [p.detach().clone() for p in net.parameters()]
    seen, dp = Uploads(), _dp(clip=clip, noise_multiplier=sigma)
    fed = make_fed(net, toy_data(sizes), [seen, dp], clients_per_round=m, rounds=1, lr=0.5, local_steps=5)
    run_rounds(fed, 1)
    total = [torch.zeros_like(w, dtype=torch.float64) for w in w0]
    for model in seen.models.values():
        delta = [(t - w).double() for t, w in zip(model, w0)]
        norm = math.sqrt(sum(float(d.square().sum()) for d in delta))
        for acc, d in zip(total, delta):
            acc += d * min(1.0, clip / norm)
    update = math.sqrt(sum(float(t.square().sum()) for t in total)) / m
    assert fed.update_norm(1) == pytest.approx(update, rel=1e-5)
    noise = sigma * clip * math.sqrt(18) / m
    if sigma < 1:
        assert noise < update and dp.divergence_cause(fed, 1) is None
        return
    assert dp.divergence_cause(fed, 1) == (
        f"the DP noise dominates the update: noise of std {sigma * clip / m:.3g} per coordinate on the global model "
        f"per round (sigma 30 x clip 0.05 / m 3), norm {noise:.3g} over d = 18, against the round's mean clipped "
        f"update of norm {fed.update_norm(1):.3g} (clip 0.05); lower privacy.noise_multiplier (now 30), lower "
        "privacy.clip (now 0.05) or raise algo.clients_per_round (now 3)"
    )


def test_under_adaptive_clipping_the_quantile_is_the_clip_lever() -> None:
    """Adaptive clipping moves C to a quantile of the update norms, so lowering ``privacy.clip`` (the initial C) would
    change nothing: a noise-dominated adaptive run names ``privacy.target_quantile`` (or a small fixed clip)."""
    dp = _dp(clip=0.05, adaptive=True, target_quantile=0.5, count_noise=20.0, noise_multiplier=30.0)
    fed = make_fed(linear(), toy_data([20, 30, 25, 40]), [dp], clients_per_round=2, rounds=1, lr=0.5, local_steps=5)
    run_rounds(fed, 1)
    line = dp.divergence_cause(fed, 1)
    assert line.startswith("the DP noise dominates the update: ")
    assert line.endswith(
        "lower privacy.target_quantile (now 0.5), or privacy.adaptive=false with a small privacy.clip (now 0.05) or "
        "raise algo.clients_per_round (now 2)"
    )
