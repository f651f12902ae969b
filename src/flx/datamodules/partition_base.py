"""The partitioner base class and its result, :class:`ClientSplit` (the schemes are in
:mod:`flx.datamodules.partitioners` and :mod:`flx.datamodules.few_shot`)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from flx.datamodules.partition_ops import as_labels, check_is_partition, integer, real
from flx.datamodules.ragged import Ragged, as_ragged
from flx.errors import bad_value

NOISE_STREAM = 0x6E6F697365
"""Mixed into the seed of :class:`FeatureNoise`, so the noise is a stream of its own (not the partition's draws)."""


@dataclass(frozen=True)
class FeatureNoise:
    """Per-client additive Gaussian feature noise (:class:`~flx.datamodules.niid_bench.NoiseFeature`): the client the
    partitioner numbered ``c`` gets ``N(0, std[c]^2)`` per input entry, drawn from
    ``np.random.default_rng((NOISE_STREAM, seed, c))``. ``order``: the partitioner's number of each client after the
    clients were reordered (:func:`hold_out`), None: as partitioned; a client keeps its noise wherever it moves."""

    std: np.ndarray
    seed: int
    order: np.ndarray | None = None

    def draw(self, client: int, shape: tuple[int, ...]) -> np.ndarray:
        """Client ``client``'s noise for ``shape`` (rows first, in ascending row order), float64."""
        c = int(self.order[client]) if self.order is not None else client
        rng = np.random.default_rng((NOISE_STREAM, self.seed, c))
        return rng.standard_normal(shape) * self.std[c]


@dataclass(frozen=True)
class ClientSplit:
    """The result of a partitioner.

    Each per-client field is a :class:`~flx.datamodules.ragged.Ragged`: all clients' rows in one flat int64 array plus
    offsets (8 bytes per client), read like a list of arrays (``split.train[c]`` is client ``c``'s rows, a view;
    ``len(split.train)``; iteration). Lists of arrays passed in are converted.

    Attributes:
        train: one sorted int64 index array per client.
        test: one sorted int64 index array per client (empty when ``test_fraction == 0``), disjoint from ``train``.
        support: optional, one sorted int64 index array per client, a subset of its ``train`` rows: the support set of
            a few-shot client (meta-learning adapts on it; the rest of ``train`` is the query set). ``None``: no
            support/query split.
        num_heldout: the last ``num_heldout`` clients never train (no round samples them): the unseen clients
            (``partition.unseen_clients``; few_shot's held-out clients). They are evaluation clients: their ``train``
            rows are the rows a personalised model may adapt on (their support set) and their ``test`` rows the rows it
            is measured on (their query set); the global model is measured on both (``unseen/*``).
        noise: optional per-client feature noise (NIID-Bench's noise-based feature skew,
            :class:`~flx.datamodules.niid_bench.NoiseFeature`), added to each client's rows when the data are built
            (:func:`~flx.datamodules.niid_bench.with_feature_noise`); ``None``: the inputs as loaded.
    """

    train: Ragged[np.ndarray]
    test: Ragged[np.ndarray]
    support: Ragged[np.ndarray] | None = None
    num_heldout: int = 0
    noise: FeatureNoise | None = None

    def __post_init__(self) -> None:
        for name in ("train", "test", "support"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, as_ragged(value))

    @property
    def num_clients(self) -> int:
        """Number of clients (training and held-out)."""
        return len(self.train)

    @property
    def num_train_clients(self) -> int:
        """The clients that train: the first ``num_clients - num_heldout``."""
        return len(self.train) - self.num_heldout


class Partitioner:
    """Base class: validation, seeding, sorting and the per-client test split.

    Subclasses implement :meth:`assign` and, if they have parameters of their own, extend :meth:`_check_params`.

    Args:
        num_clients: number of clients, ``>= 1`` and at most the number of training samples.
        test_fraction: fraction of each client's samples held out as its personal test set, in ``[0, 1)``. Every
            client keeps at least one training sample.
        min_size: every client gets at least this many samples (train + test), ``>= 1``.
        seed: the partition seed (``partition.seed``): fixed, so the partition does not change with the run's seed;
            ``None`` uses the seed the partitioner is called with (the run's ``seed``).
        unseen_clients: clients kept out of training (:func:`unseen_ids`), evaluated as ``unseen/*``: an integer
            ``>= 1`` is that many clients, a float in ``(0, 1)`` that fraction of ``num_clients`` (rounded half up);
            ``None`` or 0: none. They become the last client ids (:func:`hold_out`).
    """

    name = "partitioner"
    uses_labels = True
    """Whether :meth:`assign` splits by the class labels (False: it only needs their number, or the groups)."""

    def __init__(
        self,
        num_clients: int,
        test_fraction: float = 0.0,
        min_size: int = 1,
        seed: int | None = None,
        unseen_clients: int | float | None = None,
    ):
        self.num_clients = num_clients
        self.test_fraction = test_fraction
        self.min_size = min_size
        self.seed = seed
        self.unseen_clients = unseen_clients
        self._check_params()

    @property
    def num_unseen(self) -> int:
        """The clients kept out of training: ``partition.unseen_clients`` as a count."""
        u = self.unseen_clients
        return int(u or 0) if isinstance(u, int) or not u else math.floor(u * self.num_clients + 0.5)

    @property
    def num_train_clients(self) -> int:
        """The clients that train: ``num_clients`` less the unseen ones."""
        return self.num_clients - self.num_unseen

    def __repr__(self) -> str:
        fields = {"num_clients": self.num_clients, **vars(self)}
        params = ", ".join(f"{key}={value!r}" for key, value in fields.items())
        return f"{type(self).__name__}({params})"

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray] | list[np.ndarray]:
        """Splits the sample indices ``0..N-1`` over the clients.

        Args:
            labels: 1-D integer labels, length ``N``.
            rng: the generator to draw from.

        Returns:
            ``num_clients`` index arrays that together hold every index exactly once (any order): a
            :class:`~flx.datamodules.ragged.Ragged` (the built-in schemes: no object per client) or a list of arrays.
        """
        raise NotImplementedError

    def keys(self, labels: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
        """The 1-D integer array that :meth:`assign` splits by: the labels (:class:`ByGroup`: the groups)."""
        return labels

    def __call__(self, labels: np.ndarray, seed: int, groups: np.ndarray | None = None) -> ClientSplit:
        """Partitions ``labels`` over the clients.

        Args:
            labels: 1-D integer array of training labels.
            seed: seed for ``np.random.default_rng`` unless the partitioner has its own ``seed``; the same seed gives
                the same split.
            groups: optional 1-D integer group id per training sample (ignored unless the scheme splits by group).

        Returns:
            The per-client train (and test) indices.

        Raises:
            ConfigError: a parameter is invalid or cannot be satisfied by these labels.
        """
        labels = as_labels(labels)
        self._check_params()
        self._check_fits(len(labels))
        rng = np.random.default_rng(seed if self.seed is None else self.seed)
        keys = self.keys(labels, groups)
        parts = as_ragged(self.assign(keys, rng))
        check_is_partition(parts, len(labels), self.num_clients, type(self).__name__)
        parts = parts.sorted()
        self._check_min_size(parts.sizes())
        return self._hold_out(self._split_test(parts, rng), seed)

    def _hold_out(self, split: ClientSplit, seed: int) -> ClientSplit:
        """``split`` with its unseen clients (:func:`unseen_ids` of the partition seed) moved to the end."""
        if not self.num_unseen:
            return split
        return hold_out(split, unseen_ids(self.num_clients, self.num_unseen, seed if self.seed is None else self.seed))

    def _check_params(self) -> None:
        """Validates the parameters that do not depend on the data."""
        self.num_clients = integer("partition.num_clients", self.num_clients, low=1)
        self.min_size = integer("partition.min_size", self.min_size, low=1)
        self.test_fraction = real("partition.test_fraction", self.test_fraction, "must be a number in [0, 1)")
        if not 0.0 <= self.test_fraction < 1.0:
            raise bad_value("partition.test_fraction", self.test_fraction, "must be in [0, 1)")
        if self.seed is not None:
            self.seed = integer("partition.seed", self.seed, low=0)
        self._check_unseen()

    def _check_unseen(self) -> None:
        """``unseen_clients``: None, 0, an integer in ``[1, num_clients)`` or a fraction in ``(0, 1)`` that leaves a
        client on each side."""
        u, key, n = self.unseen_clients, "partition.unseen_clients", self.num_clients
        allowed = f"an integer in [0, {n}) (a count) or a number in (0, 1) (a fraction of the {n} clients); null: none"
        if u is None:
            return
        if isinstance(u, bool) or not isinstance(u, numbers.Real) or not math.isfinite(u):
            raise bad_value(key, u, f"must be {allowed}")
        if isinstance(u, numbers.Integral) or float(u) == 0.0:
            self.unseen_clients = u = integer(key, u, low=0) if isinstance(u, numbers.Integral) else 0
        elif not 0 < u < 1:
            raise bad_value(key, u, f"must be {allowed}")
        if not u:
            return
        if self.num_unseen >= n:
            raise bad_value(key, u, f"keeps {self.num_unseen} of the {n} clients out of training: none would train")
        if not self.num_unseen:
            raise bad_value(key, u, f"is 0 of the {n} clients (rounded); use a larger fraction or a count")

    def _check_fits(self, num_samples: int) -> None:
        """Validates ``num_clients`` and ``min_size`` against the number of training samples."""
        if self.num_clients > num_samples:
            raise bad_value(
                "partition.num_clients", self.num_clients, f"more clients than training samples ({num_samples})"
            )
        needed = self.num_clients * self.min_size
        if needed > num_samples:
            raise bad_value(
                "partition.min_size",
                self.min_size,
                f"partition.num_clients={self.num_clients} clients need {needed} samples "
                f"but there are only {num_samples} training samples",
            )

    def _check_min_size(self, sizes: np.ndarray) -> None:
        """Raises if ``assign`` left a client with fewer than ``min_size`` samples (``sizes``: each client's)."""
        if sizes.min() < self.min_size:
            client = int(sizes.argmin())
            raise bad_value(
                "partition.min_size",
                self.min_size,
                f"the {self.name} partition gave client {client} only {sizes[client]} samples; "
                "lower partition.min_size or partition.num_clients",
            )

    def _split_test(self, parts: Ragged[np.ndarray], rng: np.random.Generator) -> ClientSplit:
        """Moves a random ``test_fraction`` of each client's samples (rounded, >= 1 kept) into its test set.

        The draws are one ``rng.permutation`` per client, in client order (what fixes the split for a seed); the rows
        go straight into the flat train and test arrays."""
        if self.test_fraction == 0.0:
            return ClientSplit(train=parts, test=Ragged.empty(len(parts)))
        sizes = parts.sizes()
        # float64 like Python's floor(len * f + 0.5): the same counts as the per-client formula
        num_test = np.minimum(np.floor(sizes * self.test_fraction + 0.5).astype(np.int64), sizes - 1)
        train = Ragged.from_sizes(np.empty(int((sizes - num_test).sum()), np.int64), sizes - num_test)
        test = Ragged.from_sizes(np.empty(int(num_test.sum()), np.int64), num_test)
        for c, (part, k) in enumerate(zip(parts, num_test.tolist())):
            shuffled = rng.permutation(part)
            test[c][:] = shuffled[:k]
            train[c][:] = shuffled[k:]
        return ClientSplit(train=train.sorted(), test=test.sorted())


UNSEEN_STREAM = 0x756E  # the unseen clients' generator: its own stream of the partition seed, not the partition's


def unseen_ids(num_clients: int, k: int, seed: int) -> np.ndarray:
    """The ``k`` clients kept out of training, ascending: the first ``k`` of
    ``np.random.default_rng([seed, UNSEEN_STREAM]).permutation(num_clients)``, ``seed`` the partition seed. A stream
    of its own: the clients' rows are the same with and without unseen clients, and a larger ``k`` keeps the same
    clients out and more."""
    return np.sort(np.random.default_rng([seed, UNSEEN_STREAM]).permutation(num_clients)[:k])


def _take(arrays: Ragged[np.ndarray], order: np.ndarray) -> Ragged[np.ndarray]:
    """The arrays ``order[0], order[1], ...`` of ``arrays``, in one gather."""
    sizes, starts = arrays.sizes()[order], arrays.offsets[:-1][order]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    at = np.arange(offsets[-1]) + np.repeat(starts - offsets[:-1], sizes)
    return Ragged.from_sizes(arrays.values[at], sizes)


def hold_out(split: ClientSplit, unseen: np.ndarray) -> ClientSplit:
    """``split`` (no held-out clients yet) with the clients ``unseen`` moved last, as its held-out clients
    (``num_heldout``): the clients that train keep their order and are numbered ``0..T-1``, the unseen ones follow in
    ascending order of their old ids."""
    n = split.num_clients
    order = np.concatenate([np.setdiff1d(np.arange(n), unseen), np.asarray(unseen, dtype=np.int64)])
    support = None if split.support is None else _take(split.support, order)
    noise = split.noise
    if noise is not None:  # each client keeps its own noise
        noise = FeatureNoise(noise.std, noise.seed, order if noise.order is None else noise.order[order])
    return ClientSplit(_take(split.train, order), _take(split.test, order), support, len(unseen), noise)
