"""NIID-Bench's partitions (flx.datamodules.niid_bench): each rule against a hand computation with the same seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import raises_one_line
from scipy import stats

from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.datasets import digits
from flx.datamodules.niid_bench import LabelQuantity, NiidQuantity, NoiseFeature, with_feature_noise
from flx.datamodules.partition_base import FeatureNoise
from flx.datamodules.partitioners import IID
from flx.datamodules.protocol import DataProtocol
from flx.datamodules.ragged import chunk_sizes

C = 10
LABELS = np.random.default_rng(0).choice(C, size=6000, p=(np.arange(C) + 5.0) / (np.arange(C) + 5.0).sum())


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(list(a.train) + list(a.test), list(b.train) + list(b.test)))


# ------------------------------------------------------------------------------------------ label-quantity skew #C=k


@pytest.mark.parametrize(("clients", "k"), [(10, 1), (10, 2), (17, 3), (10, 10)])
def test_label_quantity_gives_each_client_exactly_k_labels_and_covers_every_label(clients: int, k: int) -> None:
    split = LabelQuantity(clients, classes_per_client=k)(LABELS, seed=3)
    held = [set(np.unique(LABELS[rows]).tolist()) for rows in split.train]
    assert all(len(h) == k for h in held)
    assert all(c % C in h for c, h in enumerate(held))  # the authors' rule: client c's first label is c mod C
    assert set().union(*held) == set(range(C))
    assert np.array_equal(np.sort(np.concatenate(list(split.train))), np.arange(len(LABELS)))


def test_label_quantity_label_sets_and_shares_are_the_rule_drawn_by_hand() -> None:
    """The label sets are the hand draw with the same seed (the class shuffle first, then k - 1 random others per
    client), and each label's rows go to its owners in np.array_split sizes, in client order."""
    clients, k, seed = 13, 3, 5
    split = LabelQuantity(clients, classes_per_client=k)(LABELS, seed=seed)
    rng = np.random.default_rng(seed)
    rng.permutation(len(LABELS))  # group_by_class's shuffle
    sets = [{c % C, *rng.choice(np.delete(np.arange(C), c % C), size=k - 1, replace=False).tolist()} for c in range(13)]
    assert [set(np.unique(LABELS[rows]).tolist()) for rows in split.train] == sets
    for label in range(C):
        owners = [c for c in range(clients) if label in sets[c]]
        counts = [int((LABELS[split.train[c]] == label).sum()) for c in owners]
        assert counts == chunk_sizes(int((LABELS == label).sum()), len(owners)).tolist()


def test_label_quantity_refuses_too_few_clients_or_too_many_labels_in_one_line() -> None:
    raises_one_line(LabelQuantity(9, classes_per_client=2), LABELS, 0, match="partition.num_clients=9")
    raises_one_line(LabelQuantity(10, classes_per_client=11), LABELS, 0, match="partition.classes_per_client=11")
    raises_one_line(LabelQuantity, 10, classes_per_client=0, match="partition.classes_per_client=0")


# ------------------------------------------------------------------------------------------------ quantity skew


@pytest.mark.parametrize(("alpha", "min_size", "seed"), [(0.5, 10, 0), (0.3, 5, 4), (5.0, 1, 2)])
def test_niid_quantity_sizes_are_the_dirichlet_draw_by_hand(alpha: float, min_size: int, seed: int) -> None:
    clients, n = 10, len(LABELS)
    split = NiidQuantity(clients, alpha=alpha, min_size=min_size)(LABELS, seed=seed)
    rng = np.random.default_rng(seed)
    q = rng.dirichlet([alpha] * clients)
    while (q * n).min() < min_size:  # the authors' redraw
        q = rng.dirichlet([alpha] * clients)
    cuts = np.floor(np.cumsum(q) * n).astype(int)
    expected = np.diff(np.concatenate([[0], cuts[:-1], [n]]))
    assert [len(rows) for rows in split.train] == expected.tolist()
    assert min(expected) >= min_size
    permutation = rng.permutation(n)  # then the rows: a random permutation cut at the sizes
    assert all(np.array_equal(rows, np.sort(part)) for rows, part in zip(split.train, np.split(permutation, cuts[:-1])))


def test_niid_quantity_labels_are_iid_rows_per_class_proportional_to_size() -> None:
    """Each client's class counts are a random draw of its size from the pool: a chi-square statistic over all
    clients within its 1e-4 tail (the draw is without replacement, so the statistic is if anything smaller)."""
    labels = np.random.default_rng(1).integers(0, C, 40000)
    split = NiidQuantity(10, alpha=1.0, min_size=500)(labels, seed=0)
    p = np.bincount(labels, minlength=C) / len(labels)
    chi2 = 0.0
    for rows in split.train:
        expected = len(rows) * p
        chi2 += float((((np.bincount(labels[rows], minlength=C) - expected) ** 2) / expected).sum())
    assert chi2 < stats.chi2.ppf(1 - 1e-4, df=10 * (C - 1))


def test_niid_quantity_refuses_an_unreachable_min_size_in_one_line() -> None:
    raises_one_line(NiidQuantity(50, alpha=0.01, min_size=100), LABELS, 0, match="partition.alpha=0.01")


# ------------------------------------------------------------------------------------------ noise-based feature skew


@pytest.mark.parametrize("rule", ["paper", "code"])
def test_noise_feature_client_noise_has_the_stated_variance(rule: str) -> None:
    """On zero inputs the added noise is the noise: client c's sample variance is sigma (c + 1) / N (paper) or
    (sigma c / (N - 1))^2 (code), within 5 standard errors (var * sqrt(2 / m) for m draws); the mean is 0."""
    clients, sigma, rows, dim = 5, 0.5, 20000, 8
    part = NoiseFeature(clients, noise=sigma, rule=rule)
    split = part(np.zeros(rows, dtype=np.int64), seed=0)
    x = torch.zeros(rows, dim, dtype=torch.float64)
    noisy = with_feature_noise(x, split)
    assert torch.equal(x, torch.zeros(rows, dim, dtype=torch.float64))  # a copy: the input is untouched
    for c, own in enumerate(split.train):
        draw = noisy[torch.from_numpy(own)].numpy().ravel()
        var = sigma * (c + 1) / clients if rule == "paper" else (sigma * c / (clients - 1)) ** 2
        if var == 0:
            assert not draw.any()
            continue
        assert abs(draw.var() - var) < 5 * var * np.sqrt(2 / len(draw))
        assert abs(draw.mean()) < 5 * np.sqrt(var / len(draw))


def test_noise_feature_is_the_iid_split_and_is_seeded() -> None:
    noisy = NoiseFeature(7, noise=0.3)(LABELS, seed=2)
    assert _same(noisy, IID(7)(LABELS, seed=2))
    again = NoiseFeature(7, noise=0.3)(LABELS, seed=2)
    x = torch.randn(len(LABELS), 3)
    assert torch.equal(with_feature_noise(x, noisy), with_feature_noise(x, again))
    other = NoiseFeature(7, noise=0.3)(LABELS, seed=3)
    assert not torch.equal(with_feature_noise(x, noisy), with_feature_noise(x, other))


def test_noise_feature_noises_client_rows_only_in_the_datamodule() -> None:
    """In a run's data: each client's rows (training and held-out) are the clean rows plus exactly its draw; the
    validation, test and server rows are those of the same data without noise."""

    def dm(partitioner) -> FederatedDataModule:
        protocol = DataProtocol(val_fraction=0.1, server_fraction=0.1, standardize=True)
        module = FederatedDataModule(digits, partitioner, protocol=protocol)
        module.setup("fit")
        return module

    noisy, clean = dm(NoiseFeature(6, noise=0.2, test_fraction=0.25)), dm(IID(6, test_fraction=0.25))
    assert _same(noisy.split, clean.split)
    for name in ("x_val", "x_test"):
        assert torch.equal(getattr(noisy.data, name), getattr(clean.data, name))
    server = noisy.server_rows
    assert len(server) > 0 and torch.equal(noisy.data.x_train[server], clean.data.x_train[server])
    noise = noisy.split.noise
    assert isinstance(noise, FeatureNoise)
    for c, (train, test) in enumerate(zip(noisy.split.train, noisy.split.test)):
        rows = torch.from_numpy(np.sort(np.concatenate([train, test])))
        added = noisy.data.x_train[rows] - clean.data.x_train[rows]
        expected = torch.from_numpy(noise.draw(c, tuple(added.shape))).float()
        torch.testing.assert_close(added, expected, rtol=0, atol=1e-5)
    assert torch.equal(noisy.clients.x, noisy.data.x_train)  # the clients train on the noised rows


def test_noise_feature_refuses_token_inputs_and_bad_options_in_one_line() -> None:
    split = NoiseFeature(2)(np.zeros(10, dtype=np.int64), seed=0)
    raises_one_line(with_feature_noise, torch.zeros(10, 4, dtype=torch.int64), split, match="partition='noise_feature'")
    raises_one_line(NoiseFeature, 2, noise=-1.0, match="partition.noise=-1.0")
    raises_one_line(NoiseFeature, 2, rule="both", match="partition.rule='both'")


def test_noise_stays_with_its_client_when_unseen_clients_move_last() -> None:
    """``partition.unseen_clients`` renumbers the clients (the unseen ones last): each keeps its rows and its noise, so
    the noised store is the same as without unseen clients, row for row."""
    plain = NoiseFeature(6, noise=0.4)(LABELS, seed=1)
    held = NoiseFeature(6, noise=0.4, unseen_clients=2)(LABELS, seed=1)
    assert held.num_heldout == 2 and not _same(held, plain)  # renumbered
    x = torch.randn(len(LABELS), 3)
    assert torch.equal(with_feature_noise(x, held), with_feature_noise(x, plain))
