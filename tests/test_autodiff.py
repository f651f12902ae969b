"""Gradients and Hessian-vector products at arbitrary parameters against references that do not use ``flx``.

References: a deep copy of the net with ``params`` loaded and ``backward()``; the same MLP written by hand as a
function of its weights and differentiated by ``torch.autograd.functional.hvp``; the closed-form Hessian of a linear
least-squares loss.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from flx.autodiff import FD_EPS, HVP_MODES, grad_at, hvp

N, D, H = 16, 3, 5


def _tanh_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, 1)).double()


def _batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(N, D, generator=gen, dtype=torch.float64), torch.randn(N, 1, generator=gen, dtype=torch.float64)


def _like(net: nn.Module, seed: int) -> list[Tensor]:
    """Random tensors shaped like the net's parameters (a point or a direction away from its weights)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in net.parameters()]


def _mse(out: Tensor, y: Tensor) -> Tensor:
    return (out - y).pow(2).mean()


def _mlp_loss(w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """f(w) = mean((tanh(x W1^T + b1) W2^T + b2 - y)^2), written without the nn.Module."""
    x, y = _batch()
    return _mse(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)


def _close(a: list[Tensor], b: list[Tensor], atol: float) -> None:
    assert [t.shape for t in a] == [t.shape for t in b]
    for s, t in zip(a, b):
        torch.testing.assert_close(s, t, rtol=0.0, atol=atol)


def _rel_err(a: list[Tensor], b: list[Tensor]) -> float:
    diff = sum((s - t).pow(2).sum() for s, t in zip(a, b))
    return float(diff.sqrt() / sum(t.pow(2).sum() for t in b).sqrt())


def test_grad_at_equals_backward_of_a_copy_with_params_loaded() -> None:
    net, w, batch = _tanh_mlp(), _like(_tanh_mlp(), 2), _batch()
    ref = copy.deepcopy(net)
    with torch.no_grad():
        for p, t in zip(ref.parameters(), w):
            p.copy_(t)
    _mse(ref(batch[0]), batch[1]).backward()
    _close(grad_at(net, w, batch, _mse), [p.grad for p in ref.parameters()], atol=1e-12)


def test_exact_hvp_equals_autograd_functional_hvp_of_the_hand_written_mlp() -> None:
    net = _tanh_mlp()
    w, v = _like(net, 2), _like(net, 3)
    _, ref = torch.autograd.functional.hvp(_mlp_loss, tuple(w), tuple(v))
    _close(hvp(net, w, v, _batch(), _mse, mode="exact"), list(ref), atol=1e-10)


@pytest.mark.parametrize("mode", ["exact", "fd"])
def test_hvp_of_linear_least_squares_is_2_xt_x_v_over_n(mode: str) -> None:
    """f(W, b) = ||X~ theta - y||^2 / n with X~ = [X, 1], theta = (W^T; b): H = 2 X~^T X~ / n, whatever theta.

    f is quadratic, so the central difference is exact up to rounding for any step.
    """
    torch.manual_seed(0)
    net, (x, y) = nn.Linear(D, 1).double(), _batch()
    w, v = _like(net, 2), _like(net, 3)
    xt = torch.cat([x, torch.ones(N, 1, dtype=x.dtype)], dim=1)  # (N, D + 1)
    hv = 2.0 * xt.T @ xt @ torch.cat([v[0].flatten(), v[1]]) / N  # (D + 1,)
    _close(hvp(net, w, v, (x, y), _mse, mode=mode, eps=0.1), [hv[:D].view(1, D), hv[D:]], atol=1e-10)


def test_fd_error_is_second_order_in_eps() -> None:
    """Central difference: err(eps) = c eps^2 + O(eps^4), so dividing eps by 10 divides the error by about 100."""
    net, batch = _tanh_mlp(), _batch()
    w, v = _like(net, 2), _like(net, 3)
    exact = hvp(net, w, v, batch, _mse, mode="exact")
    errs = [_rel_err(hvp(net, w, v, batch, _mse, mode="fd", eps=eps), exact) for eps in (1e-1, 1e-2, 1e-3)]
    assert errs[2] < 1e-5
    assert 70.0 < errs[0] / errs[1] < 130.0 and 70.0 < errs[1] / errs[2] < 130.0


def test_fd_step_is_eps_over_norm_v() -> None:
    """tau = eps / ||v||: AugFL's Eq. 10 with radius delta is eps = delta ||r||, and the estimate is linear in v."""
    net, batch = _tanh_mlp(), _batch()
    w, r, delta = _like(net, 2), _like(net, 3), 0.01
    norm = float(sum(t.pow(2).sum() for t in r).sqrt())
    plus = grad_at(net, [p + delta * t for p, t in zip(w, r)], batch, _mse)
    minus = grad_at(net, [p - delta * t for p, t in zip(w, r)], batch, _mse)
    eq10 = [(a - b) / (2 * delta) for a, b in zip(plus, minus)]
    _close(hvp(net, w, r, batch, _mse, mode="fd", eps=delta * norm), eq10, atol=1e-10)
    scaled = hvp(net, w, [1e3 * t for t in r], batch, _mse, mode="fd")
    _close(scaled, [1e3 * t for t in hvp(net, w, r, batch, _mse, mode="fd")], atol=1e-8)
    assert FD_EPS == 1e-3


def test_none_is_zeros_and_a_bad_mode_names_the_allowed_ones() -> None:
    net = _tanh_mlp()
    w, v = _like(net, 2), _like(net, 3)
    zeros = hvp(net, w, v, _batch(), _mse, mode="none")
    _close(zeros, [torch.zeros_like(p) for p in net.parameters()], atol=0.0)
    assert all(t.dtype == torch.float64 for t in zeros)
    with pytest.raises(ValueError, match="exact.*fd.*none"):
        hvp(net, w, v, _batch(), _mse, mode="hessian")
    assert HVP_MODES == ("exact", "fd", "none")


def test_batchnorm_statistics_and_train_mode_are_kept() -> None:
    """In train mode BatchNorm normalises with the batch statistics: the gradient is a train-mode backward's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, H), nn.BatchNorm1d(H), nn.Tanh(), nn.Linear(H, 1)).double().train()
    w, v, batch = _like(net, 2), _like(net, 3), _batch()
    before = {k: b.clone() for k, b in net.state_dict().items()}
    ref = copy.deepcopy(net)
    with torch.no_grad():
        for p, t in zip(ref.parameters(), w):
            p.copy_(t)
    _mse(ref(batch[0]), batch[1]).backward()
    _close(grad_at(net, w, batch, _mse), [p.grad for p in ref.parameters()], atol=1e-12)
    for mode in HVP_MODES:
        hvp(net, w, v, batch, _mse, mode=mode)
    assert net.training and int(net[1].num_batches_tracked) == 0
    for k, b in net.state_dict().items():
        assert torch.equal(b, before[k]), k


def test_dropout_leaves_rng_parameters_and_grads_alone_and_fd_shares_masks() -> None:
    """Both fd gradients draw the exact HVP's dropout mask (each call starts from the same RNG state), so fd still
    agrees with exact to O(eps^2); independent masks would leave an O(1 / tau) error."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Dropout(0.5), nn.Linear(H, 1)).double().train()
    w, v, batch = _like(net, 2), _like(net, 3), _batch()
    _mse(net(batch[0]), batch[1]).backward()
    params, grads = [p.clone() for p in net.parameters()], [p.grad.clone() for p in net.parameters()]
    rng = torch.get_rng_state()
    grad_at(net, w, batch, _mse)
    exact = hvp(net, w, v, batch, _mse, mode="exact")
    fd = hvp(net, w, v, batch, _mse, mode="fd")
    assert torch.equal(torch.get_rng_state(), rng)
    assert _rel_err(fd, exact) < 1e-5
    _close([p for p in net.parameters()], params, atol=0.0)
    _close([p.grad for p in net.parameters()], grads, atol=0.0)
