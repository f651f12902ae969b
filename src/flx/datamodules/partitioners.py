"""Partitioners: split a dataset's training labels over federated clients.

A partitioner sees the 1-D integer array of TRAIN labels (and, for datasets that have them, the per-sample TRAIN
groups, e.g. Adult's sex or a LEAF user) and returns, per client, sorted int64 index arrays into that array (a
:class:`ClientSplit`). Every sample lands in exactly one client; with ``test_fraction > 0`` each
client's own samples are further split into a personal train and test part.

Each partitioner is a small class whose constructor kwargs are the config keys under ``partition.``, so it can be
built by Hydra, e.g. ``{_target_: flx.datamodules.partitioners.Dirichlet, num_clients: 100, alpha: 0.3}``, and is
then called as ``split = partitioner(labels, seed)`` or ``partitioner(labels, seed, groups=groups)``; only
:class:`ByGroup` uses the groups, the others ignore them. Bad values raise :class:`flx.errors.ConfigError`.

"Classes" always means the distinct label values present in ``labels`` (they need not be ``0..C-1``). Real-valued
targets (regression, ``data=diabetes``) and token targets (a masked language model, ``data=wikitext2``) have no classes:
only the schemes that ignore the labels (``uses_labels = False``: iid, quantity_skew, by_group, from_file, and
NIID-Bench's niid_quantity and noise_feature) can split them, called with placeholder labels by the datamodule; the
others stop with one line (:func:`needs_labels`). NIID-Bench's partitions are in :mod:`flx.datamodules.niid_bench`.
"""

from __future__ import annotations

import numpy as np

from flx.datamodules.few_shot import FewShot
from flx.datamodules.niid_bench import LabelQuantity, NiidQuantity, NoiseFeature
from flx.datamodules.partition_base import ClientSplit, Partitioner, hold_out
from flx.datamodules.partition_file import check_covers, read_partition
from flx.datamodules.partition_ops import (
    as_labels,
    balanced_class_choice,
    counts_from_proportions,
    group_by_class,
    integer,
    parts_from_owners,
    positive,
    split_among_holders,
)
from flx.datamodules.ragged import Ragged, chunk_of, chunk_sizes
from flx.errors import ConfigError, bad_value

DIRICHLET_MAX_TRIES = 1000
"""How many Dirichlet draws :class:`Dirichlet` makes before giving up on ``min_size``."""


__all__ = ["PARTITIONERS", "REAL_TARGETS", "TOKEN_TARGETS", "ClientSplit", "Partitioner", "needs_labels"]

REAL_TARGETS = "real-valued targets (regression)"
TOKEN_TARGETS = "token targets (a masked language model)"


class IID(Partitioner):
    """Uniformly random split into clients whose sizes differ by at most one."""

    name = "iid"
    uses_labels = False

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """Deals a random permutation out in ``num_clients`` near-equal chunks (``np.array_split``'s)."""
        return Ragged.from_sizes(rng.permutation(len(labels)), chunk_sizes(len(labels), self.num_clients))


class Stratified(Partitioner):
    """Every class is shuffled and cut into ``num_clients`` near-equal contiguous shards, one per client.

    All clients then share the global class ratio (per-class counts differ by at most one): the partition of
    FeDXL's experiments, where heterogeneity comes from per-client input noise instead.
    """

    name = "stratified"

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """Client ``c`` gets the ``c``-th of ``np.array_split``'s chunks of every class's shuffled samples."""
        by_class = group_by_class(labels, rng)
        cls = by_class.class_of_position
        rank = np.arange(len(cls)) - by_class.starts[cls]  # position within its class
        owners = np.empty(len(cls), dtype=np.int64)
        for start, count in zip(by_class.starts.tolist(), by_class.counts.tolist()):
            owners[start : start + count] = chunk_of(rank[start : start + count], count, self.num_clients)
        return parts_from_owners(by_class.order, owners, self.num_clients)


class _AlphaPartitioner(Partitioner):
    """A partitioner with a Dirichlet concentration ``alpha > 0`` (``partition.alpha``)."""

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


class Dirichlet(_AlphaPartitioner):
    """Label skew: each class is spread over the clients with proportions drawn from ``Dir(alpha * 1)``.

    Small ``alpha`` gives clients dominated by few classes; large ``alpha`` approaches IID. The proportions are
    redrawn (up to :data:`DIRICHLET_MAX_TRIES` times) until every client has at least ``min_size`` samples.

    Args:
        num_clients: number of clients.
        alpha: Dirichlet concentration, ``> 0``.
        test_fraction: see :class:`Partitioner`.
        min_size: see :class:`Partitioner`.
    """

    name = "dirichlet"

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """Draws a class-by-client count matrix, then deals each class's shuffled samples by it."""
        by_class = group_by_class(labels, rng)
        counts = self._draw_counts(by_class.counts, rng)
        owners = np.repeat(np.tile(np.arange(self.num_clients), len(by_class.counts)), counts.ravel())
        return parts_from_owners(by_class.order, owners, self.num_clients)

    def _draw_counts(self, class_counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Returns a ``(classes, clients)`` count matrix whose column sums are all ``>= min_size``."""
        concentration = np.full(self.num_clients, self.alpha)
        for _ in range(DIRICHLET_MAX_TRIES):
            proportions = rng.dirichlet(concentration, size=len(class_counts))
            counts = counts_from_proportions(proportions, class_counts)
            if counts.sum(axis=0).min() >= self.min_size:
                return counts
        raise bad_value(
            "partition.alpha",
            self.alpha,
            f"{DIRICHLET_MAX_TRIES} Dirichlet draws never gave all partition.num_clients={self.num_clients} clients "
            f"at least partition.min_size={self.min_size} samples; use a larger alpha or fewer clients",
        )


class Shards(Partitioner):
    """Each client holds exactly ``classes_per_client`` distinct classes.

    Classes are handed out so that the number of clients holding each class differs by at most one, which uses every
    class; each class's samples are then split evenly among the clients holding it, so every sample goes to exactly
    one client. Needs ``num_clients * classes_per_client >= C`` (else some class would be left out) and every class to
    have at least as many samples as clients holding it.

    Args:
        num_clients: number of clients.
        classes_per_client: distinct classes per client, between 1 and the number of classes present.
        test_fraction: see :class:`Partitioner`.
        min_size: see :class:`Partitioner`.
    """

    name = "shards"

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

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """Picks each client's classes (least-used first, ties at random), then splits each class evenly."""
        by_class = group_by_class(labels, rng)
        num_classes = len(by_class.counts)
        if self.classes_per_client > num_classes:
            raise bad_value(
                "partition.classes_per_client",
                self.classes_per_client,
                f"must be <= the number of classes present ({num_classes})",
            )
        if self.num_clients * self.classes_per_client < num_classes:
            raise bad_value(
                "partition.num_clients",
                self.num_clients,
                f"with partition.classes_per_client={self.classes_per_client} the clients can hold at most "
                f"{self.num_clients * self.classes_per_client} of the {num_classes} classes present, "
                "so some samples would be unassigned; need num_clients * classes_per_client >= number of classes",
            )
        chosen = balanced_class_choice(num_classes, self.num_clients, self.classes_per_client, rng)
        clients = np.repeat(np.arange(self.num_clients), self.classes_per_client)
        hint = "use fewer clients or a smaller partition.classes_per_client"
        return split_among_holders(by_class, clients, chosen.ravel(), self.num_clients, hint)


class OneClass(Partitioner):
    """Each client holds exactly one class: client ``c`` gets the ``c % C``-th class (ascending label order).

    A class shared by several clients is split evenly among them. Needs ``num_clients >= C`` so that no sample is
    left unassigned.
    """

    name = "one_class"

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """Assigns classes round-robin and splits each class evenly among its clients."""
        by_class = group_by_class(labels, rng)
        num_classes = len(by_class.counts)
        if self.num_clients < num_classes:
            raise bad_value(
                "partition.num_clients",
                self.num_clients,
                f"one_class needs at least one client per class ({num_classes} classes present), "
                "otherwise some samples would be unassigned",
            )
        clients = np.arange(self.num_clients)
        return split_among_holders(by_class, clients, clients % num_classes, self.num_clients, "use fewer clients")


class QuantitySkew(_AlphaPartitioner):
    """Size skew: labels are IID but client sizes follow ``Dir(alpha * 1)`` proportions (each at least ``min_size``).

    Args:
        num_clients: number of clients.
        alpha: Dirichlet concentration of the size proportions, ``> 0``; small means very unequal sizes.
        test_fraction: see :class:`Partitioner`.
        min_size: see :class:`Partitioner`.
    """

    name = "quantity_skew"
    uses_labels = False

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """Gives each client ``min_size`` samples plus a Dirichlet share of the rest, from a random permutation."""
        spare = np.array([len(labels) - self.num_clients * self.min_size])
        proportions = rng.dirichlet(np.full(self.num_clients, self.alpha))[None, :]
        sizes = self.min_size + counts_from_proportions(proportions, spare)[0]
        return Ragged.from_sizes(rng.permutation(len(labels)), sizes)


class ByGroup(Partitioner):
    """Split by sample group: each group's samples go, contiguously in dataset order, to clients of their own.

    The groups are a per-sample attribute of the dataset (``TensorData.groups_train``): a sensitive attribute
    (``data=adult``: sex or race) or the LEAF user (``data=shakespeare``). With ``G`` groups present and
    ``k = num_clients / G``, client ``c`` holds group ``c // k`` (groups in ascending id order) and the ``(c mod k)``-th
    of ``k`` contiguous, near-equal chunks (sizes differ by at most one, larger first) of that group's samples taken in
    dataset order: the Adult split of the DRFA authors' code (FedTorch; sex gives 5 clients per group with 10 clients,
    race 2). Nothing is random but the ``test_fraction`` hold-out.

    Args:
        num_clients: number of clients, a multiple of the number of groups present.
        test_fraction: see :class:`Partitioner`.
        min_size: see :class:`Partitioner`.
    """

    name = "by_group"
    uses_labels = False

    def keys(self, labels: np.ndarray, groups: np.ndarray | None) -> np.ndarray:
        """Returns the validated groups; a dataset without groups cannot be split by group."""
        if groups is None:
            why = "needs a dataset with sample groups (data=adult, data=shakespeare); this dataset has none"
            raise bad_value("partition", self.name, why)
        groups = as_labels(groups)
        if len(groups) != len(labels):
            raise ValueError(f"groups has {len(groups)} entries but there are {len(labels)} labels")
        return groups

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> Ragged[np.ndarray]:
        """Cuts each group's indices (in dataset order) into ``num_clients / G`` contiguous chunks."""
        values, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        per_group = self._clients_per_group(values, counts)
        order = np.argsort(inverse, kind="stable")  # group-major, dataset order within each group
        return Ragged.from_sizes(order, np.concatenate([chunk_sizes(n, per_group) for n in counts.tolist()]))

    def _clients_per_group(self, values: np.ndarray, counts: np.ndarray) -> int:
        """``num_clients / G``, or a ConfigError if it is not an integer or some group is too small to share."""
        if self.num_clients % len(values):
            examples = ", ".join(str(len(values) * m) for m in (1, 2, 3))
            why = f"by_group needs a multiple of the number of groups in the data ({len(values)}), e.g. {examples}"
            raise bad_value("partition.num_clients", self.num_clients, why)
        per_group = self.num_clients // len(values)
        if counts.min() < per_group:
            g = int(counts.argmin())
            why = f"group {values[g]} has {counts[g]} training samples but {per_group} clients must share it"
            raise bad_value("partition.num_clients", self.num_clients, f"{why}; use fewer clients")
        return per_group


class FromFile(Partitioner):
    """Each client's rows read from a JSON file (``partition.path``, format in :mod:`flx.datamodules.partition_file`):
    the exact partition of another implementation, or of an earlier run (its ``partition.json``). Nothing is random
    except a ``test_fraction`` hold-out, which needs a file without ``test`` lists.

    Args:
        path: the JSON file; read (and its structure checked) when the partitioner is built, before the run.
        num_clients: ``None`` takes the file's client count; a number must equal it.
        test_fraction: see :class:`Partitioner`.
        min_size: see :class:`Partitioner`.
        seed: the seed of the ``test_fraction`` hold-out and of the unseen clients.
        unseen_clients: see :class:`Partitioner`; null where the file lists its ``unseen`` clients (a run's
            ``partition.json``), which are then the unseen ones.
    """

    name = "from_file"
    uses_labels = False

    def __init__(
        self,
        path: str,
        num_clients: int | None = None,
        test_fraction: float = 0.0,
        min_size: int = 1,
        seed: int | None = None,
        unseen_clients: int | float | None = None,
    ) -> None:
        self.path, (self._train, self._test, self._unseen) = path, read_partition(path)
        if num_clients is not None and num_clients != len(self._train):
            why = f"{path} lists {len(self._train)} clients; leave partition.num_clients null or set it to that"
            raise bad_value("partition.num_clients", num_clients, why)
        super().__init__(len(self._train), test_fraction, min_size, seed, unseen_clients)
        if self.test_fraction > 0 and len(self._test.values):
            why = f"{path} already lists each client's test rows; set partition.test_fraction=0"
            raise bad_value("partition.test_fraction", self.test_fraction, why)
        if self._unseen is not None and self.unseen_clients:
            why = f"{path} lists its unseen clients ('unseen'); leave partition.unseen_clients null"
            raise bad_value("partition.unseen_clients", self.unseen_clients, why)

    @property
    def num_unseen(self) -> int:
        """The file's ``unseen`` clients, else ``partition.unseen_clients``."""
        unseen = getattr(self, "_unseen", None)
        return len(unseen) if unseen is not None else super().num_unseen

    def _hold_out(self, split: ClientSplit, seed: int) -> ClientSplit:
        """The file's ``unseen`` clients moved last (a run's file: they are already), else the seeded rule."""
        return super()._hold_out(split, seed) if self._unseen is None else hold_out(split, np.sort(self._unseen))

    def __repr__(self) -> str:
        return f"FromFile(path={self.path!r}, num_clients={self.num_clients}, test_fraction={self.test_fraction})"

    def __call__(self, labels: np.ndarray, seed: int, groups: np.ndarray | None = None) -> ClientSplit:
        """The file's partition of ``labels``' rows (checked: in range, each row in exactly one client)."""
        labels = as_labels(labels)
        check_covers(self._train, self._test, len(labels), self.path)
        train = self._train.sorted()
        self._check_min_size(train.sizes() + self._test.sizes())
        if len(self._test.values):
            return self._hold_out(ClientSplit(train=train, test=self._test.sorted()), seed)
        split = self._split_test(train, np.random.default_rng(seed if self.seed is None else self.seed))
        return self._hold_out(split, seed)


PARTITIONERS: dict[str, type[Partitioner]] = {
    "iid": IID,
    "stratified": Stratified,
    "dirichlet": Dirichlet,
    "shards": Shards,
    "one_class": OneClass,
    "quantity_skew": QuantitySkew,
    "by_group": ByGroup,
    "from_file": FromFile,
    "few_shot": FewShot,
    "label_quantity": LabelQuantity,
    "niid_quantity": NiidQuantity,
    "noise_feature": NoiseFeature,
}
"""Partitioners by their config name."""


def needs_labels(name: str, data: str, has: str = REAL_TARGETS) -> ConfigError:
    """The one line for a partition by class label (``uses_labels``) of data without class labels (``has``: what the
    data's targets are, :data:`REAL_TARGETS` or :data:`TOKEN_TARGETS`)."""
    free = ", ".join(key for key, cls in PARTITIONERS.items() if not cls.uses_labels)
    why = f"splits by class label and data={data} has {has}; allowed: {free}"
    return bad_value("partition", name, why)
