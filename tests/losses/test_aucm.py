"""AUC-M: closed-form gradients vs autograd, the saddle point equals the pairwise square loss (Ying et al. 2016)."""

from __future__ import annotations

import pytest
import torch

from flx.losses import aucm


def _batch(n_pos: int, n_neg: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(n_pos + n_neg, generator=g, dtype=torch.float64)
    y = torch.tensor([1] * n_pos + [0] * n_neg)[torch.randperm(n_pos + n_neg, generator=g)]
    return h, y


@pytest.mark.parametrize("seed", range(4))
def test_closed_form_gradients_match_autograd(seed: int) -> None:
    h, y = _batch(5, 11, seed)
    g = torch.Generator().manual_seed(100 + seed)
    a, b, alpha = (torch.rand((), generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    h.requires_grad_()
    p, m = 0.27, 0.8
    value = aucm.aucm(h, y, a, b, alpha, p, m)
    auto = torch.autograd.grad(value, [h, a, b, alpha])
    closed = aucm.aucm_grads(h.detach(), y, a.detach(), b.detach(), alpha.detach(), p, m)
    for name, got in zip(("h", "a", "b", "alpha"), auto):
        torch.testing.assert_close(closed[name], got, rtol=0, atol=1e-14, msg=name)


@pytest.mark.parametrize("margin", [1.0, 0.3])
def test_saddle_value_is_the_pairwise_square_loss(margin: float) -> None:
    """With the batch ratio p = n+/n: min_{a,b} max_alpha F = p(1-p) mean_{i+, j-} (m - (h_i - h_j))^2 (alpha* >= 0),
    the saddle is stationary in (a, b, alpha), and dF/dh there is the pairwise loss's gradient (Danskin)."""
    h, y = _batch(6, 14, seed=3)
    p = 6 / 20
    a, b, alpha = aucm.saddle_point(h, y, margin)
    assert alpha > 0
    hh = h.clone().requires_grad_()
    saddle = aucm.aucm(hh, y, a, b, alpha, p, margin)
    pairwise = p * (1 - p) * aucm.pairwise_square(hh, y, margin)
    torch.testing.assert_close(saddle, pairwise, rtol=0, atol=1e-14)
    grads = aucm.aucm_grads(h, y, a, b, alpha, p, margin)
    for name in ("a", "b", "alpha"):
        assert abs(float(grads[name])) < 1e-14, name
    (dpair,) = torch.autograd.grad(pairwise, hh)
    torch.testing.assert_close(grads["h"], dpair, rtol=0, atol=1e-14)
    # and it is a saddle: moving a, b raises F, moving alpha lowers it
    eps = 1e-3
    assert aucm.aucm(h, y, a + eps, b, alpha, p, margin) > saddle.detach()
    assert aucm.aucm(h, y, a, b - eps, alpha, p, margin) > saddle.detach()
    assert aucm.aucm(h, y, a, b, alpha + eps, p, margin) < saddle.detach()


def test_authors_dual_gradient_is_the_scaled_stochastic_one_at_the_class_means() -> None:
    """2(m + b - a) - 2 alpha = dF/dalpha / (p(1-p)) when a, b are the class means and p = n+/n."""
    h, y = _batch(4, 12, seed=7)
    p, alpha = 4 / 16, torch.tensor(0.37, dtype=torch.float64)
    a, b, _ = aucm.saddle_point(h, y)
    stochastic = aucm.aucm_grads(h, y, a, b, alpha, p)["alpha"]
    torch.testing.assert_close(aucm.alpha_grad_ab(a, b, alpha), stochastic / (p * (1 - p)), rtol=0, atol=1e-14)
