"""The partitioner base class and its result, :class:`ClientSplit` (the schemes are in
:mod:`flx.datamodules.partitioners` and :mod:`flx.datamodules.few_shot`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flx.datamodules.partition_ops import as_labels, check_is_partition, integer, real
from flx.datamodules.ragged import Ragged, as_ragged
from flx.errors import bad_value

NOISE_STREAM = 0x6E6F697365
"""Mixed into the seed of :class:`FeatureNoise`, so the noise is a stream of its own (not the partition's draws)."""


@dataclass(frozen=True)
class FeatureNoise:
    """Per-client additive Gaussian feature noise (:class:`~flx.datamodules.niid_bench.NoiseFeature`): client ``c``'s
    rows get ``N(0, std[c]^2)`` per input entry, drawn from ``np.random.default_rng((NOISE_STREAM, seed, c))``."""

    std: np.ndarray
    seed: int

    def draw(self, client: int, shape: tuple[int, ...]) -> np.ndarray:
        """Client ``client``'s noise for ``shape`` (rows first, in ascending row order), float64."""
        rng = np.random.default_rng((NOISE_STREAM, self.seed, client))
        return rng.standard_normal(shape) * self.std[client]


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
        num_heldout: the last ``num_heldout`` clients never train (no round samples them); they are evaluation
            clients: their ``train`` rows are the rows a personalised model may adapt on (their support set) and their
            ``test`` rows the rows it is measured on (their query set).
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
    """

    name = "partitioner"
    uses_labels = True
    """Whether :meth:`assign` splits by the class labels (False: it only needs their number, or the groups)."""

    def __init__(self, num_clients: int, test_fraction: float = 0.0, min_size: int = 1, seed: int | None = None):
        self.num_clients = num_clients
        self.test_fraction = test_fraction
        self.min_size = min_size
        self.seed = seed
        self._check_params()

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
        return self._split_test(parts, rng)

    def _check_params(self) -> None:
        """Validates the parameters that do not depend on the data."""
        self.num_clients = integer("partition.num_clients", self.num_clients, low=1)
        self.min_size = integer("partition.min_size", self.min_size, low=1)
        self.test_fraction = real("partition.test_fraction", self.test_fraction, "must be a number in [0, 1)")
        if not 0.0 <= self.test_fraction < 1.0:
            raise bad_value("partition.test_fraction", self.test_fraction, "must be in [0, 1)")
        if self.seed is not None:
            self.seed = integer("partition.seed", self.seed, low=0)

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
