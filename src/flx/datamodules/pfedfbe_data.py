r"""Generated data of pFedFBE's convex experiments: federated Lasso (settings I and II) and federated matrix completion.

Paper: "Personalized Federated Composite Learning with Forward-Backward Envelopes" (pFedFBE; anonymous ICLR
submission), Sections 4.1 and 4.2; where the paper is silent or ambiguous, the choices are listed below
and in docs/data.md.

Each of the ``N`` clients :math:`j` has an input distribution of its own, a mean shift drawn once, and a ground truth
:math:`w_j^\star` (shared by all clients in Lasso setting I):

.. math::
    \mu_j \sim \mathcal N(0, I_d),\qquad x_j^{(i)} = \mu_j + \delta_j^{(i)},\quad \delta_j^{(i)} \sim \mathcal N(0,
    I_d),\qquad y_j^{(i)} = \langle w_j^\star, x_j^{(i)} \rangle + b^\star + \varepsilon_j^{(i)},\quad
    \varepsilon_j^{(i)} \sim \mathcal N(0, \sigma^2)

with :math:`b^\star = 0` and :math:`\sigma = 1`, ``samples`` (128) training rows per client.

* **Lasso** (:func:`lasso_synthetic`), :math:`d = 1024`. Setting I: :math:`w^\star = [\mathbf 1_{992}, \mathbf
  0_{32}]` for every client, as the paper prints it (Sec. 4.1). Setting II: :math:`w_j^\star` is 1 on the first 8
  coordinates and 0.5 on 2 coordinates drawn per client, uniformly without replacement from the other 1016.
* **Matrix completion** (:func:`matrix_completion`), the paper's matrix-sensing form: the inputs are :math:`32 \times
  32` matrices :math:`X = \mu_j + \Delta` (i.i.d. :math:`\mathcal N(0, 1)` entries; Sec. 4.2 writes the recipe for
  vectors) and :math:`y = \langle W_j^\star, X \rangle + \varepsilon` with :math:`W_j^\star = \mathrm{diag}(w_j)`,
  :math:`w_j` 1 on the first 4 diagonal entries and 0.25 on one drawn per client from the other 28: rank 5. A linear
  model over the flattened input (``model=linear``) holds :math:`W` as its weight: ``linear.weight.view(32, 32)``
  (row-major, as the input is flattened).

Choices where the paper is silent: each client also gets ``test_samples`` (128) held-out rows from its own distribution
(the global test split; the paper does not describe its test data); the generated client is the sample group
(``groups_train`` / ``groups_test``), so ``partition=by_group`` gives exactly the paper's clients; the ground truth is
:attr:`TensorData.truth`, one per group (:func:`client_truth` maps it to the partition's clients).

Randomness: ``np.random.SeedSequence(seed)`` spawns one stream for the ground truth and one per client for its data
(:math:`\mu_j`, then its training rows, then its test rows). So client ``j``'s inputs and noise are the same in both
Lasso settings (only the truth differs), do not depend on ``num_clients``, and its training rows do not depend on
``test_samples``. Everything is drawn in float64 and stored in ``dtype``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from flx.datamodules.store import TensorData
from flx.errors import ConfigError, bad_value

__all__ = ["DTYPES", "LASSO_SETTINGS", "client_truth", "lasso_synthetic", "matrix_completion"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
"""``data.dtype`` -> the store's dtype of the inputs, targets and truth."""

LASSO_SETTINGS = {1: (992, 0, True), 2: (8, 2, False)}
"""Lasso setting -> (``ones``, ``halves``, whether every client shares one truth), as the paper prints them."""


def _count(key: str, value: int, low: int = 1, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``, else a one-line error naming ``data.loader.<key>``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise bad_value(f"data.loader.{key}", value, f"must be an integer >= {low}")
    if high is not None and value > high:
        raise bad_value(f"data.loader.{key}", value, f"must be at most {high}")
    return int(value)


def _dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise bad_value("data.dtype", dtype, f"allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _rows(rng: np.random.Generator, mu: np.ndarray, truth: np.ndarray, n: int, noise: float) -> tuple[np.ndarray, ...]:
    """``n`` rows ``x = mu + delta`` and ``y = <truth, x> + noise * eps`` of one client (float64)."""
    x = mu + rng.standard_normal((n, *mu.shape))  # (n, *shape)
    y = x.reshape(n, -1) @ truth.reshape(-1) + noise * rng.standard_normal(n)  # (n,)
    return x, y


def _generate(
    name: str,
    truth: np.ndarray,
    sizes: tuple[int, int],
    noise: float,
    streams: list[np.random.SeedSequence],
    dtype: str,
) -> TensorData:
    """The clients' rows (client-major; a row's group is its client) around the per-client ``truth`` ``(N, *shape)``,
    ``sizes`` = (training, test) rows per client, client ``j`` drawn from ``streams[j]``."""
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or noise < 0:
        raise bad_value("data.loader.noise", noise, "must be a number >= 0 (the noise std)")
    t = _dtype(dtype)
    out: dict[str, list[np.ndarray]] = {"x_train": [], "y_train": [], "x_test": [], "y_test": []}
    for w, seq in zip(truth, streams):
        rng = np.random.default_rng(seq)
        mu = rng.standard_normal(w.shape)  # the client's input mean, drawn first
        for split, n in zip(("train", "test"), sizes):
            x, y = _rows(rng, mu, w, n, float(noise))
            out[f"x_{split}"].append(x)
            out[f"y_{split}"].append(y)
    clients = torch.arange(len(truth))
    return TensorData(
        **{k: torch.from_numpy(np.concatenate(v)).to(t) for k, v in out.items()},
        num_classes=0,
        name=name,
        groups_train=clients.repeat_interleave(sizes[0]),
        groups_test=clients.repeat_interleave(sizes[1]),
        group_names=tuple(f"client {j}" for j in range(len(truth))),
        truth=torch.from_numpy(truth).to(t),
    )


def _lasso_truth(rng: np.random.Generator, clients: int, dim: int, ones: int, halves: int, shared: bool) -> np.ndarray:
    """``(clients, dim)``: 1 on the first ``ones`` coordinates, 0.5 on ``halves`` others drawn uniformly without
    replacement (once for all clients if ``shared``, else per client), 0 elsewhere."""
    truth = np.zeros((clients, dim))
    truth[:, :ones] = 1.0
    for rows in [slice(None)] if shared else range(clients):  # one draw for all, or one per client
        truth[rows, ones + rng.choice(dim - ones, size=halves, replace=False)] = 0.5
    return truth


def lasso_synthetic(
    setting: int = 1,
    num_clients: int = 30,
    samples: int = 128,
    test_samples: int = 128,
    dim: int = 1024,
    ones: int | None = None,
    halves: int | None = None,
    noise: float = 1.0,
    seed: int = 0,
    dtype: str = "float64",
    standardize: bool = False,
) -> TensorData:
    """pFedFBE's federated Lasso data, setting I (one shared truth) or II (a truth per client); see the module.

    Args:
        setting: 1 (the paper's "i.i.d.": every client shares :math:`w^\\star`, the clients differ by their input
            mean) or 2 (non-i.i.d.: each client has its own :math:`w_j^\\star`).
        num_clients: generated clients ``N`` (30).
        samples: training rows per client (128).
        test_samples: held-out rows per client from its own distribution, the test split (128; not in the paper).
        dim: ``d`` (1024).
        ones: leading coordinates equal to 1; ``None``: the setting's (992, 8).
        halves: further coordinates equal to 0.5, drawn uniformly without replacement from the others; ``None``: the
            setting's (0, 2).
        noise: the std :math:`\\sigma` of the target noise (1).
        seed: seed of everything (``data.split_seed``).
        dtype: ``float64`` or ``float32``, of the stored inputs, targets and truth.
        standardize: unused (the inputs are the model's: z-scoring them would change :math:`w^\\star`).

    Returns:
        Inputs ``(N * samples, dim)``, targets ``(N * samples,)``, the group of a row = its client, ``truth``
        ``(N, dim)`` (identical rows in setting I).

    Raises:
        ConfigError: an unknown setting, a size that is not a positive integer, a truth that does not fit in ``dim``.
    """
    if isinstance(setting, bool) or setting not in LASSO_SETTINGS:
        raise bad_value("data.setting", setting, "allowed: 1 (shared ground truth), 2 (one per client)")
    default_ones, default_halves, shared = LASSO_SETTINGS[setting]
    n, dim = _count("num_clients", num_clients), _count("dim", dim)
    ones = _count("ones", default_ones if ones is None else ones, low=0, high=dim)
    halves = _count("halves", default_halves if halves is None else halves, low=0, high=dim - ones)
    truth_seq, *client_seqs = np.random.SeedSequence(seed).spawn(n + 1)
    truth = _lasso_truth(np.random.default_rng(truth_seq), n, dim, ones, halves, shared)
    sizes = _count("samples", samples), _count("test_samples", test_samples)
    return _generate(f"lasso_synthetic_{setting}", truth, sizes, noise, client_seqs, dtype)


def matrix_completion(
    num_clients: int = 30,
    samples: int = 128,
    test_samples: int = 128,
    side: int = 32,
    ones: int = 4,
    spike: float = 0.25,
    noise: float = 1.0,
    seed: int = 0,
    dtype: str = "float64",
    standardize: bool = False,
) -> TensorData:
    """pFedFBE's federated matrix completion (matrix sensing) data: rank-5 diagonal truths, one per client.

    Args:
        num_clients: generated clients ``N`` (30).
        samples: training rows (observations) per client (128).
        test_samples: held-out rows per client from its own distribution, the test split (128; not in the paper).
        side: the matrices are ``side x side`` (32: 1024 parameters).
        ones: leading diagonal entries equal to 1 (4).
        spike: the value of the one further diagonal entry, at an index drawn per client from ``ones..side-1``
            (0.25); the truth has rank ``ones + 1`` (5).
        noise: the std :math:`\\sigma` of the target noise (1).
        seed: seed of everything (``data.split_seed``).
        dtype: ``float64`` or ``float32``, of the stored inputs, targets and truth.
        standardize: unused (the inputs are the model's: z-scoring them would change :math:`W^\\star`).

    Returns:
        Inputs ``(N * samples, side, side)``, targets ``(N * samples,)``, the group of a row = its client, ``truth``
        ``(N, side, side)``.

    Raises:
        ConfigError: a size that is not a positive integer, ``ones`` that leaves no room for the spike.
    """
    n, side = _count("num_clients", num_clients), _count("side", side, low=2)
    ones = _count("ones", ones, low=0, high=side - 1)
    truth_seq, *client_seqs = np.random.SeedSequence(seed).spawn(n + 1)
    diag = np.zeros((n, side))
    diag[:, :ones] = 1.0
    diag[np.arange(n), np.random.default_rng(truth_seq).integers(ones, side, size=n)] = float(spike)
    truth = np.stack([np.diag(row) for row in diag])  # (N, side, side)
    sizes = _count("samples", samples), _count("test_samples", test_samples)
    return _generate("matrix_completion", truth, sizes, noise, client_seqs, dtype)


def client_truth(data: TensorData, client_rows: Sequence[Tensor]) -> Tensor:
    """Each partition client's ground truth: that of the generated client (group) its training rows come from.

    Args:
        data: generated data with ``truth`` and ``groups_train`` (``dm.data``).
        client_rows: each client's training row ids (``dm.client_train``).

    Returns:
        ``(num_clients, *weight_shape)``; with ``partition=by_group`` and one client per group, ``data.truth``.

    Raises:
        ConfigError: the data have no truth, or a client holds rows of groups with different truths (a partition
            that mixes the generated clients of Lasso setting II or matrix completion: use ``partition=by_group``).
    """
    if data.truth is None or data.groups_train is None:
        raise bad_value("data", data.name, "has no ground truth (generated data: lasso_synthetic, matrix_completion)")
    out = []
    for c, rows in enumerate(client_rows):
        truths = data.truth[data.groups_train[rows].unique()]
        if not (truths == truths[0]).all():
            why = f"client {c} holds rows of {len(truths)} generated clients with different ground truths"
            raise ConfigError(f"partition: {why}; use partition=by_group")
        out.append(truths[0])
    return torch.stack(out)
