"""Array operations behind the partitioners: grouping by class, dealing samples, parameter checks.

Pure numpy functions of labels, counts and a ``numpy.random.Generator``; :mod:`flx.datamodules.partitioners`
composes them into the schemes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from flx.datamodules.ragged import Ragged
from flx.errors import bad_value


@dataclass(frozen=True)
class ByClass:
    """Sample indices grouped by class.

    Attributes:
        values: the distinct labels, ascending.
        counts: samples per class, aligned with ``values``.
        order: all sample indices, class-major (class ``values[0]`` first), shuffled within each class.
    """

    values: np.ndarray
    counts: np.ndarray
    order: np.ndarray

    @property
    def class_of_position(self) -> np.ndarray:
        """The class id (position in ``values``) of each entry of ``order``."""
        return np.repeat(np.arange(len(self.counts)), self.counts)

    @property
    def starts(self) -> np.ndarray:
        """Offset in ``order`` where each class begins."""
        return np.cumsum(self.counts) - self.counts


def integer(key: str, value: Any, low: int) -> int:
    """Returns ``value`` as an int, or raises if it is not an integer ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise bad_value(key, value, f"must be an integer >= {low}")
    return int(value)


def real(key: str, value: Any, allowed: str) -> float:
    """Returns ``value`` as a float, or raises if it is not a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise bad_value(key, value, allowed)
    return float(value)


def positive(key: str, value: Any) -> float:
    """Returns ``value`` as a float, or raises if it is not a finite number ``> 0``."""
    number = real(key, value, "must be a finite number > 0")
    if number <= 0:
        raise bad_value(key, value, "must be > 0")
    return number


def as_labels(labels: np.ndarray) -> np.ndarray:
    """Checks that ``labels`` is a 1-D integer array."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got shape {labels.shape} and dtype {labels.dtype}")
    return labels


def check_is_partition(parts: Ragged[np.ndarray], num_samples: int, num_clients: int, who: str) -> None:
    """Guards against a faulty :meth:`Partitioner.assign`: exactly one array per client, each index exactly once."""
    flat = parts.values
    ok = len(parts) == num_clients and len(flat) == num_samples
    ok = ok and (num_samples == 0 or (flat.min() >= 0 and flat.max() < num_samples))
    if not ok or np.bincount(flat, minlength=num_samples).max(initial=1) != 1:
        raise RuntimeError(f"{who}.assign did not return a partition of range({num_samples}) into {num_clients} parts")


def group_by_class(labels: np.ndarray, rng: np.random.Generator) -> ByClass:
    """Groups the sample indices by class, in random order within each class."""
    values, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(inverse[perm], kind="stable")]
    return ByClass(values=values, counts=counts, order=order)


def parts_from_owners(indices: np.ndarray, owners: np.ndarray, num_clients: int) -> Ragged[np.ndarray]:
    """Turns "sample ``indices[i]`` belongs to client ``owners[i]``" into one index array per client."""
    by_owner = np.argsort(owners, kind="stable")
    return Ragged.from_sizes(indices[by_owner], np.bincount(owners, minlength=num_clients))


def counts_from_proportions(proportions: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Rounds each row of ``proportions`` times its total to integer counts that sum exactly to the total."""
    edges = np.floor(np.cumsum(proportions, axis=1) * totals[:, None]).astype(np.int64)
    edges = np.minimum(edges, totals[:, None])
    edges[:, -1] = totals
    return np.diff(edges, axis=1, prepend=0)


def balanced_class_choice(num_classes: int, num_clients: int, per_client: int, rng: np.random.Generator) -> np.ndarray:
    """Picks ``per_client`` distinct classes for each client, always among the least-held classes.

    Returns:
        A ``(num_clients, per_client)`` array of class ids. Class hold counts differ by at most one.
    """
    held = np.zeros(num_classes)
    chosen = np.empty((num_clients, per_client), dtype=np.int64)
    for client in range(num_clients):
        # held counts are integers, so the uniform jitter only breaks ties among equally-held classes
        pick = np.argpartition(held + rng.random(num_classes), per_client - 1)[:per_client]
        chosen[client] = pick
        held[pick] += 1
    return chosen


def split_among_holders(
    by_class: ByClass, clients: np.ndarray, classes: np.ndarray, num_clients: int, hint: str
) -> Ragged[np.ndarray]:
    """Splits each class's samples evenly (sizes differ by at most one) among the clients that hold it.

    Args:
        by_class: the samples grouped by class.
        clients: client ids of the (client, class) holdings.
        classes: class ids (positions in ``by_class.values``) of the holdings, aligned with ``clients``.
        num_clients: number of clients.
        hint: advice appended to the error when a class has fewer samples than holders.

    Raises:
        ConfigError: some class has fewer samples than clients holding it (a client would miss that class).
        RuntimeError: some class is held by no client.
    """
    holders = np.bincount(classes, minlength=len(by_class.counts))
    if holders.min() < 1:
        raise RuntimeError("every class must be held by at least one client, or its samples are lost")
    short = np.flatnonzero(holders > by_class.counts)
    if len(short):
        c = short[0]
        why = f"class {by_class.values[c]} has {by_class.counts[c]} samples but {holders[c]} clients must share it"
        raise bad_value("partition.num_clients", num_clients, f"{why}; {hint}")
    holder_ids = clients[np.argsort(classes, kind="stable")]
    holder_starts = np.cumsum(holders) - holders
    cls = by_class.class_of_position
    rank = np.arange(len(cls)) - by_class.starts[cls]
    share = rank * holders[cls] // by_class.counts[cls]
    return parts_from_owners(by_class.order, holder_ids[holder_starts[cls] + share], num_clients)
