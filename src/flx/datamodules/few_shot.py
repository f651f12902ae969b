"""Few-shot federated tasks: small clients of a few classes, each split into a support and a query set, and a share
of held-out clients that never train.

The protocol of AugFL's experiments (Yue et al., "AugFL: Augmenting Federated Learning with Pretrained Models", §VI-A,
after Lin et al., ICDCS 2020): client ``i`` holds ``D_i ~ U(M, 2M)`` samples
(discrete uniform, both ends included) of ``k`` classes drawn at random, split about evenly between its classes; each
client's samples are split ``support_fraction`` / rest into a support and a query set; a random ``heldout_fraction``
of the clients (80% train, 20% held out in the paper) never train and are the evaluation clients, adapted on their
support set and measured on their query set. Clients draw their rows without replacement, so no row is in two
clients; unlike the other partitioners most rows are in none (``50 x 30`` of CIFAR-10's 50,000).

:class:`flx.datamodules.partition_base.ClientSplit` carries the result: ``support`` (each client's support rows, a
subset of its ``train`` rows) and ``num_heldout`` (the last clients; their ``train`` rows are their support set, their
``test`` rows their query set), so ``client_eval=holdout`` measures exactly the held-out clients' query sets. Any
algorithm can use it: FedAvg trains on the training clients' support and query rows together.
"""

from __future__ import annotations

import math

import numpy as np

from flx.datamodules.partition_base import ClientSplit, Partitioner
from flx.datamodules.partition_ops import as_labels, group_by_class, integer, real
from flx.errors import bad_value


class FewShot(Partitioner):
    """``num_clients`` few-shot clients: ``classes_per_client`` random classes, ``D_i ~ U(M, 2M)`` samples
    (``samples_min`` = ``M``), a ``support_fraction`` support set; the last ``heldout_fraction`` of them held out.

    ``test_fraction`` must stay 0 (the held-out clients' query sets are the test rows); ``min_size`` is unused (every
    client has at least ``M`` rows).
    """

    name = "few_shot"

    def __init__(
        self,
        num_clients: int,
        classes_per_client: int = 2,
        samples_min: int = 20,
        support_fraction: float = 0.5,
        heldout_fraction: float = 0.2,
        *,
        test_fraction: float = 0.0,
        min_size: int = 1,
        seed: int | None = None,
        unseen_clients: int | float | None = None,
    ) -> None:
        self.classes_per_client, self.samples_min = classes_per_client, samples_min
        self.support_fraction, self.heldout_fraction = support_fraction, heldout_fraction
        super().__init__(num_clients, test_fraction, min_size, seed, unseen_clients)

    def _check_params(self) -> None:
        super()._check_params()
        self.classes_per_client = integer("partition.classes_per_client", self.classes_per_client, low=1)
        self.samples_min = integer("partition.samples_min", self.samples_min, low=2)
        self.support_fraction = f = real("partition.support_fraction", self.support_fraction, "a number in (0, 1)")
        if not 0 < f < 1:
            raise bad_value("partition.support_fraction", f, "must be in (0, 1): support and query both need rows")
        self.heldout_fraction = f = real("partition.heldout_fraction", self.heldout_fraction, "a number in [0, 1)")
        if not 0 <= f < 1:
            raise bad_value("partition.heldout_fraction", f, "must be in [0, 1) (0: no held-out clients)")
        if self.test_fraction:
            why = "few_shot clients have no test split of their own: the held-out clients' query sets are the test rows"
            raise bad_value("partition.test_fraction", self.test_fraction, why)
        if self.num_heldout >= self.num_clients:
            why = f"holds out {self.num_heldout} of the {self.num_clients} clients: no client would train"
            raise bad_value("partition.heldout_fraction", self.heldout_fraction, why)

    @property
    def num_heldout(self) -> int:
        """Held-out clients: ``round(heldout_fraction * num_clients)``."""
        return math.floor(self.heldout_fraction * self.num_clients + 0.5)

    def _check_unseen(self) -> None:
        if self.unseen_clients:
            why = "few_shot's held-out clients are its unseen clients: set partition.heldout_fraction instead"
            raise bad_value("partition.unseen_clients", self.unseen_clients, why)

    @property
    def num_unseen(self) -> int:
        """The held-out clients are the unseen ones."""
        return self.num_heldout

    def __call__(self, labels: np.ndarray, seed: int, groups: np.ndarray | None = None) -> ClientSplit:
        """Draws the clients (``seed`` unless ``partition.seed`` is set); ``groups`` is ignored."""
        labels = as_labels(labels)
        self._check_params()
        rng = np.random.default_rng(seed if self.seed is None else self.seed)
        parts = self.assign(labels, rng)
        support = [self._support(part, rng) for part in parts]
        train, test, held = list(parts), [np.empty(0, np.int64) for _ in parts], self.num_train_clients
        for cid in range(held, self.num_clients):  # evaluation clients: adapt on the support, measure on the query
            train[cid], test[cid] = support[cid], np.setdiff1d(parts[cid], support[cid])
        return ClientSplit(train=train, test=test, support=support, num_heldout=self.num_heldout)

    def assign(self, labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
        """Each client: ``D_i ~ U(M, 2M)`` rows of ``k`` distinct random classes, split about evenly over them (the
        first ``D_i mod k`` classes get one more), drawn without replacement from what earlier clients left; the
        classes are drawn among those with enough rows left (all of them until a class runs low)."""
        by_class = group_by_class(labels, rng)
        num_classes, k, m = len(by_class.counts), self.classes_per_client, self.samples_min
        if k > num_classes:
            why = f"must be <= the number of classes present ({num_classes})"
            raise bad_value("partition.classes_per_client", k, why)
        starts = np.concatenate([[0], np.cumsum(by_class.counts)[:-1]])
        used = np.zeros(num_classes, dtype=np.int64)
        parts = []
        for cid in range(self.num_clients):
            size = int(rng.integers(m, 2 * m + 1))
            share = size // k + 1  # the most rows one class gives this client
            open_ = np.flatnonzero(by_class.counts - used >= share)
            if len(open_) < k:
                why = f"client {cid} finds fewer than {k} classes with {share} rows left; use fewer clients or lower M"
                raise bad_value("partition.num_clients", self.num_clients, why)
            rows = []
            for j, c in enumerate(rng.choice(open_, size=k, replace=False)):
                take = size // k + (j < size % k)
                rows.append(by_class.order[starts[c] + used[c] : starts[c] + used[c] + take])
                used[c] += take
            parts.append(np.sort(np.concatenate(rows)).astype(np.int64))
        return parts

    def _support(self, part: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A random ``support_fraction`` of the client's rows (rounded; support and query both keep >= 1 row)."""
        size = min(max(math.floor(self.support_fraction * len(part) + 0.5), 1), len(part) - 1)
        return np.sort(rng.permutation(part)[:size])
