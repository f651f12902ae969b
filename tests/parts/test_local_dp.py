"""Record-level local DP (:class:`flx.parts.privacy.local_dp.LocalDP`, DP-SGD local steps): per-example gradients
against autograd row by row, one step computed by hand, the noise's mean and variance, Poisson batch sizes, stacked ==
sequential, the per-client ledger, the worst-case calibration, and what it refuses."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from helpers import build_of, linear, make_fed, run_rounds, toy_data
from torch import nn

from flx import privacy
from flx.autodiff import row_grads
from flx.composition import check_pairs
from flx.context import Round
from flx.datamodules.datamodule import ClientStore
from flx.errors import ConfigError
from flx.hooks import FederatedCallback
from flx.parts.personalisation.fbe import FBE
from flx.parts.personalisation.fedala import FedALA
from flx.parts.privacy.local_dp import _LOSS_TAG, _NOISE_TAG, LocalDP
from flx.parts.proximal.prox import Prox
from flx.parts.robustness.lambda_sampling import LambdaSampling
from flx.sampling import derive_seed, fresh_rows
from flx.traits import PartTraits


def _dp(**kw) -> LocalDP:
    return LocalDP(**{"noise_multiplier": 1.0, **kw})


def _drawn(round_idx: int, draws: dict[int, int]) -> Round:
    """A planned round whose draws are ``draws`` (client: times drawn), as ``refuse_round`` sees it."""
    rnd = Round(round_idx, 0, 1)
    rnd.draws, rnd.cohort = Counter(draws), tuple(sorted(draws))
    return rnd


def test_row_grads_are_each_rows_own_gradient() -> None:
    """``row_grads`` equals autograd on every row alone (float64, a two-layer net with a frozen layer)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    net[0].bias.requires_grad_(False)
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
    params = tuple(p.detach() for p in net.parameters() if p.requires_grad)
    grads, losses = row_grads(net, F.cross_entropy)(params, x, y)
    for j in range(7):
        loss = F.cross_entropy(net(x[j : j + 1]), y[j : j + 1])
        expected = torch.autograd.grad(loss, [p for p in net.parameters() if p.requires_grad])
        assert float(losses[j]) == pytest.approx(float(loss.detach()), rel=1e-12)
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g[j], e, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in net.parameters())  # the net is not touched


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_one_step_by_hand(mode: str) -> None:
    """One client, one step, fixed-size batches: ``w1 = w0 - lr (sum_j clip(g_j) + sigma C z) / B``, the rows drawn
    by the client's ``(seed, round, client)`` stream, ``z`` from its noise stream, each ``g_j`` by autograd; clipped
    as one vector (``flat``) or each of the L = 2 tensors to ``C / sqrt(2)`` (``per_layer``)."""
    sizes, b, clip, sigma, lr = [12], 5, 2.0, 0.8, 0.5
    net = linear(dtype=torch.float64)
    w0 = [p.detach().clone() for p in net.parameters()]
    data = toy_data(sizes, dtype=torch.float64)
    dp = _dp(clip=clip, clip_mode=mode, noise_multiplier=sigma, sampling="fixed", accountant="rdp")
    fed = make_fed(net, data, [dp], clients_per_round=1, lr=lr, local_steps=1, batch_size=b)
    run_rounds(fed, 1)
    rows = fresh_rows(data.client_indices[0], b, torch.Generator().manual_seed(derive_seed(0, 0, 0)))
    ref = linear(dtype=torch.float64)
    total = [torch.zeros_like(w) for w in w0]
    clipped, cases = 0, 0
    for j in rows.tolist():
        g = torch.autograd.grad(F.cross_entropy(ref(data.x[j : j + 1]), data.y[j : j + 1]), list(ref.parameters()))
        groups = [range(len(g))] if mode == "flat" else [[i] for i in range(len(g))]
        cap = clip if mode == "flat" else clip / math.sqrt(len(g))
        for group in groups:
            norm = math.sqrt(sum(float(g[i].square().sum()) for i in group))
            clipped, cases = clipped + (norm > cap), cases + 1
            for i in group:
                total[i] += g[i] * min(1.0, cap / norm)
    assert 0 < clipped < cases  # both cases of the clip occur
    gen = torch.Generator().manual_seed(derive_seed(0, 0, 0, 0, _NOISE_TAG))
    for p, w, s in zip(net.parameters(), w0, total):
        z = torch.randn(w.shape, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(p.detach(), w - lr * (s + sigma * clip * z) / b, rtol=0, atol=1e-12)
    assert dp.steps == {0: 1}


@pytest.mark.parametrize("vectorize", [False, True])
def test_noise_has_the_configured_mean_and_variance(vectorize: bool) -> None:
    """Inputs 0 and no bias: every row's gradient is 0, so each step is pure noise, ``-lr sigma C z / B`` per entry.
    B = 1 of 20 rows under Poisson sampling: a third of the steps draw no row at all (noise alone, as the others).
    Over 150 rounds x 2 clients x 2 steps x 15 entries, the mean and variance lie in their 99.9% intervals."""
    sigma, clip, lr, rounds = 1.5, 0.4, 0.2, 150
    x = torch.zeros(60, 5)
    data = ClientStore(x, torch.randint(0, 3, (60,)), [torch.arange(20 * i, 20 * i + 20) for i in range(3)])
    net = linear(bias=False)
    dp = _dp(clip=clip, noise_multiplier=sigma)
    fed = make_fed(net, data, [dp], clients_per_round=2, lr=lr, local_steps=2, batch_size=1, vectorize=vectorize)
    moves, joined = [], dict.fromkeys(range(3), 0)
    for r in range(rounds):
        before = net.weight.detach().double().clone()
        run_rounds(fed, 1, start=r)
        moves.append((net.weight.detach().double() - before).reshape(-1))
        for c in fed.rnd.cohort:
            joined[c] += 1
    # a client's 2 steps: variance 2 (lr sigma C)^2 per entry (B = 1); the mean of 2 clients halves it
    v = torch.cat(moves)
    std = lr * sigma * clip
    n = v.numel()
    assert abs(float(v.mean())) < 3.3 * std / math.sqrt(n)
    assert abs(float(v.square().mean()) / std**2 - 1) < 3.3 * math.sqrt(2 / n)
    assert dp.steps == {c: 2 * k for c, k in joined.items() if k}


class Rows(FederatedCallback):
    """Records each step's batch size (its step hook reads no rows' values: allowed with LocalDP)."""

    traits = PartTraits(uploads={}, steps="data_free", vectorizable=True)

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def on_local_grad(self, fed, client) -> None:
        self.sizes.append(len(client.rows))

    def on_cohort_grad(self, fed, cohort) -> None:
        self.sizes.extend(cohort.sizes)


def test_poisson_batches_are_binomial() -> None:
    """Each row joins a step with probability q = B / n: 400 steps of a 50-row client at B = 10 have batch sizes of
    mean qn and variance qn(1 - q) within their 99.9% intervals; ``fixed`` draws exactly B."""
    n, b, steps = 50, 10, 400
    rows = Rows()
    fed = make_fed(linear(), toy_data([n]), [_dp(), rows], clients_per_round=1, local_steps=steps, batch_size=b)
    run_rounds(fed, 1)
    s = torch.tensor(rows.sizes, dtype=torch.float64)
    q = b / n
    assert len(s) == steps
    assert abs(float(s.mean()) - q * n) < 3.3 * math.sqrt(q * (1 - q) * n / steps)
    assert abs(float(s.var()) / (q * (1 - q) * n) - 1) < 3.3 * math.sqrt(2 / steps) + 0.05
    fixed = Rows()
    dp = _dp(sampling="fixed", accountant="rdp")
    run_rounds(make_fed(linear(), toy_data([n]), [dp, fixed], clients_per_round=1, local_steps=20, batch_size=b), 1)
    assert fixed.sizes == [b] * 20


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_stacked_clients_give_the_sequential_model(mode: str) -> None:
    """``algo.vectorize=true``: every client's rows, clipping (either mode) and noise stream as sequentially, with
    FedProx's term after the noise; Poisson batches of unequal sizes (some empty: B = 2) pad the stack. float64:
    equal to 1e-10."""
    models, ledgers = [], []
    for vectorize in (False, True):
        net = linear(dtype=torch.float64)
        data = toy_data([20, 30, 25, 40], dtype=torch.float64)
        dp = _dp(clip=0.5, clip_mode=mode)
        parts = [Prox(mu=0.1), dp]
        fed = make_fed(net, data, parts, clients_per_round=3, lr=0.3, local_steps=5, batch_size=2, vectorize=vectorize)
        run_rounds(fed, 3)
        models.append([p.detach().clone() for p in net.parameters()])
        ledgers.append(dict(dp.steps))
    for a, b in zip(*models):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert ledgers[0] == ledgers[1]


def test_the_ledger_is_per_client_and_epsilon_is_the_worst() -> None:
    """Clients of 10, 40 and 80 rows, B = 8, K = 3: each client's epsilon is the library's for its own
    ``(q_i = min(1, B / n_i), steps_i)``; the run reports the largest; the budget's check of a round in which every
    client is drawn adds K steps to each."""
    sizes, b, k, sigma = [10, 40, 80], 8, 3, 1.2
    dp = _dp(noise_multiplier=sigma, accountant="rdp")
    fed = make_fed(linear(), toy_data(sizes), [dp], clients_per_round=2, local_steps=k, batch_size=b)
    run_rounds(fed, 4)
    assert sum(dp.steps.values()) == 4 * 2 * k and all(s % k == 0 for s in dp.steps.values())
    expected = {
        c: privacy.epsilon(privacy.Mechanism("poisson", sigma, sizes[c], min(b, sizes[c])), s, 1e-5, "rdp")
        for c, s in dp.steps.items()
    }
    assert {c: dp.client_epsilon(c) for c in dp.steps} == expected
    assert dp.spent() == max(expected.values())
    worst, how = dp.after(fed, _drawn(4, dict.fromkeys(range(3), 1)))
    ahead = {
        c: privacy.epsilon(privacy.Mechanism("poisson", sigma, n, min(b, n)), dp.steps.get(c, 0) + k, 1e-5, "rdp")
        for c, n in enumerate(sizes)
    }
    cid = max(ahead, key=lambda c: (ahead[c], c))
    assert worst == max(ahead.values()) and how == f"would spend {{eps}} for client {cid}"


@pytest.mark.parametrize("sampling, accountant", [("poisson", "pld"), ("poisson", "rdp"), ("fixed", "rdp")])
def test_the_worst_client_is_among_those_no_other_dominates(sampling: str, accountant: str) -> None:
    """The run's epsilon and the budget's look ahead ask the accountant only for clients that no other client
    dominates (a q_i and steps both at least theirs; with fixed batches the same (n_i, B)), and give the largest
    epsilon over every client's own, and the client it belongs to."""
    sizes, b, k = [5, 8, 8, 12, 20, 33, 33, 50, 80, 120], 8, 3
    dp = _dp(noise_multiplier=1.1, sampling=sampling, accountant=accountant)
    fed = make_fed(linear(), toy_data(sizes), [dp], clients_per_round=4, local_steps=k, batch_size=b)
    run_rounds(fed, 6)
    every = {c: dp.client_epsilon(c) for c in dp.steps}
    assert dp.spent() == max(every.values())
    ahead = {c: dp.client_epsilon(c, dp.steps.get(c, 0) + k) for c in range(len(sizes))}
    privacy.epsilon.cache_clear()
    worst, how = dp.after(fed, _drawn(6, dict.fromkeys(range(len(sizes)), 1)))
    cid = int(how.rsplit(" ", 1)[1])
    assert worst == max(ahead.values()) and ahead[cid] == worst
    assert privacy.epsilon.cache_info().misses < len(set(ahead.values()))  # fewer calls than distinct answers


def test_calibration_covers_the_worst_client() -> None:
    """target_epsilon 4 over 5 rounds of 4 steps: the calibrated sigma keeps every client (the smallest, q = 1, is the
    worst) within 4 if it joins every round, and 0.2% less noise would not."""
    sizes, b, k, rounds = [6, 30, 60], 8, 4, 5
    dp = LocalDP(target_epsilon=4.0, accountant="rdp")
    make_fed(linear(), toy_data(sizes), [dp], clients_per_round=2, local_steps=k, batch_size=b, rounds=rounds)
    eps = [dp.client_epsilon(c, k * rounds) for c in range(3)]
    assert max(eps) <= 4.0 and eps[0] == max(eps)
    less = privacy.Mechanism("poisson", dp.sigma * 0.998, 6, 6)
    assert privacy.epsilon(less, k * rounds, 1e-5, "rdp") > 4.0


@pytest.mark.parametrize("duplicates, runs", [("repeat", 3), ("multiplicity", 1)])
def test_the_budget_counts_each_run_of_a_repeated_draw(duplicates: str, runs: int) -> None:
    """A client drawn 3 times trains 3 times under ``algo.duplicates=repeat`` (3 K steps in its ledger), once under
    ``multiplicity``: the round's check counts what the round will book, exactly, and refuses the round (one line)
    when that passes the budget; a round within it runs and books the same steps."""
    sizes, b, k = [10, 40], 8, 2
    dp = _dp(accountant="rdp")
    cfg = {"clients_per_round": 4, "local_steps": k, "batch_size": b, "duplicates": duplicates}
    fed = make_fed(linear(), toy_data(sizes), [dp], **cfg)
    rnd = _drawn(0, {0: 3, 1: 1})
    expected = dp.client_epsilon(0, runs * k)
    assert dp.after(fed, rnd) == (expected, "would spend {eps} for client 0")
    dp.params = dataclasses.replace(dp.params, target_epsilon=expected * 0.999)
    line = dp.refuse_round(fed, rnd)
    assert line.startswith(f"privacy budget: round 1 would spend epsilon={expected:.4f} for client 0 > ")
    assert dp.refuse_round(fed, _drawn(0, {1: 1})) is None  # client 1 alone stays within it
    dp.on_round_start(fed, rnd)
    assert dp.steps == {0: runs * k, 1: k}


@pytest.mark.parametrize("runs", [1, 3])
def test_calibration_plans_runs_per_round(runs: int) -> None:
    """``privacy.runs_per_round`` runs a round: the calibrated sigma keeps a client that trains that many times in
    each of the ``T`` rounds within the target, and 0.2% less noise would not (the default plans one run a round)."""
    sizes, b, k, rounds = [6, 30], 8, 2, 3
    dp = LocalDP(target_epsilon=4.0, accountant="rdp", runs_per_round=runs)
    cfg = {"clients_per_round": 2, "local_steps": k, "batch_size": b, "rounds": rounds, "duplicates": "repeat"}
    make_fed(linear(), toy_data(sizes), [dp], **cfg)
    assert dp.client_epsilon(0, runs * k * rounds) <= 4.0
    less = privacy.Mechanism("poisson", dp.sigma * 0.998, 6, 6)
    assert privacy.epsilon(less, runs * k * rounds, 1e-5, "rdp") > 4.0


def test_composition_refuses_what_the_clipping_does_not_cover() -> None:
    """Step hooks that read the rows (pFedFBE's direction), uploads it cannot noise (DRFA-GA's full losses), a local
    loss term or a minibatch of another part are refused; FedProx's term (data free) is allowed; so are cohort
    samplers (no amplification by the cohort is claimed) and DRFA's losses (released through ``release_loss``)."""
    check_pairs([Prox(mu=0.1), _dp()])
    check_pairs([LambdaSampling(), _dp()])
    with pytest.raises(ConfigError, match="FBE hooks the local steps \\(on_local_grad\\)"):
        check_pairs([FBE(), _dp()])
    with pytest.raises(ConfigError, match="LambdaSampling sends its full local loss"):
        check_pairs([LambdaSampling(mode="ga"), _dp()])

    class Term(FederatedCallback):
        traits = PartTraits(steps="data_free")

        def local_loss(self, fed, client, loss):
            return loss

    with pytest.raises(ConfigError, match="Term hooks the local steps \\(local_loss\\)"):
        check_pairs([Term(), _dp()])

    class Sampler(FederatedCallback):
        def sample_clients(self, fed, round_idx, rng):
            return [0]

    check_pairs([Sampler(), _dp()])


def test_composition_refuses_a_start_learned_on_the_rows() -> None:
    """A part whose ``on_client_start`` reads the rows (``steps="rows"``) sets where the clipped steps start from the
    data, unclipped and unnoised (FedALA's W_i): refused; a data-free start (the models only) is allowed."""

    class Start(FederatedCallback):
        traits = PartTraits(uploads={}, steps="data_free")

        def on_client_start(self, fed, client):
            pass

    check_pairs([Start(), _dp()])
    Start.traits = PartTraits(uploads={})
    with pytest.raises(ConfigError, match="Start hooks the local steps \\(on_client_start\\)"):
        check_pairs([Start(), _dp()])
    with pytest.raises(ConfigError, match="FedALA hooks the local steps \\(on_client_start\\)"):
        check_pairs([FedALA(), _dp()])


def test_a_released_loss_by_hand() -> None:
    """DRFA's loss at a model, as local DP releases it: the client's Poisson rows from its ``(seed, round, client)``
    stream, each row's loss clipped to ``[0, L]``, ``N(0, sigma^2 L^2)`` on the sum, divided by ``min(B, n)``; one
    event in the client's ledger. L = 1 clips some rows' losses and not others."""
    sizes, b, sigma, cap = [40, 25], 10, 0.7, 1.0
    net, data = linear(dtype=torch.float64), toy_data(sizes, dtype=torch.float64)
    dp = _dp(noise_multiplier=sigma, loss_clip=cap)
    fed = make_fed(net, data, [dp], clients_per_round=1, batch_size=b)
    state = {name: p.detach() + 0.3 for name, p in net.named_parameters()}
    released = dp.release_loss(fed, 1, state, 4)
    gen = torch.Generator().manual_seed(derive_seed(0, 4, 1, _LOSS_TAG))
    rows = data.client_indices[1][torch.rand(25, generator=gen) < b / 25]
    ref = linear(dtype=torch.float64)
    with torch.no_grad():
        for p in ref.parameters():
            p += 0.3
        losses = F.cross_entropy(ref(data.x[rows]), data.y[rows], reduction="none")
    assert (losses > cap).any() and (losses < cap).any()
    z = float(torch.randn((), generator=gen, dtype=torch.float64))
    assert released == pytest.approx((float(losses.clamp(0, cap).sum()) + z * sigma * cap) / b, rel=1e-12)
    assert dp.steps == {1: 1}


def test_drfa_rounds_book_steps_and_releases() -> None:
    """With DRFA's lambda sampling, a round books K steps for each client that trained and one event for each client
    whose loss was released; the calibration plans K + 1 events per round."""
    sizes, k = [30, 30, 30, 30], 3
    dp = _dp(noise_multiplier=1.0, accountant="rdp")
    lam = LambdaSampling(gamma=0.1)
    fed = make_fed(linear(), toy_data(sizes), [lam, dp], clients_per_round=2, local_steps=k, batch_size=8)
    run_rounds(fed, 1)
    assert dp.releases == 1 and dp._per_round(0) == k + 1
    total = sum(dp.steps.values())
    assert total == k * len(fed.rnd.cohort) + 2  # the cohort's steps, then U's two releases
    assert lam.lam is not None and not torch.allclose(lam.lam, torch.full((4,), 0.25, dtype=lam.lam.dtype))


def test_a_batchnorm_net_is_refused() -> None:
    net = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    with pytest.raises(ConfigError, match="privacy=local: the net has BatchNorm1d layers"):
        _dp().check(build_of([], net=net))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"clip": -1.0}, "privacy.clip=-1.0"),
        ({"clip_mode": "tensor"}, "privacy.clip_mode='tensor': allowed: flat, per_layer"),
        ({"noise_multiplier": None}, "privacy.noise_multiplier=None: set it"),
        ({"sampling": "fixed"}, "privacy.accountant=pld: fixed-size sampling"),
        ({"delta": 0.0}, "privacy.delta=0.0"),
        ({"runs_per_round": 0}, "privacy.runs_per_round=0: an integer from 1 to 10000"),
        ({"runs_per_round": "2"}, "privacy.runs_per_round='2': must be an integer"),
    ],
)
def test_bad_settings_are_one_line(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        _dp(**kw)


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_clipped_sums_by_hand(mode: str) -> None:
    """The clipped sum row by row by hand, ``flat`` (each row's gradient as one vector, to C) or ``per_layer`` (each
    of its L = 5 trainable tensors to C / sqrt(L)): ``clipped_sum`` on per-row gradients, ``LinearRows`` (the layers'
    activations and output gradients, no per-row gradients; the losses too) and ``clipped_sum`` on two stacked
    clients with padding rows masked out all give it (float64; an MLP with a frozen bias; C between the norms)."""
    from flx.clipping import LinearRows, clipped_sum
    from flx.tasks import Classification

    torch.manual_seed(1)
    net = nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    net[3].bias.requires_grad_(False)
    x, y = torch.randn(9, 2, 3, dtype=torch.float64), torch.randint(0, 3, (9,))
    params = tuple(p.detach() for p in net.parameters() if p.requires_grad)
    grads, losses = row_grads(net, F.cross_entropy)(params, x, y)
    n_tensors = len(params)
    groups = [list(range(n_tensors))] if mode == "flat" else [[i] for i in range(n_tensors)]
    norms = torch.tensor(
        [[float(sum(grads[i][j].square().sum() for i in grp)) ** 0.5 for grp in groups] for j in range(9)],
        dtype=torch.float64,
    )
    cap = float(norms.median())  # flat: C itself; per_layer: C / sqrt(L)
    clip = cap if mode == "flat" else cap * math.sqrt(n_tensors)
    expected = [torch.zeros_like(p) for p in params]
    for j in range(9):
        for k, grp in enumerate(groups):
            for i in grp:
                expected[i] += grads[i][j] * min(1.0, cap / float(norms[j, k]))
    assert 0 < int((norms > cap).sum()) < norms.numel()  # both cases of the clip occur
    per_layer = mode == "per_layer"
    summed, rows = LinearRows(net, Classification().loss_rows).clipped_sum(params, x, y, clip, per_layer)
    torch.testing.assert_close(rows, losses, rtol=1e-12, atol=0)
    stacked = [torch.stack([g, torch.cat([g[3:], torch.randn_like(g[:3])])]) for g in grads]  # client 2: rows 3-8
    mask = torch.ones(2, 9, dtype=torch.float64)
    mask[1, 6:] = 0
    two = clipped_sum(stacked, clip, 2, mask, per_layer)
    tail = [torch.zeros_like(p) for p in params]
    for j in range(3, 9):
        for k, grp in enumerate(groups):
            for i in grp:
                tail[i] += grads[i][j] * min(1.0, cap / float(norms[j, k]))
    for got in (clipped_sum(list(grads), clip, 1, per_layer=per_layer), summed, [t[0] for t in two]):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for a, b in zip([t[1] for t in two], tail):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_divergence_cause_weighs_the_noise_against_the_measured_update() -> None:
    """Zero inputs, no bias: every row's gradient is 0, so the round's mean update is pure noise. Two clients of 20
    rows (weights 1/2 each), K = 2 steps, B = 1, d = 15: the noise's norm in the mean update is
    ``E = lr sigma C sqrt(d sum_i p_i^2 K_i / B_i^2) = lr sigma C sqrt(15)``, and ``E[U^2] = E^2`` for the measured
    ``U = fed.update_norm(r)`` (a chi-square with 15 degrees of freedom per round: over 150 rounds the mean of
    ``U^2 / E^2`` lies within 1 +- 3.3 sqrt(2 / 2250)). A pure-noise update is dominated (``2 E^2 > U^2`` unless
    ``U`` is an outlier), and the line gives the per-step std ``sigma C / B`` and the levers."""
    sigma, clip, lr, rounds = 1.5, 0.4, 0.2, 150
    data = ClientStore(
        torch.zeros(60, 5), torch.randint(0, 3, (60,)), [torch.arange(20 * i, 20 * i + 20) for i in range(3)]
    )
    dp = _dp(clip=clip, noise_multiplier=sigma)
    fed = make_fed(linear(bias=False), data, [dp], clients_per_round=2, lr=lr, local_steps=2, batch_size=1)
    expected = lr * sigma * clip * math.sqrt(15)
    squares = []
    for r in range(rounds):
        run_rounds(fed, 1, start=r)
        squares.append(fed.update_norm(r + 1) ** 2)
    assert dp.noise_norm(15, lr, {0: 2, 1: 2}, {0: 20.0, 1: 20.0}) == pytest.approx(expected, rel=1e-12)
    assert abs(sum(squares) / rounds / expected**2 - 1) < 3.3 * math.sqrt(2 / (15 * rounds))
    update = fed.update_norm(rounds)
    assert 2 * expected**2 > update**2
    assert dp.divergence_cause(fed, rounds) == (
        f"the DP noise dominates the update: each client's gradient gets noise of std {sigma * clip:.3g} per "
        f"coordinate per step (sigma 1.5 x clip 0.4 / B 1), norm {sigma * clip * math.sqrt(15):.3g} over d = 15, "
        f"~{expected:.3g} in the round's mean update of norm {update:.3g}; lower privacy.noise_multiplier (now 1.5), "
        "lower privacy.clip (now 0.4) or raise algo.batch_size (now 1)"
    )
    assert dp.divergence_cause(fed, rounds + 5) is None  # a step this process did not measure: no claim
