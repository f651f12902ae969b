"""Simplex projection and DRFA-Prox proximal steps against independent solvers and their optimality conditions.

References are written here, not taken from ``flx``: a bisection on the threshold ``theta`` of the projection
and SciPy's SLSQP on each objective with the simplex as constraints (best of several starts).
"""

from __future__ import annotations

import doctest
import math
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from scipy.optimize import minimize
from scipy.special import xlogy
from threadpoolctl import threadpool_limits

import flx.simplex
from flx.simplex import floor_and_renormalise, project_simplex, prox_chi2, prox_kl

Objective = Callable[[np.ndarray], float]


@pytest.fixture(autouse=True, scope="module")
def _single_threaded_blas() -> Iterator[None]:
    """SLSQP's small dense solves are far slower with OpenBLAS threads competing for 2 busy cores."""
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _bisection_projection(v: np.ndarray) -> np.ndarray:
    """Reference projection: x = max(v - theta, 0) with sum_i max(v_i - theta, 0) = 1 found by bisection.

    The sum is continuous and non-increasing in theta, >= N >= 1 at theta = min(v) - 1 and 0 at max(v).
    """
    lo, hi = v.min() - 1.0, v.max()
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if np.maximum(v - mid, 0).sum() > 1 else (lo, mid)
    return np.maximum(v - 0.5 * (lo + hi), 0)


def _slsqp_on_simplex(
    fun: Objective, jac: Callable, n: int, rng: np.random.Generator, ftol: float = 1e-15
) -> np.ndarray:
    """Numerical argmin of ``fun`` over {x >= 0, sum x = 1}: best of SLSQP from uniform and two random starts.

    ``ftol`` is absolute on ``fun``: far below the rounding of ``fun`` itself SLSQP only stops at ``maxiter``.
    """
    starts = [np.full(n, 1.0 / n), rng.dirichlet(np.ones(n)), rng.dirichlet(0.3 * np.ones(n))]
    sum_to_one = {"type": "eq", "fun": lambda x: x.sum() - 1.0, "jac": lambda x: np.ones_like(x)}
    results = [
        minimize(fun, x0, jac=jac, method="SLSQP", bounds=[(0.0, None)] * n, constraints=[sum_to_one],
                 options={"ftol": ftol, "maxiter": 100})
        for x0 in starts
    ]  # fmt: skip
    return min(results, key=lambda r: r.fun).x


def _random_points(seed: int, count: int, n_max: int) -> list[np.ndarray]:
    """Vectors of every length 1..n_max in turn, entries of scale 1e-2, 1 or 1e2 around a random offset."""
    rng = np.random.default_rng(seed)
    scales = (1e-2, 1.0, 1e2)
    return [scales[k % 3] * rng.normal(size=1 + k % n_max) + rng.normal() * scales[(k // 3) % 3] for k in range(count)]


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# --- project_simplex ---------------------------------------------------------------------------------------


def test_project_simplex_matches_bisection_and_slsqp() -> None:
    """N = 1..20, entries of scale 1e-2..1e2 (negatives included): bisection agrees to 1e-12, SLSQP to 1e-7."""
    rng = np.random.default_rng(1)
    for v in _random_points(seed=0, count=60, n_max=20):
        x = project_simplex(_t(v)).numpy()
        np.testing.assert_allclose(x, _bisection_projection(v), rtol=0, atol=1e-12)
        # (1/2 ||z - v||^2 - 1/2 ||v||^2) / scale is O(1), so the absolute ftol of SLSQP is attainable for |v| ~ 1e2
        scale = max(1.0, np.abs(v).max())
        fun, jac = (lambda z, v=v, s=scale: (0.5 * z @ z - z @ v) / s), (lambda z, v=v, s=scale: (z - v) / s)
        np.testing.assert_allclose(x, _slsqp_on_simplex(fun, jac, v.size, rng), rtol=0, atol=1e-7)


def test_project_simplex_kkt_and_idempotent() -> None:
    """x = max(v - theta, 0): v_i - x_i = theta where x_i > 0, v_i <= theta where x_i = 0; and P(P(v)) = P(v)."""
    for v in _random_points(seed=2, count=60, n_max=20):
        x = project_simplex(_t(v)).numpy()
        assert (x >= 0).all() and abs(x.sum() - 1) < 1e-12
        support = x > 0
        theta = np.mean((v - x)[support])
        scale = max(1.0, np.abs(v).max())
        np.testing.assert_allclose((v - x)[support], theta, rtol=0, atol=1e-12 * scale)
        assert (v[~support] <= theta + 1e-12 * scale).all()
        np.testing.assert_allclose(project_simplex(_t(x)).numpy(), x, rtol=0, atol=1e-15)


def test_point_on_simplex_is_unchanged() -> None:
    """Interior points, points on faces (exact zeros) and vertices come back to within a few ulps."""
    rng = np.random.default_rng(3)
    points = [rng.dirichlet(np.ones(n)) for n in range(1, 21)]
    points += [np.where(rng.random(n) < 0.4, 0.0, rng.random(n)) for n in range(2, 21)]
    points = [p / p.sum() if p.sum() > 0 else np.eye(p.size)[0] for p in points]
    points += [np.eye(5)[i] for i in range(5)]
    for p in points:
        np.testing.assert_allclose(project_simplex(_t(p)).numpy(), p, rtol=0, atol=4e-16)


@pytest.mark.parametrize(
    ("v", "expected"),
    [
        ([7.5], [1.0]),  # N = 1: the simplex is the single point {1}
        ([-3.0], [1.0]),
        ([0.5, 0.5, 0.5], [1 / 3] * 3),  # ties: theta = (1.5 - 1) / 3
        ([2.0, 2.0, -1.0], [0.5, 0.5, 0.0]),  # theta = (4 - 1) / 2 = 1.5 > -1
        ([-1.0, -2.5, -3.0], [1.0, 0.0, 0.0]),  # theta = -1 - 1 = -2 >= -2.5
        ([0.3, 0.3, 0.3, 0.1 + 1e-3], [0.3 - 1e-3 / 4, 0.3 - 1e-3 / 4, 0.3 - 1e-3 / 4, 0.1 + 1e-3 - 1e-3 / 4]),
    ],
)
def test_project_simplex_hand_cases(v: list[float], expected: list[float]) -> None:
    np.testing.assert_allclose(project_simplex(_t(np.array(v))).numpy(), expected, rtol=0, atol=1e-15)


def test_project_simplex_shift_invariant_and_keeps_dtype() -> None:
    """P(v + k 1) = P(v), since sum x = 1 absorbs a common shift; float32 in, float32 out."""
    v = torch.tensor([0.3, -1.2, 0.9, 0.0], dtype=torch.float64)
    np.testing.assert_allclose(project_simplex(v + 1e3).numpy(), project_simplex(v).numpy(), rtol=0, atol=1e-12)
    out = project_simplex(v.float())
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), project_simplex(v).numpy(), rtol=0, atol=1e-7)


def test_inputs_must_be_non_empty_vectors() -> None:
    for fn in (project_simplex, lambda v: prox_chi2(v, 1.0), lambda v: prox_kl(v, 1.0)):
        for bad in (torch.zeros(2, 3), torch.zeros(0), torch.tensor(1.0)):
            with pytest.raises(ValueError, match="1-D"):
                fn(bad)


# --- floor_and_renormalise ---------------------------------------------------------------------------------


def test_floor_and_renormalise_hand_example() -> None:
    """[0, 2e-3, 1e-3, 0.997] with floor 1e-3: entries <= 1e-3 become 1e-3, sum 1.002, then divide."""
    lam = _t(np.array([0.0, 2e-3, 1e-3, 0.997]))
    total = 1e-3 + 2e-3 + 1e-3 + 0.997
    expected = [1e-3 / total, 2e-3 / total, 1e-3 / total, 0.997 / total]
    np.testing.assert_allclose(floor_and_renormalise(lam, 1e-3).numpy(), expected, rtol=0, atol=1e-15)


def test_floor_zero_returns_input_unchanged() -> None:
    lam = _t(np.array([0.0, 0.25, 0.75]))
    out = floor_and_renormalise(lam, 0.0)
    assert torch.equal(out, lam) and out is not lam
    with pytest.raises(ValueError, match="floor"):
        floor_and_renormalise(lam, -1e-3)


# --- proximal steps ----------------------------------------------------------------------------------------

C_VALUES = (1e-3, 0.1, 1.0, 10.0)


def _dual_points(seed: int) -> list[np.ndarray]:
    """DRFA-like y = lam + gamma * tau * v: lam on the simplex plus a perturbation of scale 0.05..2."""
    rng = np.random.default_rng(seed)
    sizes, scales = (2, 3, 5, 8, 12, 4), (0.05, 2, 0.3, 1, 0.1, 0.5)
    return [rng.dirichlet(np.ones(n)) + s * rng.normal(size=n) for n, s in zip(sizes, scales)]


def _chi2_objective(y: np.ndarray, c: float) -> tuple[Objective, Callable]:
    """1/2 ||u - y||^2 + c/2 ||u - 1/N||^2 and its gradient."""
    n = y.size

    def fun(u: np.ndarray) -> float:
        return 0.5 * np.sum((u - y) ** 2) + 0.5 * c * np.sum((u - 1 / n) ** 2)

    return fun, lambda u: u - y + c * (u - 1 / n)


def _kl_objective(y: np.ndarray, c: float) -> tuple[Objective, Callable]:
    """1/2 ||u - y||^2 + c sum_i u_i log(N u_i) (0 log 0 = 0) and its gradient (clipped at u = 0)."""
    n = y.size

    def fun(u: np.ndarray) -> float:
        return 0.5 * np.sum((u - y) ** 2) + c * np.sum(xlogy(u, n * u))

    return fun, lambda u: u - y + c * (np.log(np.maximum(n * u, 1e-300)) + 1)


@pytest.mark.parametrize("c", C_VALUES)
@pytest.mark.parametrize(("prox", "objective"), [(prox_chi2, _chi2_objective), (prox_kl, _kl_objective)])
def test_prox_matches_slsqp(prox: Callable, objective: Callable, c: float) -> None:
    """Our point is feasible, no worse than SLSQP's best (objective + 1e-9) and within 1e-5 of it."""
    rng = np.random.default_rng(4)
    for y in _dual_points(seed=int(c * 1e3)):
        fun, jac = objective(y, c)
        u = prox(_t(y), c).numpy()
        assert (u >= 0).all() and abs(u.sum() - 1) < 1e-12
        ref = _slsqp_on_simplex(fun, jac, y.size, rng)
        assert fun(u) <= fun(ref) + 1e-9
        np.testing.assert_allclose(u, ref, rtol=0, atol=1e-5)


def test_prox_chi2_with_c_zero_is_the_projection() -> None:
    for y in _dual_points(seed=5):
        assert torch.equal(prox_chi2(_t(y), 0.0), project_simplex(_t(y)))
    with pytest.raises(ValueError, match="c must be"):
        prox_chi2(_t(np.ones(3)), -0.1)


@pytest.mark.parametrize("c", C_VALUES)
def test_prox_chi2_contracts_toward_uniform(c: float) -> None:
    """|u_i - u_j| <= |y_i - y_j| / (1 + c).

    u = max(w - theta, 0) with w = (y + c/N) / (1 + c), and max(., 0) is 1-Lipschitz.
    """
    for y in _dual_points(seed=6):
        u = prox_chi2(_t(y), c).numpy()
        gaps_u, gaps_y = np.abs(u[:, None] - u[None, :]), np.abs(y[:, None] - y[None, :])
        assert (gaps_u <= gaps_y / (1 + c) + 1e-15).all()


@pytest.mark.parametrize("c", (*C_VALUES, 1e-4))
def test_prox_kl_stationarity(c: float) -> None:
    """u > 0 and u_i - y_i + c (1 + log(N u_i)) = -nu for one multiplier nu (the gradient of the Lagrangian is 0)."""
    rng = np.random.default_rng(7)
    for n in (1, 2, 5, 17):
        y = rng.normal(size=n) * 0.01 + 0.1  # spread/c moderate, so no entry underflows
        u = prox_kl(_t(y), c).numpy()
        assert (u > 0).all() and abs(u.sum() - 1) < 1e-14
        residual = u - y + c * (1 + np.log(n * u))
        np.testing.assert_allclose(residual, residual.mean(), rtol=0, atol=1e-12)


def test_prox_kl_tends_to_uniform_for_large_c() -> None:
    """For any two entries |u_i - u_j| + c |log(u_i / u_j)| = |y_i - y_j|, so log(max u / min u) <= spread(y) / c."""
    y = _t(np.array([1.0, -0.5, 0.2, 0.0, 3.0]))
    spread = float(y.max() - y.min())
    for c in (1e-1, 1.0, 1e2, 1e4, 1e6):
        u = prox_kl(y, c)
        assert math.log(float(u.max() / u.min())) <= spread / c + 1e-12
        assert float((u - 0.2).abs().max()) <= 0.2 * math.expm1(spread / c)  # every u_i / (1/N) within e^{+-spread/c}
    assert float((prox_kl(y, 1e6) - 0.2).abs().max()) < 1e-6


def test_prox_kl_small_c_and_large_y() -> None:
    """No overflow: c = 1e-4 with |y| up to 1e3 stays finite, non-negative, on the simplex; positive when the
    gaps y_max - y_i are small enough for exp(-(y_max - y_i)/c) not to underflow."""
    extreme = prox_kl(_t(np.array([1e3, 0.0, -1e3, 999.99])), 1e-4)
    assert torch.isfinite(extreme).all() and (extreme >= 0).all() and abs(float(extreme.sum()) - 1) < 1e-12
    # the projection is (0.505, 0, 0, 0.495); stationarity moves the gap u_1 - u_4 = 0.01 - c log(u_1 / u_4) by ~2e-6
    np.testing.assert_allclose(extreme.numpy(), [0.505, 0.0, 0.0, 0.495], rtol=0, atol=1e-5)
    y = 1e3 + np.random.default_rng(8).normal(size=10) * 0.01
    u = prox_kl(_t(y), 1e-4)
    assert (u > 0).all() and abs(float(u.sum()) - 1) < 1e-12
    fun, _ = _kl_objective(y, 1e-4)
    assert fun(u.numpy()) <= fun(project_simplex(_t(y)).numpy()) + 1e-12  # no worse than a feasible competitor


def test_prox_kl_rejects_non_positive_c_and_keeps_dtype() -> None:
    y = torch.tensor([0.2, 0.5, 0.3])
    with pytest.raises(ValueError, match="project_simplex"):
        prox_kl(y, 0.0)
    with pytest.raises(ValueError, match="c must be"):
        prox_kl(y, -1.0)
    out = prox_kl(y, 0.1)
    assert out.dtype == torch.float32 and abs(float(out.sum()) - 1) < 1e-6


def test_docstring_examples() -> None:
    assert doctest.testmod(flx.simplex, raise_on_error=False).failed == 0
