r"""FedProx's synthetic data, Synthetic(alpha, beta) and Synthetic-IID.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous Networks", MLSys 2020
(arXiv:1812.06127), Section 5.1 (after Shamir et al.'s synthetic tasks): 30 devices, ``x`` in :math:`\mathbb R^{60}`,
10 classes, device ``k``'s labels from its own softmax model,

.. math::
    y = \arg\max(\mathrm{softmax}(W_k x + b_k)),\quad W_k \in \mathbb R^{10 \times 60},\ b_k \in \mathbb R^{10},

    u_k \sim \mathcal N(0, \alpha),\ W_k, b_k \sim \mathcal N(u_k, 1),\qquad
    B_k \sim \mathcal N(0, \beta),\ v_k \sim \mathcal N(B_k, 1),\ x_k \sim \mathcal N(v_k, \Sigma),\
    \Sigma = \mathrm{diag}(j^{-1.2})

(entries i.i.d.): ``alpha`` sets how much the local models differ, ``beta`` how much the local inputs do.
Synthetic-IID (``iid=True``): every device has the same :math:`W, b \sim \mathcal N(0, 1)` and the same input
distribution :math:`\mathcal N(0, \Sigma)` (``alpha``, ``beta`` unused).

Choices the paper leaves to its generator (the authors' ``generate_niid.py`` / ``generate_iid.py``), each a key:

* sizes: "the number of samples on each device follows a power law"; the generator draws
  :math:`n_k = \lfloor \mathrm{LogNormal}(4, 2) \rfloor + 50` (``size_mean``, ``size_sigma``, ``size_min``);
* the spread: the paper writes :math:`\mathcal N(0, \alpha)`, the generator passes ``alpha`` and ``beta`` as standard
  deviations (``scale=std``, the default: the paper's datasets); ``scale=variance`` reads them as variances;
* the split: each device's rows are 90% training, 10% test (``train_share``), its first ones (the rows are i.i.d.).

The device is the sample group (``groups_train`` / ``groups_test``), so ``partition=by_group`` with 30 clients
(``data=fedprox_synthetic`` picks it) gives each client its own generated data; ``client_eval=test_group`` measures it
on its own test rows. The draws (float64, stored as float32) come from ``np.random.default_rng(seed)`` in the
generator's order: sizes, :math:`u`, :math:`B`, :math:`v`, then per device :math:`W_k, b_k` and its rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from flx.datamodules.store import TensorData
from flx.errors import bad_value

SCALES = ("std", "variance")


@dataclass(frozen=True)
class Devices:
    """The generated devices' draws: sizes ``(K,)``, ``u`` ``(K,)``, ``B`` ``(K,)``, input means ``v`` ``(K, d)``,
    models ``W`` ``(K, d, C)`` (so that the logits are ``x @ W[k] + b[k]``) and ``b`` ``(K, C)``."""

    sizes: np.ndarray
    u: np.ndarray
    B: np.ndarray
    v: np.ndarray
    W: np.ndarray
    b: np.ndarray


def input_std(dim: int) -> np.ndarray:
    """The standard deviations of ``x``'s coordinates: :math:`\\sqrt{j^{-1.2}}`, ``j = 1..dim``."""
    return np.arange(1, dim + 1, dtype=np.float64) ** -0.6


def _check(key: str, value: object, low: float, integer: bool) -> float:
    number = isinstance(value, (int, np.integer) if integer else (int, float, np.integer, np.floating))
    if isinstance(value, bool) or not number or not math.isfinite(float(value)) or value < low:  # type: ignore[arg-type]
        kind = "an integer" if integer else "a finite number"
        raise bad_value(f"data.loader.{key}", value, f"must be {kind} >= {low:g}")
    return value  # type: ignore[return-value]


def draw_devices(
    rng: np.random.Generator,
    alpha: float,
    beta: float,
    iid: bool,
    num_clients: int,
    dim: int,
    num_classes: int,
    sizes: tuple[float, float, int],
    scale: str,
) -> Devices:
    """Sizes, then :math:`u_k, B_k, v_k` and every device's :math:`W_k, b_k`, from ``rng`` (``sizes``: the lognormal's
    mean and sigma and the minimum added)."""
    mean, sigma, least = sizes
    n = rng.lognormal(mean, sigma, num_clients).astype(np.int64) + least
    spread = (alpha, beta) if scale == "std" else (np.sqrt(alpha), np.sqrt(beta))
    u, B = rng.normal(0.0, spread[0], num_clients), rng.normal(0.0, spread[1], num_clients)
    if iid:
        v = np.zeros((num_clients, dim))
        shared = rng.normal(0.0, 1.0, (dim, num_classes)), rng.normal(0.0, 1.0, num_classes)
        W, b = (
            np.broadcast_to(shared[0], (num_clients, dim, num_classes)),
            np.broadcast_to(shared[1], (num_clients, num_classes)),
        )
    else:
        v = rng.normal(B[:, None], 1.0, (num_clients, dim))
        W = np.stack([rng.normal(u[k], 1.0, (dim, num_classes)) for k in range(num_clients)])
        b = np.stack([rng.normal(u[k], 1.0, num_classes) for k in range(num_clients)])
    return Devices(sizes=n, u=u, B=B, v=v, W=np.array(W), b=np.array(b))


def fedprox_synthetic(
    alpha: float = 1.0,
    beta: float = 1.0,
    iid: bool = False,
    num_clients: int = 30,
    dim: int = 60,
    num_classes: int = 10,
    size_mean: float = 4.0,
    size_sigma: float = 2.0,
    size_min: int = 50,
    train_share: float = 0.9,
    scale: str = "std",
    seed: int = 0,
    standardize: bool = False,
) -> TensorData:
    """Synthetic(alpha, beta) (``iid=False``) or Synthetic-IID (see the module docstring for every key).

    Returns:
        float32 inputs ``(N, dim)``, int64 labels, ``groups_*`` = device, ``num_classes`` classes.
    """
    for key, value in (("alpha", alpha), ("beta", beta), ("size_sigma", size_sigma), ("size_mean", size_mean)):
        _check(key, value, 0.0 if key != "size_mean" else -np.inf, integer=False)
    k, d, c = (
        int(_check(key, v, 1, True))
        for key, v in (("num_clients", num_clients), ("dim", dim), ("num_classes", num_classes))
    )
    least = int(_check("size_min", size_min, 2, True))
    share = _check("train_share", train_share, 0.0, integer=False)
    if not 0 < share < 1:
        raise bad_value(
            "data.loader.train_share", train_share, "must be in (0, 1): each device's share of training rows"
        )
    if not isinstance(iid, bool):
        raise bad_value("data.loader.iid", iid, "must be true or false")
    if scale not in SCALES:
        raise bad_value("data.loader.scale", scale, f"allowed: {', '.join(SCALES)}")
    rng = np.random.default_rng(seed)
    dev = draw_devices(rng, alpha, beta, iid, k, d, c, (size_mean, size_sigma, least), scale)
    std = input_std(d)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in ("x", "y", "g", "x_t", "y_t", "g_t")}
    for j, n in enumerate(dev.sizes.tolist()):
        x = dev.v[j] + rng.standard_normal((n, d)) * std
        y = np.argmax(x @ dev.W[j] + dev.b[j], axis=1)  # argmax of the softmax = argmax of the logits
        cut = max(1, min(n - 1, int(share * n)))
        for suffix, rows in (("", slice(0, cut)), ("_t", slice(cut, n))):
            parts["x" + suffix].append(x[rows])
            parts["y" + suffix].append(y[rows])
            parts["g" + suffix].append(np.full(len(y[rows]), j))
    x_train, y_train, g_train, x_test, y_test, g_test = (np.concatenate(parts[key]) for key in parts)
    return TensorData(
        x_train=torch.from_numpy(x_train).float(),
        y_train=torch.from_numpy(y_train).long(),
        x_test=torch.from_numpy(x_test).float(),
        y_test=torch.from_numpy(y_test).long(),
        num_classes=c,
        name="fedprox_synthetic_iid" if iid else f"fedprox_synthetic_{alpha:g}_{beta:g}",
        groups_train=torch.from_numpy(g_train).long(),
        groups_test=torch.from_numpy(g_test).long(),
        group_names=tuple(f"device_{j}" for j in range(k)),
    )
