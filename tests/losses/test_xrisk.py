"""FeDXL pairwise losses and surrogates: closed forms vs autograd, surrogate gradients vs G1/G2."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from flx.losses.xrisk import (
    compositional_surrogate,
    kl_opauc_inner,
    kl_opauc_inner_d1,
    kl_opauc_inner_d2,
    kl_opauc_outer,
    kl_opauc_outer_prime,
    linear_surrogate,
    psm,
    psm_d1,
    psm_d2,
    squared_hinge,
    squared_hinge_d1,
    squared_hinge_d2,
    update_u,
    update_u_table,
)

LAM = 2.5
TOL = dict(rtol=1e-12, atol=1e-10)

LOSSES = {
    "psm": (psm, psm_d1, psm_d2),
    "squared_hinge": (squared_hinge, squared_hinge_d1, squared_hinge_d2),
    "squared_hinge_m0.5": (
        partial(squared_hinge, margin=0.5),
        partial(squared_hinge_d1, margin=0.5),
        partial(squared_hinge_d2, margin=0.5),
    ),
    "kl_opauc_inner": (
        partial(kl_opauc_inner, lam=LAM),
        partial(kl_opauc_inner_d1, lam=LAM),
        partial(kl_opauc_inner_d2, lam=LAM),
    ),
}
HINGED = [k for k in LOSSES if k != "psm"]


def scores(n: int, seed: int, grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.rand(n, generator=g, dtype=torch.float64) - 0.5).requires_grad_(grad)


def autograd_partials(ell, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise loss, so the gradient of the sum is the vector of partial derivatives."""
    a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
    return torch.autograd.grad(ell(a, b).sum(), (a, b))


@pytest.mark.parametrize("name", LOSSES)
def test_closed_form_derivatives_match_autograd(name: str) -> None:
    ell, d1, d2 = LOSSES[name]
    a, b = scores(200, 0), scores(200, 1)
    ga, gb = autograd_partials(ell, a, b)
    torch.testing.assert_close(d1(a, b), ga, **TOL)
    torch.testing.assert_close(d2(a, b), gb, **TOL)


@pytest.mark.parametrize("name", HINGED)
def test_inactive_hinge_has_exactly_zero_derivative(name: str) -> None:
    """a - b = m + 0.1 > m: the hinge is off, so both partials are 0 (and the KL loss is exp(0) = 1)."""
    ell, d1, d2 = LOSSES[name]
    margin = 0.5 if name.endswith("m0.5") else 1.0
    b = scores(20, 2)
    a = b + margin + 0.1 + scores(20, 3).abs()
    ga, gb = autograd_partials(ell, a, b)
    for g in (d1(a, b), d2(a, b), ga, gb):
        assert torch.equal(g, torch.zeros_like(g))
    assert torch.equal(ell(a, b), torch.full_like(a, 1.0 if name == "kl_opauc_inner" else 0.0))


def test_psm_formula_and_symmetry() -> None:
    """ell(a, b) = 1 / (1 + exp(a - b)) and ell(t) + ell(-t) = 1 with t = a - b."""
    a, b = scores(50, 4), scores(50, 5)
    torch.testing.assert_close(psm(a, b), 1.0 / (1.0 + torch.exp(a - b)), **TOL)
    torch.testing.assert_close(psm(a, b) + psm(b, a), torch.ones_like(a), **TOL)


def test_kl_opauc_sign_and_outer() -> None:
    """Corrected sign: a well-ranked pair (a - b >= m) costs exp(0) = 1; f(u) = lam log u, f'(u) = lam / u."""
    a, b = torch.tensor([2.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(
        kl_opauc_inner(a, b, LAM), torch.tensor([1.0, torch.e ** (1.5**2 / LAM)], dtype=torch.float64), **TOL
    )
    u = torch.tensor([1.0, 3.0], dtype=torch.float64, requires_grad=True)
    (gu,) = torch.autograd.grad(kl_opauc_outer(u, LAM).sum(), u)
    torch.testing.assert_close(kl_opauc_outer(u, LAM).detach(), LAM * torch.log(u.detach()), **TOL)
    torch.testing.assert_close(kl_opauc_outer_prime(u.detach(), LAM), gu, **TOL)


def batch(seed: int, b1: int = 5, b2: int = 7, p1: int = 4, p2: int = 6) -> dict[str, torch.Tensor]:
    """Active scores with grad; passive scores with grad too, to check that none reaches them."""
    return dict(
        a=scores(b1, seed, grad=True),
        b=scores(b2, seed + 1, grad=True),
        passive_neg=scores(p2, seed + 2, grad=True),
        passive_pos=scores(p1, seed + 3, grad=True),
    )


@pytest.mark.parametrize("name", LOSSES)
def test_linear_surrogate_gradient_is_g1_plus_g2(name: str) -> None:
    """dL/da_s = 1/(B1 P2) sum_p d1 ell(a_s, hp2_p);  dL/db_t = 1/(P1 B2) sum_q d2 ell(hp1_q, b_t)."""
    ell, d1, d2 = LOSSES[name]
    x = batch(10)
    a, b, hn, hp = x["a"], x["b"], x["passive_neg"], x["passive_pos"]
    loss = linear_surrogate(a, b, hn, hp, ell)
    loss.backward()
    with torch.no_grad():
        b1, b2, p1, p2 = len(a), len(b), len(hp), len(hn)
        ga = d1(a[:, None], hn[None, :]).sum(1) / (b1 * p2)
        gb = d2(hp[:, None], b[None, :]).sum(0) / (p1 * b2)
        value = ell(a[:, None], hn[None, :]).sum() / (b1 * p2) + ell(hp[:, None], b[None, :]).sum() / (p1 * b2)
    torch.testing.assert_close(a.grad, ga, **TOL)
    torch.testing.assert_close(b.grad, gb, **TOL)
    torch.testing.assert_close(loss.detach(), value, **TOL)
    assert hn.grad is None and hp.grad is None


@pytest.mark.parametrize("name", LOSSES)
def test_compositional_surrogate_gradient_is_g1_plus_g2(name: str) -> None:
    """dL/da_s = 1/B1 f'(u_s) 1/P2 sum_p d1 ell(a_s, hp2_p);  dL/db_t = 1/P1 sum_q f'(u~_q) 1/B2 d2 ell(hp1_q, b_t).

    u values carry grad here to check that sg[.] cuts them.
    """
    ell, d1, d2 = LOSSES[name]
    f_prime = partial(kl_opauc_outer_prime, lam=LAM)
    x = batch(20)
    a, b, hn, hp = x["a"], x["b"], x["passive_neg"], x["passive_pos"]
    u_act = (1.0 + scores(len(a), 30).abs()).requires_grad_()
    u_pas = (1.0 + scores(len(hp), 31).abs()).requires_grad_()
    compositional_surrogate(a, b, hn, hp, u_act, u_pas, ell, f_prime).backward()
    with torch.no_grad():
        b1, b2, p1, p2 = len(a), len(b), len(hp), len(hn)
        ga = LAM / u_act / b1 * d1(a[:, None], hn[None, :]).sum(1) / p2
        gb = (LAM / u_pas[:, None] * d2(hp[:, None], b[None, :])).sum(0) / (p1 * b2)
    torch.testing.assert_close(a.grad, ga, **TOL)
    torch.testing.assert_close(b.grad, gb, **TOL)
    for t in (hn, hp, u_act, u_pas):
        assert t.grad is None


def test_compositional_with_unit_weights_is_linear() -> None:
    """f'(u) = 1 (linear f) turns the FeDXL2 surrogate into the FeDXL1 one."""
    x = {k: v.detach() for k, v in batch(40).items()}
    comp = compositional_surrogate(**x, u_active=x["a"], u_passive=x["passive_pos"], ell=psm, f_prime=torch.ones_like)
    torch.testing.assert_close(comp, linear_surrogate(**x, ell=psm), **TOL)


def test_update_u_hand_example() -> None:
    """Squared hinge, m = 1, gamma = 0.25; a = [0, 2], hp2 = [0, 1]:

    ell(0, .) = [1, 4] -> mean 2.5;  ell(2, .) = [0, 0] -> mean 0.
    u = [1, 2] -> [0.75 * 1 + 0.25 * 2.5, 0.75 * 2 + 0] = [1.375, 1.5].
    """
    u = torch.tensor([1.0, 2.0], dtype=torch.float64)
    a = torch.tensor([0.0, 2.0], dtype=torch.float64, requires_grad=True)
    hn = torch.tensor([0.0, 1.0], dtype=torch.float64)
    new = update_u(u, a, hn, squared_hinge, gamma=0.25)
    torch.testing.assert_close(new, torch.tensor([1.375, 1.5], dtype=torch.float64), **TOL)
    assert not new.requires_grad
    torch.testing.assert_close(u, torch.tensor([1.0, 2.0], dtype=torch.float64), rtol=0, atol=0)


def test_update_u_gamma_one_is_exact_inner_mean() -> None:
    x = batch(50)
    ell = partial(kl_opauc_inner, lam=LAM)
    new = update_u(torch.ones(5, dtype=torch.float64), x["a"], x["passive_neg"], ell, gamma=1.0)
    torch.testing.assert_close(new, ell(x["a"][:, None], x["passive_neg"][None, :]).mean(1).detach(), **TOL)


def test_update_u_table_repeated_positive_takes_the_mean_estimate() -> None:
    """Squared hinge, m = 1, gamma = 0.5, one partner c = 0; table [1, 2, 3], draws rows [0, 0, 2] scoring
    a = [0.5, 0, 1] (positive 0 twice, e.g. under input noise):

    ell(0.5, 0) = 0.25, ell(0, 0) = 1, ell(1, 0) = 0.
    u_0 = 0.5 * 1 + 0.5 * (0.25 + 1) / 2 = 0.8125 (once, not the last copy's 0.5 + 0.5 = 1.0);
    u_2 = 0.5 * 3 + 0.5 * 0 = 1.5; u_1 untouched. Returned per draw: [0.8125, 0.8125, 1.5].
    """
    table = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    a = torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64)
    new = update_u_table(table, torch.tensor([0, 0, 2]), a, torch.zeros(1, dtype=torch.float64), squared_hinge, 0.5)
    torch.testing.assert_close(new, torch.tensor([0.8125, 0.8125, 1.5], dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(table, torch.tensor([0.8125, 2.0, 1.5], dtype=torch.float64), rtol=0, atol=0)


def test_update_u_table_without_repeats_is_update_u() -> None:
    x = batch(50)
    ell, rows = partial(kl_opauc_inner, lam=LAM), torch.tensor([4, 0, 2, 1, 3])
    table = torch.arange(1.0, 6.0, dtype=torch.float64)
    expected = update_u(table[rows], x["a"], x["passive_neg"], ell, gamma=0.3)
    torch.testing.assert_close(update_u_table(table, rows, x["a"], x["passive_neg"], ell, 0.3), expected, **TOL)
    torch.testing.assert_close(table[rows], expected, **TOL)


def test_kl_opauc_exact_u_gives_true_gradient() -> None:
    """Chain rule: with u_s = g_s = 1/P2 sum_p ell(a_s, hp2_p) and u~_q = 1/B2 sum_t ell(hp1_q, b_t) exact,

    grad L = grad [ 1/B1 sum_s f(g_s(a)) + 1/P1 sum_q f(g~_q(b)) ]   with f = lam log.
    """
    ell = partial(kl_opauc_inner, lam=LAM)
    f_prime = partial(kl_opauc_outer_prime, lam=LAM)
    x = batch(60)
    a, b, hn, hp = x["a"], x["b"], x["passive_neg"].detach(), x["passive_pos"].detach()
    with torch.no_grad():
        u_act = ell(a[:, None], hn[None, :]).mean(1)
        u_pas = ell(hp[:, None], b[None, :]).mean(1)
    surrogate = compositional_surrogate(a, b, hn, hp, u_act, u_pas, ell, f_prime)
    got = torch.autograd.grad(surrogate, (a, b))
    true = kl_opauc_outer(ell(a[:, None], hn[None, :]).mean(1), LAM).mean()
    true = true + kl_opauc_outer(ell(hp[:, None], b[None, :]).mean(1), LAM).mean()
    want = torch.autograd.grad(true, (a, b))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_kl_opauc_centralised_pairs_give_objective_gradient() -> None:
    """Passive = current scores (hp2 = b, hp1 = a) and exact u: the surrogate's gradient is the gradient of

    F(a, b) = 1/B1 sum_s lam log(1/B2 sum_t ell(a_s, b_t)) through both a and b (one client == centralised).
    """
    ell = partial(kl_opauc_inner, lam=LAM)
    x = batch(70)
    a, b = x["a"], x["b"]
    with torch.no_grad():
        g = ell(a[:, None], b[None, :]).mean(1)
    surrogate = compositional_surrogate(a, b, b, a, g, g, ell, partial(kl_opauc_outer_prime, lam=LAM))
    got = torch.autograd.grad(surrogate, (a, b))
    want = torch.autograd.grad(kl_opauc_outer(ell(a[:, None], b[None, :]).mean(1), LAM).mean(), (a, b))
    for gg, w in zip(got, want):
        torch.testing.assert_close(gg, w, **TOL)
