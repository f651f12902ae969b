r"""pFedFBE against closed forms on linear least squares (``least_squares``: gradient, Hessian, L1 prox explicit).

:math:`\theta = \mathrm{prox}_{h/\lambda}(w - g/\lambda)`, :math:`u = w - \theta`, :math:`G = \lambda u - H u`
(Alg. 1 lines 8-12) and one step is :math:`w - \eta G` (line 13).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, raises_one_line, run_rounds
from least_squares import f64, flat, grad, hess, l1, loss, mse, prox, regression
from torch import Tensor

from flx.federation import Federation
from flx.hooks import FederatedCallback
from flx.parts.personalisation.fbe import _HAT_TAG, _PERSONAL_TAG, FBE, fbe_gradient, fbe_objective, fbe_value
from flx.parts.proximal.prox import Prox
from flx.parts.robustness.lambda_sampling import LambdaSampling
from flx.sampling import SAMPLE_TAG, derive_seed, local_batches


def _fed(data, parts, **kw) -> Federation:
    kw = {"clients_per_round": 1, "local_steps": 1, "batch_size": 64, "lr": 0.1, "weighting": "uniform"} | kw
    return make_fed(linear(data.x.shape[1], 1, dtype=f64), data, parts, loss_fn=mse, **kw)


# ---------------------------------------------------------------------- the local step
@pytest.mark.parametrize("mode", ["exact", "fd", "none"])
def test_each_hessian_mode_matches_the_closed_form_hessian(mode: str) -> None:
    """h = 0, one full-batch step: u = g / lam and w1 = w0 - eta (lam u - H u) with H = 2 X~^T X~ / n for exact and
    fd (a central difference is exact on a quadratic up to rounding), w1 = w0 - eta lam u for none."""
    lam, eta = 4.0, 0.1
    data = regression([9])
    fed = _fed(data, [FBE(lam=lam, hessian=mode, hessian_batch="same")], lr=eta)
    w0 = flat(fed.params)
    run_rounds(fed, 1)
    u = grad(data.x, data.y, w0) / lam
    hu = hess(data.x) @ u if mode != "none" else torch.zeros_like(u)
    torch.testing.assert_close(flat(fed.params), w0 - eta * (lam * u - hu), rtol=0, atol=1e-12)
    assert float((hess(data.x) @ u).abs().max()) > 1e-2  # the modes differ by a visible amount


@pytest.mark.parametrize("minibatch", ["epochs", "fresh"])
@pytest.mark.parametrize("hessian_batch", ["same", "independent"])
def test_local_steps_on_minibatches_match_the_hand_update(hessian_batch: str, minibatch: str) -> None:
    """Three minibatch steps (B = 4 of n = 9 rows; L1 on the weight): D is the core's default stream (seeded by
    (seed, round, client)): reshuffled passes (epochs) or 4 rows of a fresh randperm every step (fresh); D_hat = D
    (same) or 4 rows drawn without replacement from the part's own (seed, round, client, copy, tag) stream at every
    step (independent; Algorithm 1 samples D and D_hat at every step), so D is FedAvg's in both modes."""
    lam, eta, mu, seed = 3.0, 0.05, 0.2, 4
    data = regression([9])
    fbe = FBE(lam=lam, hessian_batch=hessian_batch, regularizer=l1(mu))
    fed = _fed(data, [fbe], lr=eta, local_steps=3, batch_size=4, seed=seed, minibatch=minibatch)
    w = flat(fed.params)
    run_rounds(fed, 1)
    idx = data.client_indices[0]
    hat = torch.Generator().manual_seed(derive_seed(seed, 0, 0, 0, _HAT_TAG))
    gen = torch.Generator().manual_seed(derive_seed(seed, 0, 0))
    fresh = [idx[torch.randperm(9, generator=gen)[:4]] for _ in range(3)] if minibatch == "fresh" else None
    for rows in fresh or local_batches(idx, 4, 3, gen):
        rows_hat = rows if hessian_batch == "same" else idx[torch.randperm(9, generator=hat)[:4]]
        g = grad(data.x[rows], data.y[rows], w)
        u = w - prox(w - g / lam, mu / lam)
        w = w - eta * (lam * u - hess(data.x[rows_hat]) @ u)
    torch.testing.assert_close(flat(fed.params), w, rtol=0, atol=1e-12)


def test_first_order_with_eta_lam_one_is_local_proximal_sgd() -> None:
    """Every experiment of the paper has eta lam = 1 (Sec. 4): with hessian=none and eta lam = 1, w - eta lam (w -
    prox_{h/lam}(w - g/lam)) = prox_{eta h}(w - eta g): FedMiD's local step (to rounding: w - (w - theta) is theta only
    in exact arithmetic)."""
    lam, eta, mu, seed = 4.0, 0.25, 0.3, 1
    data = regression([10])
    fed = _fed(data, [FBE(lam=lam, hessian="none", regularizer=l1(mu))], lr=eta, local_steps=4, batch_size=3, seed=seed)
    w = flat(fed.params)
    run_rounds(fed, 1)
    for rows in local_batches(data.client_indices[0], 3, 4, torch.Generator().manual_seed(derive_seed(seed, 0, 0))):
        w = prox(w - eta * grad(data.x[rows], data.y[rows], w), eta * mu)
    torch.testing.assert_close(flat(fed.params), w, rtol=0, atol=1e-14)


# ---------------------------------------------------------------------- the envelope
@pytest.mark.parametrize("regularised", [False, True])
def test_fbe_value_and_gradient_match_autograd_of_the_envelope(regularised: bool) -> None:
    """F(w) = f - ||grad f||^2 / (2 lam) + h(p) + lam/2 ||p - v||^2, v = w - grad f / lam, p = prox_{h/lam}(v)
    (Eq. 5), written with torch ops (the soft threshold is differentiable away from its kinks) and differentiated by
    autograd, equals fbe_value; its gradient equals lam u - H u (Eq. 6) from fbe_gradient (exact) and, to the
    finite-difference error, fd. The threshold mu / lam lies between two |v_j|, far from both."""
    lam = 3.0
    data = regression([12], dim=4)
    rows, x, y = data.client_indices[0], data.x, data.y
    net = linear(4, 1, dtype=f64)
    w = [p.detach().clone().requires_grad_() for p in net.parameters()]
    f = F.mse_loss(x @ w[0].T + w[1], y)
    g = torch.autograd.grad(f, w, create_graph=True)
    v = [a - b / lam for a, b in zip(w, g)]
    t = float(v[0].detach().abs().flatten().sort().values[1:3].mean()) if regularised else 0.0
    assert not regularised or float((v[0].detach().abs() - t).abs().min()) > 1e-3  # away from the kinks
    p = [torch.sign(v[0]) * (v[0].abs() - t).clamp_min(0), v[1]] if regularised else v
    h = t * lam * p[0].abs().sum()  # mu ||weight||_1 with mu = t lam
    envelope = (
        f - sum((b**2).sum() for b in g) / (2 * lam) + h + lam / 2 * sum(((a - b) ** 2).sum() for a, b in zip(p, v))
    )
    expected = torch.autograd.grad(envelope, w)
    fed = make_fed(net, data, [FBE(lam=lam, regularizer=l1(t * lam) if regularised else None)], loss_fn=mse)
    reg = fed.parts[0].reg
    torch.testing.assert_close(fbe_value(fed, rows, lam, reg), envelope.detach(), rtol=0, atol=1e-12)
    for got, want in zip(fbe_gradient(fed, rows, lam, reg, mode="exact"), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for got, want in zip(fbe_gradient(fed, rows, lam, reg, mode="fd"), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-8)


# ---------------------------------------------------------------------- the personalised model
def test_personalised_model_is_one_proximal_gradient_step_from_the_global_model() -> None:
    """theta_i(w) = prox_{h/lam}(w - grad f_i(w) / lam) with the gradient on all of client i's training rows (line
    16); the federation restores w after each block."""
    lam, mu = 2.5, 0.4
    data = regression([5, 8, 6])
    fed = _fed(data, [FBE(lam=lam, regularizer=l1(mu))], clients_per_round=3, local_steps=2, batch_size=3)
    run_rounds(fed, 1)
    w = flat(fed.params)
    for cid, rows in enumerate(data.client_indices):
        with fed.personalize(cid):
            got = flat(fed.params)
        expected = prox(w - grad(data.x[rows], data.y[rows], w) / lam, mu / lam)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        assert torch.equal(flat(fed.params), w)


def test_personal_batch_is_a_fixed_seeded_subset_of_the_clients_rows() -> None:
    lam, seed = 2.0, 5
    data = regression([9, 7])
    fed = _fed(data, [FBE(lam=lam, personal_batch=4)], clients_per_round=2, seed=seed)
    w = flat(fed.params)
    for cid, idx in enumerate(data.client_indices):
        gen = torch.Generator().manual_seed(derive_seed(seed, cid, _PERSONAL_TAG))
        rows = idx[torch.randperm(len(idx), generator=gen)[:4]]
        seen = []
        for _ in range(2):  # the same subset every time: theta_i is a function of w
            with fed.personalize(cid):
                seen.append(flat(fed.params))
        torch.testing.assert_close(seen[0], w - grad(data.x[rows], data.y[rows], w) / lam, rtol=0, atol=1e-12)
        assert torch.equal(seen[0], seen[1])


# ---------------------------------------------------------------------- ranks
def _two_ranks(data, parts_of, rounds: int, **kw) -> tuple[list[Federation], list[int]]:
    """Ranks 0 and 1 run one after the other; the (simulated) all-reduce sums their round buffers and is counted."""
    buffers: dict[int, Tensor] = {}
    calls: list[int] = []

    def reduce_sum(t: Tensor) -> Tensor:
        calls.append(1)
        return buffers[0] + buffers[1]

    feds = [
        make_fed(
            linear(3, 1, dtype=f64), data, parts_of(), loss_fn=mse, rank=r, world_size=2, reduce_sum=reduce_sum, **kw
        )
        for r in (0, 1)
    ]
    per_round = []
    for r in range(rounds):
        shards = [fed.begin_round(r).shard for fed in feds]
        for k, fed in enumerate(feds):
            for cid in shards[k]:
                fed.train_client(cid)
            buffers[k] = fed.aggregator._flat.clone()  # what this rank sends (test-only access)
        before = len(calls)
        for fed in feds:
            fed.end_round()
        per_round.append((len(calls) - before) // 2)
    return feds, per_round


def test_two_ranks_equal_one_rank_with_one_collective_per_round() -> None:
    data = regression([5, 8, 3, 9, 6])
    kw = dict(clients_per_round=3, local_steps=3, batch_size=2, lr=0.05, seed=2, weighting="uniform")
    parts = lambda: [FBE(lam=5.0, regularizer=l1(0.1))]  # noqa: E731
    one = make_fed(linear(3, 1, dtype=f64), data, parts(), loss_fn=mse, **kw)
    run_rounds(one, 3)
    feds, per_round = _two_ranks(data, parts, 3, **kw)
    assert per_round == [1, 1, 1]  # no client state, no statistic of its own: the round's one all-reduce only
    for fed in feds:
        torch.testing.assert_close(flat(fed.params), flat(one.params), rtol=0, atol=1e-14)


# ---------------------------------------------------------------------- checks
class _Picks(FederatedCallback):
    """Another part that chooses the minibatches: rows ``step, step + 1, step + 2`` of client 0 at step ``step``."""

    def sample_batch(self, fed, client):
        return fed.data.client_indices[client.cid][client.step : client.step + 3]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"lam": 0.0}, "algo.lam"),
        ({"hessian": "bfgs"}, "algo.hessian"),
        ({"fd_eps": 0.0}, "algo.fd_eps"),
        ({"hessian_batch": "other"}, "algo.hessian_batch"),
        ({"hessian_batch_size": 0}, "algo.hessian_batch_size"),
        ({"personal_batch": 0}, "algo.personal_batch"),
    ],
)
def test_bad_options_stop_with_one_line(kwargs: dict, key: str) -> None:
    raises_one_line(FBE, match=key, **kwargs)


def test_same_batch_uses_the_rows_another_part_chose() -> None:
    """With ``hessian_batch=same``, D_hat is whatever D the step used (``client.rows``), also when another part chose
    it: three steps on rows {k, k+1, k+2} of a 9-row client, by hand."""
    lam, eta, mu = 3.0, 0.05, 0.2
    data = regression([9])
    fed = _fed(data, [_Picks(), FBE(lam=lam, hessian_batch="same", regularizer=l1(mu))], lr=eta, local_steps=3)
    w = flat(fed.params)
    run_rounds(fed, 1)
    for k in range(3):
        rows = torch.arange(k, k + 3)
        u = w - prox(w - grad(data.x[rows], data.y[rows], w) / lam, mu / lam)
        w = w - eta * (lam * u - hess(data.x[rows]) @ u)
    torch.testing.assert_close(flat(fed.params), w, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------- composition (issue item 9)
def test_fbe_with_a_zero_prox_term_is_fbe_bitwise() -> None:
    data = regression([7, 5, 9, 4])
    kw = dict(clients_per_round=3, local_steps=4, batch_size=3, lr=0.05, seed=1)
    plain = _fed(data, [FBE(lam=4.0, regularizer=l1(0.2))], **kw)
    prox = _fed(data, [FBE(lam=4.0, regularizer=l1(0.2)), Prox(mu=0.0)], **kw)
    run_rounds(plain, 2)
    run_rounds(prox, 2)
    assert all(torch.equal(a, b) for a, b in zip(plain.params, prox.params))


def test_prox_listed_after_fbe_adds_its_term_to_the_fbe_direction() -> None:
    """FedProx as the outer solver of F (the paper's Sec. 2.2 names it): w_{k+1} = w_k - eta (G(w_k) + mu (w_k - w^t));
    full batch, h = 0, exact Hessian: G(w) = lam u - H u with u = g(w) / lam."""
    lam, eta, mu = 4.0, 0.1, 0.7
    data = regression([8])
    fed = _fed(data, [FBE(lam=lam, hessian_batch="same"), Prox(mu=mu)], lr=eta, local_steps=2)
    w0 = w = flat(fed.params)
    run_rounds(fed, 1)
    for _ in range(2):
        u = grad(data.x, data.y, w) / lam
        w = w - eta * (lam * u - hess(data.x) @ u + mu * (w - w0))
    torch.testing.assert_close(flat(fed.params), w, rtol=0, atol=1e-12)


def test_fbe_with_drfa_lambda_sampling_draws_the_cohort_from_lambda() -> None:
    """DRFA's sampler and dual ascent around pFedFBE's local steps: round r's cohort is m draws with replacement from
    Categorical(lambda^(r)) on the (seed, r) sampling stream; lambda moves off uniform; everything stays finite."""
    n, m, seed = 6, 4, 3
    data = regression([6, 9, 5, 8, 7, 4])
    drfa = LambdaSampling(gamma=0.05)
    fed = _fed(
        data, [FBE(lam=5.0, regularizer=l1(0.1)), drfa], clients_per_round=m, local_steps=3, batch_size=3, seed=seed
    )
    lam = torch.full((n,), 1.0 / n, dtype=f64)
    for r in range(2):
        rnd = fed.begin_round(r)
        rng = np.random.default_rng(derive_seed(seed, r, SAMPLE_TAG))
        ids, counts = np.unique(rng.choice(n, size=m, replace=True, p=(lam / lam.sum()).numpy()), return_counts=True)
        assert rnd.cohort == tuple(ids.tolist()) and tuple(rnd.draws[c] for c in rnd.cohort) == tuple(counts.tolist())
        for cid in rnd.shard:
            fed.train_client(cid)
        fed.end_round()
        lam = drfa.lam.clone()
    assert not torch.allclose(lam, torch.full((n,), 1.0 / n, dtype=f64))
    assert torch.isfinite(flat(fed.params)).all() and torch.isfinite(lam).all()
    assert fed.train_loss is not None and np.isfinite(fed.train_loss)


# ---------------------------------------------------------------------- the logged objective
def test_fbe_objective_is_eq_5_by_hand_averaged_over_clients_and_split_over_ranks() -> None:
    """train/fbe_objective = (1/N) sum_i [f_i(w) - ||g_i||^2 / (2 lam) + mu ||p_i weight||_1 + lam/2 ||p_i - v_i||^2],
    g_i = grad f_i(w) on all of client i's rows, v_i = w - g_i / lam, p_i = prox_{h/lam}(v_i) (Eqs. 5 and 7), written
    out with the closed-form gradient; two ranks (client i on rank i mod 2) summed give the same number."""
    lam, mu = 2.0, 0.3
    data = regression([5, 8, 3, 6, 7])
    parts = lambda: [FBE(lam=lam, regularizer=l1(mu))]  # noqa: E731
    fed = _fed(data, parts(), clients_per_round=2, local_steps=2, batch_size=3)
    run_rounds(fed, 1)
    w = flat(fed.params)
    hand = []
    for r in data.client_indices:
        g = grad(data.x[r], data.y[r], w)
        v = w - g / lam
        p = prox(v, mu / lam)
        f = loss(data.x[r], data.y[r], w)
        hand.append(f - float(g @ g) / (2 * lam) + mu * float(p[:-1].abs().sum()) + lam / 2 * float((p - v) @ (p - v)))
    assert fbe_objective(fed, lam, fed.parts[0].reg) == pytest.approx(sum(hand) / 5, abs=1e-12)
    shares: dict[int, Tensor] = {}

    def keep(r: int):
        def reduce_sum(t: Tensor) -> Tensor:
            shares[r] = t.clone()
            return t

        return reduce_sum

    for r in (0, 1):
        other = make_fed(linear(3, 1, dtype=f64), data, parts(), loss_fn=mse, rank=r, world_size=2, reduce_sum=keep(r))
        with torch.no_grad():
            torch._foreach_copy_(other.params, fed.params)
        fbe_objective(other, lam, other.parts[0].reg)
    assert float((shares[0] + shares[1]).mean()) == pytest.approx(sum(hand) / 5, abs=1e-12)
    assert all(float(shares[r][i]) == 0 for r in (0, 1) for i in range(5) if i % 2 != r)
