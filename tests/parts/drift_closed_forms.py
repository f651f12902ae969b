r"""Heterogeneous least-squares clients and the closed forms the drift-correction tests (SCAFFOLD, FedDyn) compare with.

Client :math:`i`'s loss :math:`f_i(w) = \frac{1}{n_i} \lVert \tilde X_i w - y_i \rVert^2` (``least_squares``) is a
quadratic, :math:`\nabla f_i(w) = H_i w - b_i` with :math:`H_i = \frac{2}{n_i} \tilde X_i^\top \tilde X_i` and
:math:`b_i = \frac{2}{n_i} \tilde X_i^\top y_i`. With a batch that holds all the client's rows, a local step with a
constant extra term :math:`d`, :math:`y \leftarrow y - \eta(H_i y - b_i + d)`, is affine, and so are :math:`K` of
them: :math:`y_K = A_i^K x + \sum_{k<K} A_i^k \eta (b_i - d)`, :math:`A_i = I - \eta H_i`. Hence

- the minimiser of :math:`\sum_i q_i f_i`: :math:`(\sum_i q_i H_i) w^* = \sum_i q_i b_i`;
- FedAvg's fixed point under full participation: :math:`x = \sum_i q_i (A_i^K x + v_i)`, the linear system
  :math:`(I - \sum_i q_i A_i^K) x = \sum_i q_i v_i` with :math:`v_i = \sum_{k<K} A_i^k \eta b_i`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch
from helpers import linear, make_fed
from least_squares import f64, grad, hess, mse, regression
from test_one_collective import Group
from torch import Tensor

from flx.federation import Federation

SIZES = [6, 9, 12, 7]
FULL_BATCH = dict(batch_size=64, lr=0.05, local_steps=5)  # every step sees all of a client's rows


def problem(sizes: list[int] = SIZES):
    """Four least-squares clients with different sizes, inputs and targets (each its own offset and slope); the same
    data at every call (``regression`` draws its noise from the global generator: seeded here, as ``linear`` does)."""
    torch.manual_seed(0)
    data = regression(sizes, dim=3)
    for c, idx in enumerate(data.client_indices):
        data.y[idx] += 2.0 * (c - 1.5) + c * data.x[idx, :1]
    return data


def fed(data, parts, **kw: Any) -> Federation:
    """A federation of a one-output linear model (float64) on ``data`` with the squared loss."""
    return make_fed(linear(data.x.shape[1], 1, dtype=f64), data, parts, loss_fn=mse, **{**FULL_BATCH, **kw})


def weights(data, weighting: str) -> list[float]:
    """The clients' normalised weights :math:`q_i = p_i / \\sum_j p_j` (``algo.weighting``)."""
    p = [float(len(i)) if weighting == "num_samples" else 1.0 for i in data.client_indices]
    return [w / sum(p) for w in p]


def quadratic(data, cid: int) -> tuple[Tensor, Tensor]:
    """:math:`(H_i, b_i)` of client ``cid``."""
    x, y = data.x[data.client_indices[cid]], data.y[data.client_indices[cid]]
    return hess(x), -grad(x, y, torch.zeros(x.shape[1] + 1, dtype=f64))


def local_steps(data, cid: int, x: Tensor, steps: int, lr: float, extra: Tensor | Callable[[Tensor], Tensor]) -> Tensor:
    """``steps`` full-batch steps from ``x`` on :math:`\\nabla f_i(y) + \\text{extra}` (a vector or a function of y)."""
    h, b = quadratic(data, cid)
    y = x.clone()
    for _ in range(steps):
        y = y - lr * (h @ y - b + (extra(y) if callable(extra) else extra))
    return y


def optimum(data, q: list[float]) -> Tensor:
    """The minimiser of :math:`\\sum_i q_i f_i`."""
    hs, bs = zip(*(quadratic(data, c) for c in range(len(q))))
    return torch.linalg.solve(sum(w * h for w, h in zip(q, hs)), sum(w * b for w, b in zip(q, bs)))


def fedavg_fixed_point(data, q: list[float], steps: int, lr: float) -> Tensor:
    """FedAvg's limit under full participation: the solution of :math:`(I - \\sum_i q_i A_i^K) x = \\sum_i q_i v_i`."""
    d = data.x.shape[1] + 1
    eye, lhs, rhs = torch.eye(d, dtype=f64), torch.eye(d, dtype=f64), torch.zeros(d, dtype=f64)
    for c, w in enumerate(q):
        h, b = quadratic(data, c)
        a = eye - lr * h
        lhs -= w * torch.linalg.matrix_power(a, steps)
        rhs += w * sum(torch.linalg.matrix_power(a, k) @ (lr * b) for k in range(steps))
    return torch.linalg.solve(lhs, rhs)


@cache
def fedavg_limit(weighting: str, rounds: int = 100) -> Tensor:
    """FedAvg's model after ``rounds`` rounds of full participation on :func:`problem` (``FULL_BATCH`` steps): at
    its fixed point to 1e-15 after 100 rounds. Computed once per session and weighting (SCAFFOLD and FedDyn compare
    with it)."""
    f = fed(problem(), [], clients_per_round=len(SIZES), weighting=weighting)
    for t in range(rounds):
        f.train_clients(f.begin_round(t).shard)
        f.end_round()
    return torch.cat([p.detach().reshape(-1) for p in f.params])


def two_ranks(build: Callable[..., Federation], rounds: int) -> list[Federation]:
    """Two simulated ranks (threads that take turns, meeting at every collective: ``test_one_collective.Group``)
    run ``rounds`` rounds of ``build(rank=, world_size=, reduce_sum=, gather=)``."""
    group = Group(2)
    ranks = [build(rank=r, world_size=2, reduce_sum=group.reduce_sum(r), gather=group.gather(r)) for r in (0, 1)]

    def job(rank: int) -> Callable[[], None]:
        def drive() -> None:
            fed = ranks[rank]
            for t in range(rounds):
                fed.train_clients(fed.begin_round(t).shard)
                fed.end_round()

        return drive

    group.run([job(0), job(1)])
    return ranks
