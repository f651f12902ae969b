r"""Projections and proximal steps on the probability simplex, for the dual weights ``lam`` of DRFA.

Deng, Kamani, Mahdavi, "Distributionally Robust Federated Averaging", NeurIPS 2020. The mixing
weights live on :math:`\Lambda = \{\lambda \in \mathbb R^N_+ : \sum_i \lambda_i = 1\}`. DRFA (Algorithm 1,
line 17) takes a projected ascent step and DRFA-Prox (Algorithm 2, line 17) a proximal one:

.. math::
    \lambda^{(s+1)} = \Pi_\Lambda\big(\lambda^{(s)} + \tau\gamma v\big), \qquad
    \lambda^{(s+1)} = \arg\max_{u \in \Lambda} \Big\{\tau g(u) - \frac{1}{2\gamma}\|y - u\|^2\Big\}
    = \arg\min_{u \in \Lambda} \Big\{\frac12 \|u - y\|^2 - \gamma\tau g(u)\Big\},
    \quad y = \lambda^{(s)} + \gamma\tau v.

The paper names no projection algorithm and fixes no regulariser :math:`g`. Here:

- :func:`project_simplex`: the sort-based :math:`O(N \log N)` projection of Duchi, Shalev-Shwartz, Singer
  and Chandra (ICML 2008), the one the authors' FedTorch code uses.
- :func:`prox_chi2` and :func:`prox_kl`: DRFA-Prox line 17 for :math:`g(u) = -\frac{\rho}{2}\|u - \mathbf 1/N\|^2`
  (chi-square to uniform) and :math:`g(u) = -\rho\,\mathrm{KL}(u \,\|\, \mathbf 1/N)`, with :math:`c = \gamma\tau\rho`.
  Both closed forms are ours: the paper fixes no regulariser and runs no DRFA-Prox experiment (Sec. 5
  names KL, optimal transport and l_p distances only).
- :func:`floor_and_renormalise`: FedTorch's floor on ``lam`` after each projection (not in the paper).

All functions take a 1-D tensor of length :math:`N \ge 1` and return a new tensor of the same dtype; none
needs autograd. :func:`prox_kl` computes in float64 whatever the input dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["floor_and_renormalise", "project_simplex", "prox_chi2", "prox_kl"]

# Newton on e^s + s = z from the start below has error e_{k+1} <= e_k^2 / 2 with e_0 < 1, so six steps
# already reach 2^-63; two more absorb rounding.
_OMEGA_NEWTON_STEPS = 8
_BISECTION_MAX_STEPS = 200


def _as_vector(x: Tensor, name: str) -> Tensor:
    """``x`` as a floating 1-D tensor with at least one entry."""
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(x.shape)}")
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def project_simplex(v: Tensor) -> Tensor:
    r"""Euclidean projection onto the probability simplex.

    Solves :math:`\min_x \frac12\|x - v\|^2` s.t. :math:`x \ge 0,\ \sum_i x_i = 1`. The KKT conditions give
    :math:`x = \max(v - \theta, 0)` for the unique :math:`\theta` with :math:`\sum_i \max(v_i - \theta, 0) = 1`;
    with :math:`u` the entries of :math:`v` sorted in decreasing order and :math:`c_j = \sum_{k \le j} u_k`,

    .. math::
        \rho = \max\{j : u_j - (c_j - 1)/j > 0\}, \qquad \theta = (c_\rho - 1)/\rho, \qquad
        x = \max(v - \theta, 0).

    The projection commutes with adding a constant to every entry, so :math:`\max_i v_i` is subtracted first
    to keep the cumulative sums well scaled (then :math:`j = 1` always qualifies). A point already on the
    simplex comes back unchanged up to rounding; ties need no special care.

    Args:
        v: point to project, shape ``(N,)``.

    Returns:
        The projection, shape ``(N,)``, same dtype as ``v``.

    Examples:
        >>> project_simplex(torch.tensor([2.0, 2.0, -1.0]))
        tensor([0.5000, 0.5000, 0.0000])
    """
    v = _as_vector(v, "v")
    shifted = v - v.max()
    u = torch.sort(shifted, descending=True).values
    cssv = torch.cumsum(u, dim=0)
    j = torch.arange(1, v.numel() + 1, device=v.device)
    rho = int(j[u - (cssv - 1) / j > 0].max())
    theta = (cssv[rho - 1] - 1) / rho
    return torch.clamp(shifted - theta, min=0)


def floor_and_renormalise(lam: Tensor, floor: float) -> Tensor:
    r"""FedTorch's floor on the dual weights: raise small entries to ``floor``, then renormalise.

    .. math::
        \tilde\lambda_i = \max(\lambda_i, f), \qquad
        \lambda_i \leftarrow \tilde\lambda_i \Big/ \sum_k \tilde\lambda_k.

    Entries at or below :math:`f` are set to :math:`f` (as in FedTorch's DRFA and AFL), so after the
    renormalisation they equal :math:`f / \sum_k \tilde\lambda_k \le f`: the floor keeps every client's
    sampling probability away from zero but is not an exact lower bound. ``floor = 0`` is the paper's
    update (no floor) and returns an unchanged copy of ``lam``.

    Args:
        lam: weights on the simplex, shape ``(N,)``.
        floor: the floor :math:`f \ge 0` (FedTorch uses ``1e-3``).

    Returns:
        The floored weights, shape ``(N,)``, summing to one.

    Examples:
        >>> floor_and_renormalise(torch.tensor([0.0, 0.2, 0.8]), 0.25)  # [0.25, 0.25, 0.8] / 1.3
        tensor([0.1923, 0.1923, 0.6154])
    """
    lam = _as_vector(lam, "lam")
    if floor < 0:
        raise ValueError(f"floor must be >= 0, got {floor}")
    if floor == 0:
        return lam.clone()
    floored = torch.clamp(lam, min=floor)
    return floored / floored.sum()


def prox_chi2(y: Tensor, c: float) -> Tensor:
    r"""Proximal step of the chi-square-to-uniform regulariser on the simplex (DRFA-Prox, Algorithm 2, line 17).

    .. math::
        \arg\min_{u \in \Lambda} \frac12\|u - y\|^2 + \frac c2 \|u - \mathbf 1/N\|^2
        = \Pi_\Lambda\Big(\frac{y + c\,\mathbf 1/N}{1 + c}\Big),

    because completing the square turns the objective into :math:`\frac{1+c}{2}\|u - (y + c\mathbf 1/N)/(1+c)\|^2`
    plus a constant. In DRFA-Prox, :math:`g(u) = -\frac\rho2\|u - \mathbf 1/N\|^2` and :math:`c = \gamma\tau\rho`.
    The chi-square divergence to uniform is :math:`\chi^2(u \,\|\, \mathbf 1/N) = \sum_i (u_i - 1/N)^2 / (1/N)
    = N\|u - \mathbf 1/N\|^2`, so :math:`g = -\alpha\chi^2` corresponds to :math:`\rho = 2\alpha N`.
    ``c = 0`` is the plain projection; larger ``c`` shrinks toward uniform:
    :math:`|u_i - u_j| \le |y_i - y_j| / (1 + c)`.
    (The :math:`c/N` term shifts every entry equally and so does not change the projection; it is kept to match
    the derivation.)

    Args:
        y: the point after the dual ascent step, :math:`\lambda^{(s)} + \gamma\tau v`, shape ``(N,)``.
        c: regularisation weight :math:`c = \gamma\tau\rho \ge 0`.

    Returns:
        The proximal point, shape ``(N,)``, same dtype as ``y``.

    Examples:
        >>> prox_chi2(torch.tensor([1.0, 0.0]), 1.0)  # (y + 1/2) / 2 is already on the simplex
        tensor([0.7500, 0.2500])
    """
    y = _as_vector(y, "y")
    if not c >= 0 or math.isinf(c):
        raise ValueError(f"c must be finite and >= 0, got {c}")
    return project_simplex((y + c / y.numel()) / (1 + c))


def _log_wright_omega(z: Tensor) -> Tensor:
    r"""The root :math:`s` of :math:`e^s + s = z`, i.e. :math:`\log\omega(z)` for the Wright omega function.

    :math:`h(s) = e^s + s` is increasing and convex, so Newton started to the right of the root decreases
    monotonically to it. The start :math:`\min(z, \log\max(z, 1))` is an upper bound (:math:`e^s > 0`
    gives :math:`s < z`; for :math:`z \ge 1` the root is :math:`\ge 0`, so :math:`e^s \le z`) within 1 of the
    root, and :math:`h''/h' < 1` gives :math:`e_{k+1} \le e_k^2/2`. Only :math:`e^s \le \max(z, e)` is ever
    evaluated, so nothing overflows.
    """
    s = torch.minimum(z, torch.log(torch.clamp(z, min=1.0)))
    for _ in range(_OMEGA_NEWTON_STEPS):
        es = torch.exp(s)
        s = s - (es + s - z) / (es + 1)
    return s


def _kl_weights(r: Tensor, c: float) -> Tensor:
    r"""The solution :math:`u > 0` of :math:`u + c \log u = r` (elementwise), in log space.

    With :math:`u = c w`, :math:`w + \log w = r/c - \log c`, so :math:`\log u = \log c + \log\omega(r/c - \log c)`.
    """
    return torch.exp(math.log(c) + _log_wright_omega(r / c - math.log(c)))


def prox_kl(y: Tensor, c: float) -> Tensor:
    r"""Proximal step of the KL-to-uniform regulariser on the simplex (DRFA-Prox, Algorithm 2, line 17).

    .. math::
        u^\star = \arg\min_{u \in \Lambda} \frac12\|u - y\|^2 + c\,\mathrm{KL}(u \,\|\, \mathbf 1/N)
        = \arg\min_{u \in \Lambda} \frac12\|u - y\|^2 + c \sum_i u_i \log(N u_i),

    for :math:`g(u) = -\rho\,\mathrm{KL}(u \,\|\, \mathbf 1/N)` and :math:`c = \gamma\tau\rho > 0`. The entropy
    keeps :math:`u^\star > 0`, so only the equality constraint is active; with its multiplier :math:`\nu`,

    .. math::
        u_i + c \log u_i = y_i - c(1 + \log N) - \nu =: r_i(\nu), \qquad \sum_i u_i(\nu) = 1.

    Each :math:`u_i(\nu)` is solved in log space (Newton on the Wright omega equation, see
    :func:`_log_wright_omega`), and :math:`\nu` by bisection: :math:`u_i` decreases in :math:`\nu`, and
    :math:`u_i \ge 1/N` exactly when :math:`r_i \ge b := 1/N - c\log N`, so
    :math:`[\min_i a_i - b,\ \max_i a_i - b]` with :math:`a_i = r_i(0)` brackets the root. Adding a constant to
    :math:`y` does not change :math:`u^\star` (it shifts the objective by a constant on :math:`\Lambda`), so
    :math:`\max_i y_i` is subtracted first. The bisection stops at float64 resolution and the result is
    renormalised, so it sums to one to about 1e-15. Entries below float64's smallest positive number (e.g.
    :math:`\exp(-(y_{\max} - y_i)/c)` for tiny ``c``) underflow to zero. As :math:`c \to 0` this tends to
    :func:`project_simplex`, which is the ``c = 0`` case; as :math:`c \to \infty` it tends to uniform, with
    :math:`c\,|\log(u_i/u_j)| \le |y_i - y_j|`.

    Args:
        y: the point after the dual ascent step, :math:`\lambda^{(s)} + \gamma\tau v`, shape ``(N,)``.
        c: regularisation weight :math:`c = \gamma\tau\rho > 0`.

    Returns:
        The proximal point, shape ``(N,)``, positive, summing to one, same dtype as ``y``.

    Raises:
        ValueError: if ``c <= 0`` or ``c`` is not finite (use :func:`project_simplex` for ``c = 0``).
    """
    y = _as_vector(y, "y")
    if c == 0:
        raise ValueError("prox_kl needs c > 0; with c = 0 the prox is the Euclidean projection: use project_simplex")
    if not c > 0 or math.isinf(c):
        raise ValueError(f"c must be finite and > 0, got {c}")
    y64 = y.to(torch.float64)
    n = y.numel()
    a = y64 - y64.max() - c * (1 + math.log(n))
    b = 1 / n - c * math.log(n)
    nu = _bisect_decreasing(lambda nu: float(_kl_weights(a - nu, c).sum()) - 1, float(a.min()) - b, float(a.max()) - b)
    u = _kl_weights(a - nu, c)
    return (u / u.sum()).to(y.dtype)


def _bisect_decreasing(fn: Callable[[float], float], lo: float, hi: float) -> float:
    """Root of a decreasing ``fn`` with ``fn(lo) >= 0 >= fn(hi)``, to float64 resolution."""
    for _ in range(_BISECTION_MAX_STEPS):
        mid = 0.5 * (lo + hi)
        if hi - lo <= 4 * torch.finfo(torch.float64).eps * max(1.0, abs(lo), abs(hi)):
            break
        if fn(mid) > 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)
