"""NIID-Bench's non-IID partitions: label-quantity skew ``#C=k``, quantity skew, noise-based feature skew.

Li, Diao, Chen, He, "Federated Learning on Non-IID Data Silos: An Experimental Study", ICDE 2022 (arXiv:2102.02079),
Section III ("Simulating Non-IID Data Setting"). Distribution-based label skew, :math:`p_k \\sim Dir_N(\\beta)` per
class, is :class:`flx.datamodules.partitioners.Dirichlet` (``partition=dirichlet``, or the preset
``partition=niid_dirichlet``); the synthetic-feature-skew task FCUBE is a data config (:mod:`flx.datamodules.fcube`).

* :class:`LabelQuantity` (``partition=label_quantity``, the paper's ``#C=k``): each party owns ``k`` distinct labels;
  each label's samples are shuffled and divided equally (``np.array_split`` sizes, larger first) among its owners in
  client order. The label sets are the authors' rule (their ``partition_data``): client ``c``'s first label is
  ``c mod C``, so with ``num_clients >= C`` every label is owned, and its other ``k - 1`` labels are drawn uniformly
  without replacement from the remaining ``C - 1``. :class:`~flx.datamodules.partitioners.Shards` also gives ``k``
  labels per client, but balances how many clients own each label (least-owned first); here the owner counts are
  random, as in NIID-Bench.
* :class:`NiidQuantity` (``partition=niid_quantity``): labels IID, sizes from :math:`q \\sim Dir_N(\\beta)`; the
  authors redraw ``q`` until every party gets ``min_size`` samples (their 10) and cut a random permutation at
  ``floor(cumsum(q) n)``. :class:`~flx.datamodules.partitioners.QuantitySkew` draws once and gives every client
  ``min_size`` plus a ``q`` share of the rest instead.
* :class:`NoiseFeature` (``partition=noise_feature``): an IID split into near-equal parts, then party ``P_i``'s
  features get :math:`\\hat x \\sim Gau(\\sigma\\, i / N)` (mean 0, variance :math:`\\sigma i/N`, ``i = 1..N``; flx's
  client ``c`` is ``P_{c+1}``). ``rule=code`` uses the authors' code instead: standard deviation
  :math:`\\sigma\\, c/(N-1)` (client 0 clean). The noise is drawn once, when the data are built, from the partition
  seed (the code redraws it at every load); it is added to every row a client holds (its training rows and its own
  held-out rows, ``test_fraction``, as the code adds it to a party's local test loader); the validation, test and
  server rows stay clean (the code's global test set is clean).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from flx.datamodules.partition_base import ClientSplit, FeatureNoise, Partitioner
from flx.datamodules.partition_ops import group_by_class, integer, parts_from_owners, positive, real
from flx.datamodules.ragged import Ragged, chunk_sizes
from flx.errors import bad_value

if TYPE_CHECKING:
    from torch import Tensor

DIRICHLET_MAX_TRIES = 1000
"""How many Dirichlet draws :class:`NiidQuantity` makes before giving up on ``min_size``."""
NOISE_RULES = ("paper", "code")


def with_feature_noise(x: Tensor, split: ClientSplit) -> Tensor:
    """``x`` (the training store) with each client's noise added to its rows (train and held-out, ascending row
    order); a copy, the other rows unchanged. ``x`` itself when the split has no noise. (torch is imported here, not
    at the top: the partition code stays torch-free for the pre-run check.)"""
    import torch

    if split.noise is None:
        return x
    if not x.is_floating_point():
        raise bad_value("partition", NoiseFeature.name, "adds Gaussian noise to the inputs; these are token ids")
    out = x.clone()
    for c, (train, test) in enumerate(zip(split.train, split.test)):
        rows = torch.from_numpy(np.sort(np.concatenate([train, test])))
        noise = split.noise.draw(c, (len(rows), *x.shape[1:]))
        out[rows] += torch.from_numpy(noise).to(x.dtype)
    return out


class LabelQuantity(Partitioner):
    """NIID-Bench's ``#C=k``: client ``c`` owns label ``c mod C`` and ``k - 1`` others drawn at random; each label's
    shuffled samples are cut into equal parts (``np.array_split``) for its owners, in client order.

    Args:
        num_clients: number of clients, at least the number of classes ``C`` (every label must be owned).
        classes_per_client: ``k``, distinct labels per client, ``1..C``.
        test_fraction: see :class:`Partitioner`.
        min_size: see :class:`Partitioner`.
    """

    name = "label_quantity"

    def __init__(
        self,
        num_clients: int,
        classes_per_client: int = 2,
        *,
        test_fraction: float = 0.0,
        min_size: int = 1,
        seed: int | None = None,
        unseen_clients: int | float | None = None,
    ) -> None:
        self.classes_per_client = classes_per_client
        super().__init__(num_clients, test_fraction, min_size, seed, unseen_clients)

    def _check_params(self) -> None:
        super()._check_params()
        self.classes_per_client = integer("partition.classes_per_client", self.classes_per_client, low=1)

    def label_sets(self, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        """The ``(num_clients, k)`` label ids (positions among the classes present) each client owns."""
        k = self.classes_per_client
        if k > num_classes:
            why = f"must be <= the number of classes present ({num_classes})"
            raise bad_value("partition.classes_per_client", k, why)
        if self.num_clients < num_classes:
            why = f"label_quantity gives client c label c mod C first, so all {num_classes} labels are owned only with"
            raise bad_value("partition.num_clients", self.num_clients, f"{why} at least {num_classes} clients")
        sets = np.empty((self.num_clients, k), dtype=np.int64)
        for c in range(self.num_clients):
            first = c % num_classes
            others = np.delete(np.arange(num_classes), first)
            sets[c] = [first, *rng.choice(others, size=k - 1, replace=False).tolist()]
        return sets

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """Draws the label sets, then deals each label's shuffled samples out in ``np.array_split`` chunks."""
        by_class = group_by_class(labels, rng)
        sets = self.label_sets(len(by_class.counts), rng)
        owners = np.empty(len(labels), dtype=np.int64)
        for cls, (start, count) in enumerate(zip(by_class.starts.tolist(), by_class.counts.tolist())):
            holders = np.flatnonzero((sets == cls).any(axis=1))  # ascending client order
            if count < len(holders):
                why = f"class {by_class.values[cls]} has {count} samples but {len(holders)} clients own it"
                raise bad_value("partition.num_clients", self.num_clients, f"{why}; use fewer clients")
            owners[start : start + count] = np.repeat(holders, chunk_sizes(count, len(holders)))
        return parts_from_owners(by_class.order, owners, self.num_clients)


class NiidQuantity(Partitioner):
    """NIID-Bench's quantity skew: ``q ~ Dir_N(alpha)`` (the paper's beta), redrawn until every client's share
    ``q_j n`` is at least ``min_size``; a random permutation cut at ``floor(cumsum(q) n)``. Labels are IID.

    Args:
        num_clients: number of clients.
        alpha: the Dirichlet concentration (the paper's beta), ``> 0``.
        test_fraction: see :class:`Partitioner`.
        min_size: see :class:`Partitioner` (the authors' code: 10).
    """

    name = "niid_quantity"
    uses_labels = False

    def __init__(
        self,
        num_clients: int,
        alpha: float = 0.5,
        *,
        test_fraction: float = 0.0,
        min_size: int = 1,
        seed: int | None = None,
        unseen_clients: int | float | None = None,
    ) -> None:
        self.alpha = alpha
        super().__init__(num_clients, test_fraction, min_size, seed, unseen_clients)

    def _check_params(self) -> None:
        super()._check_params()
        self.alpha = positive("partition.alpha", self.alpha)

    def draw_sizes(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """The client sizes: the first Dirichlet draw whose every share ``q_j n`` is ``>= min_size``."""
        for _ in range(DIRICHLET_MAX_TRIES):
            q = rng.dirichlet(np.full(self.num_clients, self.alpha))
            if (q * n).min() >= self.min_size:
                edges = np.minimum(np.floor(np.cumsum(q) * n).astype(np.int64), n)
                edges[-1] = n
                return np.diff(edges, prepend=0)
        why = f"{DIRICHLET_MAX_TRIES} Dirichlet draws never gave all {self.num_clients} clients"
        raise bad_value("partition.alpha", self.alpha, f"{why} partition.min_size={self.min_size} samples")

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """Draws the sizes, then cuts a random permutation of the rows at them."""
        sizes = self.draw_sizes(len(labels), rng)
        return Ragged.from_sizes(rng.permutation(len(labels)), sizes)


class NoiseFeature(Partitioner):
    """NIID-Bench's noise-based feature skew: an IID split (near-equal sizes), each client's inputs plus Gaussian
    noise of its own level (:func:`noise_std`), added when the data are built (:func:`with_feature_noise`).

    Args:
        num_clients: number of clients ``N``.
        noise: the noise level ``sigma >= 0`` (the paper's experiments: 0.1).
        rule: ``paper``: client ``c`` gets variance ``sigma (c + 1) / N``; ``code``: the authors' code, standard
            deviation ``sigma c / (N - 1)``.
        test_fraction: see :class:`Partitioner`.
        min_size: see :class:`Partitioner`.
    """

    name = "noise_feature"
    uses_labels = False

    def __init__(
        self,
        num_clients: int,
        noise: float = 0.1,
        rule: str = "paper",
        *,
        test_fraction: float = 0.0,
        min_size: int = 1,
        seed: int | None = None,
        unseen_clients: int | float | None = None,
    ) -> None:
        self.noise, self.rule = noise, rule
        super().__init__(num_clients, test_fraction, min_size, seed, unseen_clients)

    def _check_params(self) -> None:
        super()._check_params()
        self.noise = real("partition.noise", self.noise, "must be a finite number >= 0 (the noise level sigma)")
        if self.noise < 0:
            raise bad_value("partition.noise", self.noise, "must be >= 0 (the noise level sigma)")
        if not isinstance(self.rule, str) or self.rule not in NOISE_RULES:
            raise bad_value("partition.rule", self.rule, f"allowed: {', '.join(NOISE_RULES)}")

    def noise_std(self) -> np.ndarray:
        """Each client's noise standard deviation under ``rule``."""
        c, n = np.arange(self.num_clients), self.num_clients
        if self.rule == "paper":
            return np.sqrt(self.noise * (c + 1) / n)
        return self.noise * c / max(n - 1, 1)

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """The IID split: a random permutation dealt out in ``np.array_split``'s near-equal chunks."""
        return Ragged.from_sizes(rng.permutation(len(labels)), chunk_sizes(len(labels), self.num_clients))

    def _hold_out(self, split: ClientSplit, seed: int) -> ClientSplit:
        """The IID split, carrying each client's noise (drawn from the partition seed), which stays with its client
        when the unseen clients move last."""
        noise = FeatureNoise(std=self.noise_std(), seed=seed if self.seed is None else self.seed)
        return super()._hold_out(dataclasses.replace(split, noise=noise), seed)
