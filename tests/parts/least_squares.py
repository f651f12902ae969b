r"""Linear least squares in closed form, shared by the pFedFBE and personalised-baseline tests.

With :math:`\tilde x = [x, 1]` and the net's parameters flattened as :math:`w = [\text{weight}, \text{bias}]` (a
one-output ``nn.Linear``), the task loss :math:`f(w) = \frac1n \sum (\tilde x^\top w - y)^2` has

.. math::
    \nabla f(w) = \tfrac{2}{n} \tilde X^\top (\tilde X w - y), \qquad \nabla^2 f = \tfrac{2}{n} \tilde X^\top \tilde X,

and :math:`h = \mu \lVert \text{weight} \rVert_1` has the soft-threshold prox on the weight, the identity on the bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import toy_data
from torch import Tensor

f64 = torch.float64


def regression(sizes: list[int], dim: int = 3, seed: int = 0):
    """y = x a + noise, float64, targets (n, 1); client c owns a contiguous block of sizes[c] rows."""
    data = toy_data(sizes, dim=dim, seed=seed, dtype=f64)
    g = torch.Generator().manual_seed(seed + 1)
    data.y = data.x @ torch.randn(dim, 1, generator=g, dtype=f64) + 0.1 * torch.randn(len(data.x), 1, dtype=f64)
    return data


def mse(out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y)


def flat(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def xt(x: Tensor) -> Tensor:
    return torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)


def loss(x: Tensor, y: Tensor, w: Tensor) -> float:
    return float(((xt(x) @ w - y.reshape(-1)) ** 2).mean())


def grad(x: Tensor, y: Tensor, w: Tensor) -> Tensor:
    return 2 * xt(x).T @ (xt(x) @ w - y.reshape(-1)) / len(x)


def hess(x: Tensor) -> Tensor:
    return 2 * xt(x).T @ xt(x) / len(x)


def prox(v: Tensor, t: float) -> Tensor:
    """Soft threshold t on the weight (all but the last entry), identity on the bias (the last)."""
    out = v.clone()
    out[:-1] = torch.sign(v[:-1]) * (v[:-1].abs() - t).clamp_min(0)
    return out


def l1(mu: float) -> dict:
    """The regulariser config mu ||weight||_1 (bias unregularised)."""
    return {"name": "l1", "mu": mu, "params": ["weight"]}
