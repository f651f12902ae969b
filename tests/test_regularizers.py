"""Prox operators against numerical minimisers, hand-built SVDs and the Moreau identity; name-pattern selection.

The references are written here, not taken from ``flx``: each ``h`` is re-implemented in numpy, and
``prox_{gamma h}(v) = argmin_u phi(u)``, ``phi(u) = h(u) + ||u - v||^2 / (2 gamma)``, is found by SciPy's damped
Newton steps for the penalties, on the smoothed ``h_eps`` (every norm ``|t|`` replaced by ``sqrt(t^2 + eps^2)``,
singular values included) with ``eps`` driven from 1e-2 to 1e-12 from warm starts; L-BFGS-B with bounds for the
indicators. ``phi`` is
``1/gamma``-strongly convex, so ``phi(u) - phi(u*) >= ||u - u*||^2 / (2 gamma)``: an objective no larger than the
solver's and an argument close to it pin the closed form down.
"""

from __future__ import annotations

import doctest
from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import raises_one_line
from omegaconf import OmegaConf
from scipy.optimize import minimize
from torch import nn

import flx.regularizers
from flx.regularizers import (
    REGULARIZERS,
    Regularizer,
    make_regularizer,
    prox_group_l2,
    prox_l1,
    prox_nonneg,
    prox_nuclear,
    value_box,
    value_nonneg,
)

GAMMA = 0.7
H: dict[str, Callable[..., float]] = {  # numpy h(u) for a flat u and the tensor's shape
    "l1": lambda u, shape, mu: mu * np.abs(u).sum(),
    "elastic_net": lambda u, shape, mu1, mu2: mu1 * np.abs(u).sum() + 0.5 * mu2 * (u**2).sum(),
    "group_l2": lambda u, shape, mu, dim=None: (
        mu * (np.linalg.norm(u) if dim is None else np.linalg.norm(u.reshape(shape), axis=dim).sum())
    ),
    "nuclear": lambda u, shape, mu, shape2d=None: (
        mu * np.linalg.svd(u.reshape(shape2d or shape), compute_uv=False).sum()
    ),
}
CASES = [  # name, flx keyword arguments, numpy keyword arguments, tensor shape
    ("l1", dict(mu=0.8), dict(mu=0.8), (6,)),
    ("elastic_net", dict(mu1=0.8, mu2=1.5), dict(mu1=0.8, mu2=1.5), (6,)),
    ("group_l2", dict(mu=1.1), dict(mu=1.1), (2, 3)),
    ("group_l2", dict(mu=1.1, dim=1), dict(mu=1.1, dim=1), (3, 2)),  # rows: some shrunk to 0
    ("group_l2", dict(mu=6.0), dict(mu=6.0), (2, 3)),  # the whole block to 0
    ("nuclear", dict(mu=0.9), dict(mu=0.9), (3, 3)),
    ("nuclear", dict(mu=0.9, shape=(2, 3)), dict(mu=0.9, shape2d=(2, 3)), (6,)),
]


def _vector(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 1.5 * torch.randn(shape, generator=g, dtype=torch.float64)


SMOOTH: dict[str, Callable[..., torch.Tensor]] = {  # h_eps(u) (torch, for its gradient): -> h as eps -> 0
    "l1": lambda u, shape, eps, mu: mu * torch.sqrt(u**2 + eps**2).sum(),
    "elastic_net": lambda u, shape, eps, mu1, mu2: mu1 * torch.sqrt(u**2 + eps**2).sum() + 0.5 * mu2 * (u**2).sum(),
    "group_l2": lambda u, shape, eps, mu, dim=None: (
        mu * torch.sqrt((u.reshape(shape) ** 2).sum(dim=dim) + eps**2).sum()
    ),
    "nuclear": lambda u, shape, eps, mu, shape2d=None: (
        mu * torch.sqrt(torch.linalg.svdvals(u.reshape(shape2d or shape)) ** 2 + eps**2).sum()
    ),
}


def _numerical_prox(name: str, np_kw: dict, shape: tuple, v: np.ndarray) -> np.ndarray:
    """argmin_u h_eps(u) + ||u - v||^2 / (2 gamma): damped Newton steps (autograd Hessian, backtracking) for
    eps = 1e-2, 1e-4, ..., 1e-12, each warm-started from the last; |u - argmin phi| = O(eps)."""
    target = torch.from_numpy(v)
    x = target.clone()
    for eps in (1e-2, 1e-4, 1e-6, 1e-8, 1e-10, 1e-12):

        def phi(u: torch.Tensor, eps: float = eps) -> torch.Tensor:
            return SMOOTH[name](u, shape, eps, **np_kw) + ((u - target) ** 2).sum() / (2 * GAMMA)

        for _ in range(200):
            grad = torch.autograd.functional.jacobian(phi, x)
            step = torch.linalg.solve(torch.autograd.functional.hessian(phi, x), grad)
            t, fx = 1.0, phi(x)
            while phi(x - t * step) > fx and t > 1e-12:
                t /= 2
            x = x - t * step
            if float((t * step).abs().max()) < 1e-15:
                break
    return x.numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("name", "kw", "np_kw", "shape"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_prox_is_the_numerical_argmin(name: str, kw: dict, np_kw: dict, shape: tuple, seed: int) -> None:
    """phi(closed form) <= phi(SciPy's minimiser) + 1e-12, the two agree to 1e-8, and value_<name> is h."""
    v = _vector(shape, seed)
    u = getattr(flx.regularizers, f"prox_{name}")(v, GAMMA, **kw).numpy().ravel()
    x = _numerical_prox(name, np_kw, shape, v.numpy().ravel())

    def phi(w: np.ndarray) -> float:
        return H[name](w, shape, **np_kw) + ((w - v.numpy().ravel()) ** 2).sum() / (2 * GAMMA)

    assert phi(u) <= phi(x) + 1e-12
    np.testing.assert_allclose(u, x, atol=1e-8)
    value = getattr(flx.regularizers, f"value_{name}")(torch.from_numpy(u).reshape(shape), **kw)
    assert float(value) == pytest.approx(H[name](u, shape, **np_kw), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("name", "kw"), [("nonneg", {}), ("box", dict(low=-0.5, high=0.8))])
def test_projections_are_the_numerical_argmin(name: str, kw: dict, seed: int) -> None:
    """Indicators: the prox is the projection, the bound-constrained least-squares minimiser (L-BFGS-B)."""
    v = _vector((7,), seed)
    low, high = kw.get("low", 0.0), kw.get("high")
    res = minimize(
        lambda u: ((u - v.numpy()) ** 2).sum() / (2 * GAMMA),
        np.zeros(7),
        jac=lambda u: (u - v.numpy()) / GAMMA,
        method="L-BFGS-B",
        bounds=[(low, high)] * 7,
        options=dict(ftol=1e-15, gtol=1e-12),
    )
    u = getattr(flx.regularizers, f"prox_{name}")(v, GAMMA, **kw)
    np.testing.assert_allclose(u.numpy(), res.x, atol=1e-8)
    assert float(getattr(flx.regularizers, f"value_{name}")(u, **kw)) == 0.0


def test_indicator_values() -> None:
    v = torch.tensor([0.5, -0.1, 2.0])
    assert value_nonneg(v) == float("inf") and value_nonneg(v.abs()) == 0
    assert value_box(v, low=-0.2, high=2.0) == 0 and value_box(v, low=0.0) == float("inf")
    assert value_box(v, high=1.0) == float("inf") and value_box(v) == 0


def test_nuclear_prox_shrinks_a_hand_built_svd() -> None:
    """V = U diag(3, 1.5, 0.2) Q^T with orthogonal U, Q (QR of random matrices); gamma mu = 1 gives
    U diag(2, 0.5, 0) Q^T: rank 2, the same singular vectors."""
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(4, 3, generator=g, dtype=torch.float64))
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    v = u @ torch.diag(torch.tensor([3.0, 1.5, 0.2], dtype=torch.float64)) @ q.T
    expected = u @ torch.diag(torch.tensor([2.0, 0.5, 0.0], dtype=torch.float64)) @ q.T
    out = prox_nuclear(v, gamma=0.5, mu=2.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert torch.linalg.matrix_rank(out) == 2
    flat = prox_nuclear(v.reshape(-1), gamma=0.5, mu=2.0, shape=(4, 3))  # a vector parameter seen as a matrix
    torch.testing.assert_close(flat, expected.reshape(-1), rtol=0, atol=1e-12)
    conv = torch.randn(4, 3, 1, 1, generator=g, dtype=torch.float64)  # more dims: (size(0), -1)
    torch.testing.assert_close(
        prox_nuclear(conv, 0.5, 2.0), prox_nuclear(conv.reshape(4, 3), 0.5, 2.0).reshape(conv.shape)
    )


def _project_spectral_ball(v: torch.Tensor, radius: float) -> torch.Tensor:
    u, s, qh = torch.linalg.svd(v, full_matrices=False)
    return (u * s.clamp_max(radius)) @ qh


@pytest.mark.parametrize(
    ("prox", "conjugate_prox"),
    [  # prox_{gamma h}(v) and prox_{h*/gamma}(v/gamma), h* the conjugate (an indicator: its prox is a projection)
        (lambda v: prox_l1(v, GAMMA, 0.8), lambda y: y.clamp(-0.8, 0.8)),  # h* = indicator of ||y||_inf <= mu
        (lambda v: prox_group_l2(v, GAMMA, 1.1), lambda y: y * (1.1 / y.norm()).clamp_max(1)),  # ||y||_2 <= mu
        (
            lambda v: prox_group_l2(v, GAMMA, 1.1, dim=1),
            lambda y: y * (1.1 / torch.linalg.vector_norm(y, dim=1, keepdim=True)).clamp_max(1),  # per row
        ),
        (lambda v: prox_nonneg(v, GAMMA), lambda y: y.clamp_max(0)),  # h* = indicator of y <= 0 (polar cone)
        (lambda v: prox_nuclear(v, GAMMA, 0.9), lambda y: _project_spectral_ball(y, 0.9)),  # spectral norm <= mu
    ],
    ids=["l1", "group_l2", "group_l2_rows", "nonneg", "nuclear"],
)
def test_moreau_identity(prox: Callable, conjugate_prox: Callable) -> None:
    """prox_{gamma h}(v) + gamma prox_{h*/gamma}(v / gamma) = v."""
    v = _vector((3, 4), 5)
    torch.testing.assert_close(prox(v) + GAMMA * conjugate_prox(v / GAMMA), v, rtol=0, atol=1e-12)


def test_zero_step_and_zero_group_edge_cases() -> None:
    v = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    out = prox_group_l2(v, gamma=1.0, mu=1.0, dim=1)
    assert torch.equal(out[0], torch.zeros(2)) and torch.isfinite(out).all()
    for name, kw in [("l1", dict(mu=1.0)), ("group_l2", dict(mu=1.0)), ("nuclear", dict(mu=1.0))]:
        assert getattr(flx.regularizers, f"prox_{name}")(v, 0.0, **kw) is v  # gamma = 0: the identity, exactly


# ------------------------------------------------------------------------------------------------ the Regularizer
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))  # 0.weight, 0.bias, 2.weight, 2.bias


def test_selection_by_name_patterns() -> None:
    net = _net()
    assert Regularizer("l1", 0.1, ["*weight"]).select(net) == [0, 2]
    assert Regularizer("l1", 0.1, ["0.*"]).select(net) == [0, 1]
    assert Regularizer("l1", 0.1, ["2.bias", "0.weight"]).select(net) == [0, 3]
    assert Regularizer("l1", 0.1).select(net) == [0, 1, 2, 3]
    net[0].bias.requires_grad_(False)  # indices count trainable parameters only, as fed.params does
    assert Regularizer("l1", 0.1, ["*bias"]).select(net) == [2]


def test_prox_and_value_act_on_selected_tensors_only() -> None:
    net = _net()
    reg = Regularizer("l1", 0.5, ["*weight"])
    reg.bind(net)
    params = [p for p in net.parameters()]
    before = [p.detach().clone() for p in params]
    out = reg.prox(params, 0.2)
    assert out[1] is params[1] and out[3] is params[3]  # unselected: returned as they are
    torch.testing.assert_close(out[0], prox_l1(before[0], 0.2, 0.5), rtol=0, atol=0)
    assert float(reg.value([p.detach() for p in params])) == pytest.approx(
        0.5 * float(before[0].abs().sum() + before[2].abs().sum())
    )
    reg.prox_(params, 0.2)
    assert torch.equal(params[0], out[0]) and torch.equal(params[2], out[2])
    assert torch.equal(params[1], before[1]) and torch.equal(params[3], before[3])


def test_unbound_regularizer() -> None:
    """``params=("*",)`` works on bare tensor lists; other patterns need the names (bind)."""
    ts = [torch.tensor([1.0, -3.0]), torch.tensor([0.5])]
    out = Regularizer("l1", 1.0).prox(ts, 1.0)
    assert torch.equal(out[0], torch.tensor([0.0, -2.0])) and torch.equal(out[1], torch.tensor([0.0]))
    with pytest.raises(RuntimeError, match="bind"):
        Regularizer("l1", 1.0, ["*weight"]).prox(ts, 1.0)


def test_make_regularizer_from_config() -> None:
    cfg = OmegaConf.create({"name": "elastic_net", "mu": 0.2, "params": ["*weight"], "mu2": 0.5, "dim": None})
    reg = make_regularizer(cfg)
    assert reg.name == "elastic_net" and reg.kwargs == {"mu1": 0.2, "mu2": 0.5} and reg.patterns == ("*weight",)
    assert make_regularizer(None).identity and make_regularizer({"name": "none"}).identity
    assert make_regularizer({"name": "l1", "mu": 0}).identity and not make_regularizer({"name": "nonneg"}).identity
    assert make_regularizer({"name": "box"}).identity and not make_regularizer({"name": "box", "low": 0}).identity
    assert not make_regularizer({"name": "elastic_net", "mu2": 1.0}).identity
    assert set(REGULARIZERS) == {"none", "l1", "elastic_net", "group_l2", "nuclear", "nonneg", "box"}


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"name": "l3"}, "algo.regularizer.name='l3': allowed: none, l1"),
        ({"name": "l1", "mu": -0.1}, "algo.regularizer.mu=-0.1"),
        ({"name": "l1", "mu": "abc"}, "algo.regularizer.mu='abc'"),
        ({"name": "box", "low": 1.0, "high": 0.0}, "algo.regularizer.low=1.0: must be <= algo.regularizer.high=0.0"),
        ({"name": "l1", "mu": 0.1, "dim": 1}, "algo.regularizer.dim=1: not an option of name=l1"),
        ({"name": "elastic_net", "mu2": -1}, "algo.regularizer.mu2=-1"),
        ({"name": "nuclear", "shape": [32]}, "algo.regularizer.shape=[32]"),
        ({"name": "group_l2", "dim": "rows"}, "algo.regularizer.dim='rows'"),
        ({"name": "l1", "params": []}, "algo.regularizer.params=[]"),
        ("l1", "algo.regularizer='l1'"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(cfg: object, match: str) -> None:
    raises_one_line(make_regularizer, cfg, match=match)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"name": "l1", "params": ["*weight", "*gamma"]}, "algo.regularizer.params=['*weight', '*gamma']: '*gamma'"),
        ({"name": "nuclear", "mu": 1.0}, "algo.regularizer.shape=None: parameter '0.bias' of shape (3,)"),
        ({"name": "nuclear", "mu": 1.0, "params": ["0.weight"], "shape": [5, 5]}, "does not fit parameter '0.weight'"),
        ({"name": "group_l2", "mu": 1.0, "params": ["*bias"], "dim": 1}, "algo.regularizer.dim=1: out of range"),
    ],
)
def test_bind_errors_name_the_key(cfg: dict, match: str) -> None:
    raises_one_line(make_regularizer(cfg).bind, _net(), match=match)


def test_doctests() -> None:
    assert doctest.testmod(flx.regularizers, raise_on_error=False).failed == 0
