"""Tests for flx.datamodules.partitioners: coverage, determinism, each scheme's promise and the config errors."""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flx.datamodules.partition_file import save_partition
from flx.datamodules.partitioners import (
    IID,
    PARTITIONERS,
    ByGroup,
    ClientSplit,
    Dirichlet,
    FromFile,
    OneClass,
    Partitioner,
    QuantitySkew,
    Shards,
    Stratified,
)
from flx.errors import ConfigError

NUM_CLASSES = 10


def make_labels(n: int = 2000, seed: int = 0) -> np.ndarray:
    """Imbalanced labels over NUM_CLASSES classes (class c is roughly (c + 5) times as common as a base rate)."""
    weights = np.arange(NUM_CLASSES) + 5.0
    return np.random.default_rng(seed).choice(NUM_CLASSES, size=n, p=weights / weights.sum())


LABELS = make_labels()

CASES = [
    ("iid", {"num_clients": 1}),
    ("iid", {"num_clients": 7}),
    ("iid", {"num_clients": 50, "test_fraction": 0.2}),
    ("stratified", {"num_clients": 16}),
    ("stratified", {"num_clients": 30, "test_fraction": 0.2}),
    ("dirichlet", {"num_clients": 10, "alpha": 0.3}),
    ("dirichlet", {"num_clients": 37, "alpha": 5.0, "test_fraction": 0.25, "min_size": 5}),
    ("shards", {"num_clients": 10, "classes_per_client": 1}),
    ("shards", {"num_clients": 25, "classes_per_client": 2}),
    ("shards", {"num_clients": 40, "classes_per_client": 3, "test_fraction": 0.1}),
    ("one_class", {"num_clients": 10}),
    ("one_class", {"num_clients": 23, "test_fraction": 0.3}),
    ("quantity_skew", {"num_clients": 3, "alpha": 5.0}),
    ("quantity_skew", {"num_clients": 20, "alpha": 0.5, "test_fraction": 0.2, "min_size": 10}),
    ("label_quantity", {"num_clients": 10, "classes_per_client": 2}),
    ("label_quantity", {"num_clients": 23, "classes_per_client": 3, "test_fraction": 0.2}),
    ("niid_quantity", {"num_clients": 10, "alpha": 0.5, "min_size": 10}),
    ("niid_quantity", {"num_clients": 30, "alpha": 2.0, "test_fraction": 0.1}),
    ("noise_feature", {"num_clients": 7, "noise": 0.1, "test_fraction": 0.2}),
]
CASE_IDS = [f"{name}-" + "-".join(f"{k}={v}" for k, v in kwargs.items()) for name, kwargs in CASES]


def build(name: str, **kwargs: Any) -> Partitioner:
    """The partitioner ``name``; ``from_file`` reads a file holding the IID partition of ``LABELS``."""
    if name == "from_file":
        path = Path(tempfile.mkdtemp()) / "partition.json"
        save_partition(path, IID(kwargs["num_clients"])(LABELS, seed=0))
        return FromFile(str(path), **kwargs)
    return PARTITIONERS[name](**kwargs)


def sizes(parts: list[np.ndarray]) -> np.ndarray:
    return np.array([len(p) for p in parts])


def histogram(labels: np.ndarray) -> np.ndarray:
    """Label proportions over NUM_CLASSES."""
    return np.bincount(labels, minlength=NUM_CLASSES) / len(labels)


def entropy(labels: np.ndarray) -> float:
    p = histogram(labels)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def client_labels(split: ClientSplit, labels: np.ndarray = LABELS) -> list[np.ndarray]:
    """Each client's labels, train and test together."""
    return [labels[np.concatenate([tr, te])] for tr, te in zip(split.train, split.test)]


# ----------------------------------------------------------------------------------------------- every partitioner


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=CASE_IDS)
def test_every_sample_in_exactly_one_client(name: str, kwargs: dict[str, Any]) -> None:
    split = build(name, **kwargs)(LABELS, seed=0)
    assert split.num_clients == len(split.train) == len(split.test) == kwargs["num_clients"]
    everything = np.sort(np.concatenate(split.train + split.test))
    np.testing.assert_array_equal(everything, np.arange(len(LABELS)))


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=CASE_IDS)
def test_arrays_are_sorted_int64_and_respect_min_size(name: str, kwargs: dict[str, Any]) -> None:
    split = build(name, **kwargs)(LABELS, seed=1)
    for part in split.train + split.test:
        assert part.dtype == np.int64 and part.ndim == 1
        assert np.all(np.diff(part) > 0)
    totals = sizes(split.train) + sizes(split.test)
    assert totals.min() >= kwargs.get("min_size", 1)
    assert sizes(split.train).min() >= 1


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=CASE_IDS)
def test_same_seed_same_split(name: str, kwargs: dict[str, Any]) -> None:
    first = build(name, **kwargs)(LABELS, seed=7)
    second = build(name, **kwargs)(LABELS, seed=7)
    for a, b in zip(first.train + first.test, second.train + second.test):
        np.testing.assert_array_equal(a, b)


# A single client, or one_class with one client per class (client c <- class c), has nothing random to vary.
RANDOM_CASES = [
    (case, case_id)
    for case, case_id in zip(CASES, CASE_IDS)
    if case[1]["num_clients"] > 1 and not (case[0] == "one_class" and case[1]["num_clients"] == NUM_CLASSES)
]


@pytest.mark.parametrize(("name", "kwargs"), [c for c, _ in RANDOM_CASES], ids=[i for _, i in RANDOM_CASES])
def test_different_seed_different_split(name: str, kwargs: dict[str, Any]) -> None:
    first = build(name, **kwargs)(LABELS, seed=7)
    second = build(name, **kwargs)(LABELS, seed=8)
    same = all(np.array_equal(a, b) for a, b in zip(first.train + first.test, second.train + second.test))
    assert not same


# few_shot has no test split of its own: tests/datamodules/test_few_shot.py
@pytest.mark.parametrize("name", sorted(set(PARTITIONERS) - {"few_shot"}))
def test_test_fraction_does_not_change_the_client_sets(name: str) -> None:
    kwargs = {"num_clients": 20}
    groups = LABELS % 2  # split by by_group only; every other partitioner ignores it
    plain = build(name, **kwargs)(LABELS, seed=3, groups=groups)
    held_out = build(name, **kwargs, test_fraction=0.3)(LABELS, seed=3, groups=groups)
    for whole, train, test in zip(plain.train, held_out.train, held_out.test):
        np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), whole)
    assert all(len(t) == 0 for t in plain.test)


def test_registry_and_hydra_style_construction() -> None:
    """Every registered partitioner has its config, configs/partition/<name>.yaml, targeting it; any other config
    there (a preset such as one_class_per_client) targets a registered partitioner."""
    folder = Path(__file__).resolve().parents[2] / "configs" / "partition"
    assert set(PARTITIONERS) <= {c.stem for c in folder.glob("*.yaml")}
    classes = {cls.__name__ for cls in PARTITIONERS.values()}
    for config in folder.glob("*.yaml"):
        target = re.search(r"^_target_: flx\.datamodules\.partitioners\.(\w+)$", config.read_text(), re.MULTILINE)
        assert target is not None and target.group(1) in classes, config.name
    for name, cls in PARTITIONERS.items():
        assert f"_target_: flx.datamodules.partitioners.{cls.__name__}\n" in (folder / f"{name}.yaml").read_text()
    for name, cls in PARTITIONERS.items():
        assert issubclass(cls, Partitioner) and cls.name == name
    part = Dirichlet(num_clients=4, alpha=2, test_fraction=0.5, min_size=3)
    assert (part.num_clients, part.alpha, part.test_fraction, part.min_size) == (4, 2.0, 0.5, 3)
    assert "alpha=2.0" in repr(part)


def test_hydra_instantiate() -> None:
    instantiate = pytest.importorskip("hydra.utils").instantiate
    part = instantiate({"_target_": "flx.datamodules.partitioners.Shards", "num_clients": 10, "classes_per_client": 3})
    assert isinstance(part, Shards) and part.classes_per_client == 3


def test_labels_need_not_be_contiguous() -> None:
    labels = np.array([3, 100, 7, 7, 3, 100, 100, 3, 7, 7, 3, 100] * 5)
    split = OneClass(6)(labels, seed=0)
    values = [np.unique(labels[p]) for p in split.train]
    assert [v.tolist() for v in values] == [[3], [7], [100], [3], [7], [100]]
    shards = Shards(4, classes_per_client=2)(labels, seed=0)
    assert all(len(np.unique(labels[p])) == 2 for p in shards.train)


# ------------------------------------------------------------------------------------------------- each promise


@pytest.mark.parametrize("num_clients", [1, 3, 7, 64, 2000])
def test_iid_sizes_differ_by_at_most_one(num_clients: int) -> None:
    n = sizes(IID(num_clients)(LABELS, seed=0).train)
    assert n.max() - n.min() <= 1 and n.sum() == len(LABELS)


def test_iid_clients_match_the_global_label_histogram() -> None:
    split = IID(5)(LABELS, seed=0)
    overall = histogram(LABELS)
    for labels in client_labels(split):
        assert 0.5 * np.abs(histogram(labels) - overall).sum() < 0.1


def test_dirichlet_small_alpha_is_much_more_skewed_than_large() -> None:
    def mean_entropy(alpha: float) -> float:
        split = Dirichlet(10, alpha=alpha)(LABELS, seed=0)
        return float(np.mean([entropy(labels) for labels in client_labels(split)]))

    skewed, uniform = mean_entropy(0.05), mean_entropy(100.0)
    assert uniform > 0.9 * math.log(NUM_CLASSES)
    assert skewed < 0.5 * uniform


@pytest.mark.parametrize("min_size", [1, 10, 30])
def test_dirichlet_respects_min_size(min_size: int) -> None:
    split = Dirichlet(25, alpha=0.3, min_size=min_size)(LABELS, seed=0)
    assert sizes(split.train).min() >= min_size


@pytest.mark.parametrize(("num_clients", "k"), [(10, 1), (5, 2), (25, 2), (40, 3), (7, 10)])
def test_shards_each_client_holds_exactly_k_classes(num_clients: int, k: int) -> None:
    split = Shards(num_clients, classes_per_client=k)(LABELS, seed=0)
    held = [np.unique(labels) for labels in client_labels(split)]
    assert all(len(classes) == k for classes in held)
    per_class = np.bincount(np.concatenate(held), minlength=NUM_CLASSES)
    assert per_class.min() >= 1 and per_class.max() - per_class.min() <= 1


def test_shards_split_each_class_evenly_among_holders() -> None:
    split = Shards(30, classes_per_client=2)(LABELS, seed=0)
    for c in range(NUM_CLASSES):
        shares = [np.sum(labels == c) for labels in client_labels(split)]
        shares = np.array([s for s in shares if s > 0])
        assert shares.max() - shares.min() <= 1


@pytest.mark.parametrize("num_clients", [10, 23, 100])
def test_one_class_gives_each_client_one_class_round_robin(num_clients: int) -> None:
    split = OneClass(num_clients)(LABELS, seed=0)
    held = [np.unique(labels) for labels in client_labels(split)]
    assert [h.tolist() for h in held] == [[c % NUM_CLASSES] for c in range(num_clients)]
    for c in range(NUM_CLASSES):
        shares = sizes([p for p, h in zip(split.train, held) if h[0] == c])
        assert shares.max() - shares.min() <= 1


def test_quantity_skew_sizes_vary_more_for_small_alpha() -> None:
    labels = make_labels(20_000)

    def size_cv(alpha: float) -> float:
        n = sizes(QuantitySkew(20, alpha=alpha)(labels, seed=0).train)
        return float(n.std() / n.mean())

    assert size_cv(0.3) > 3 * size_cv(100.0)
    assert size_cv(0.3) > 0.5


def test_quantity_skew_keeps_label_proportions_for_big_clients() -> None:
    labels = make_labels(20_000)
    split = QuantitySkew(10, alpha=0.5, min_size=5)(labels, seed=0)
    overall = histogram(labels)
    big = [labels[p] for p in split.train if len(p) >= 1000]
    assert big
    for client in big:
        assert 0.5 * np.abs(histogram(client) - overall).sum() < 0.08
    assert sizes(split.train).min() >= 5


@pytest.mark.parametrize("test_fraction", [0.1, 0.25, 0.5, 0.9])
def test_test_fraction_per_client_within_rounding(test_fraction: float) -> None:
    split = QuantitySkew(30, alpha=0.5, test_fraction=test_fraction)(LABELS, seed=0)
    for train, test in zip(split.train, split.test):
        total = len(train) + len(test)
        assert len(np.intersect1d(train, test)) == 0
        assert len(train) >= 1
        assert len(test) == min(math.floor(total * test_fraction + 0.5), total - 1)


def test_many_labels_and_clients_partition_exactly() -> None:
    labels = make_labels(50_000)
    split = Dirichlet(1000, alpha=0.5)(labels, seed=0)
    assert split.num_clients == 1000
    assert np.array_equal(np.sort(np.concatenate(split.train)), np.arange(len(labels)))


# ------------------------------------------------------------------------------------------------------ errors

BAD = [
    ("alpha zero", lambda: Dirichlet(10, alpha=0.0), "partition.alpha"),
    ("alpha negative", lambda: Dirichlet(10, alpha=-1.0), "partition.alpha"),
    ("alpha nan", lambda: Dirichlet(10, alpha=float("nan")), "partition.alpha"),
    ("quantity alpha zero", lambda: QuantitySkew(10, alpha=0), "partition.alpha"),
    ("zero clients", lambda: IID(0), "partition.num_clients"),
    ("negative clients", lambda: Shards(-3), "partition.num_clients"),
    ("float clients", lambda: IID(2.5), "partition.num_clients"),
    ("more clients than samples", lambda: IID(5000)(LABELS, seed=0), "partition.num_clients"),
    ("more one_class clients than samples", lambda: OneClass(2001)(LABELS, seed=0), "partition.num_clients"),
    ("k zero", lambda: Shards(10, classes_per_client=0), "partition.classes_per_client"),
    ("k above classes", lambda: Shards(10, classes_per_client=11)(LABELS, seed=0), "partition.classes_per_client"),
    ("shards leave classes out", lambda: Shards(3, classes_per_client=2)(LABELS, seed=0), "partition.num_clients"),
    (
        "shards class too small",
        lambda: Shards(6, classes_per_client=3)(np.repeat([0, 1, 2], [50, 50, 4]), 0),
        "partition.num_clients",
    ),
    ("one_class too few clients", lambda: OneClass(5)(LABELS, seed=0), "partition.num_clients"),
    ("one_class class too small", lambda: OneClass(8)(np.repeat([0, 1], [100, 3]), 0), "partition.num_clients"),
    ("test_fraction one", lambda: IID(10, test_fraction=1.0), "partition.test_fraction"),
    ("test_fraction negative", lambda: Dirichlet(10, test_fraction=-0.1), "partition.test_fraction"),
    ("min_size zero", lambda: IID(10, min_size=0), "partition.min_size"),
    ("min_size over total", lambda: IID(10, min_size=201)(LABELS, seed=0), "partition.min_size"),
    ("min_size over total quantity", lambda: QuantitySkew(100, min_size=21)(LABELS, 0), "partition.min_size"),
    ("min_size after shards", lambda: Shards(10, classes_per_client=1, min_size=150)(LABELS, 0), "partition.min_size"),
    ("dirichlet cannot reach min_size", lambda: Dirichlet(100, alpha=0.01, min_size=15)(LABELS, 0), "partition.alpha"),
]


@pytest.mark.parametrize(("make", "key"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_raises_one_line_config_error_naming_the_key(make: Any, key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)) as info:
        make()
    assert "\n" not in str(info.value)


def test_too_many_clients_message() -> None:
    with pytest.raises(ConfigError) as info:
        IID(5000)(make_labels(1437), seed=0)
    assert str(info.value) == "partition.num_clients=5000: more clients than training samples (1437)"


def test_alpha_message() -> None:
    with pytest.raises(ConfigError) as info:
        Dirichlet(10, alpha=0.0)
    assert str(info.value) == "partition.alpha=0.0: must be > 0"


def test_dirichlet_failure_suggests_a_fix() -> None:
    with pytest.raises(ConfigError, match="larger alpha or fewer clients") as info:
        Dirichlet(100, alpha=0.01, min_size=15)(LABELS, seed=0)
    assert "partition.min_size=15" in str(info.value)


def test_params_are_rechecked_on_call() -> None:
    part = IID(10)
    part.test_fraction = 1.5
    with pytest.raises(ConfigError, match="partition.test_fraction"):
        part(LABELS, seed=0)


@pytest.mark.parametrize("labels", [np.zeros((4, 4), dtype=np.int64), np.linspace(0, 1, 10)])
def test_labels_must_be_1d_integers(labels: np.ndarray) -> None:
    with pytest.raises(ValueError, match="1-D integer"):
        IID(2)(labels, seed=0)


def test_a_faulty_subclass_is_caught() -> None:
    class Overlapping(Partitioner):
        def assign(self, labels: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
            return [np.arange(len(labels)), np.arange(1)]

    with pytest.raises(RuntimeError, match="partition"):
        Overlapping(2)(LABELS, seed=0)


def test_stratified_gives_every_client_the_global_class_ratio() -> None:
    """Per class, client counts differ by at most one (each class is cut into near-equal shards)."""
    split = Stratified(16)(LABELS, seed=0)
    counts = np.stack([np.bincount(LABELS[p], minlength=NUM_CLASSES) for p in split.train])
    assert (counts.max(axis=0) - counts.min(axis=0) <= 1).all()
    assert (counts.sum(axis=0) == np.bincount(LABELS, minlength=NUM_CLASSES)).all()


# ----------------------------------------------------------------------------------------------- by_group


def test_by_group_hand_example() -> None:
    """12 samples, group 0 at 1, 2, 5, 8, 9 and group 1 at the other 7; 4 clients -> 2 per group, larger chunk first."""
    groups = np.array([1, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1])
    split = ByGroup(4)(LABELS[:12], seed=0, groups=groups)
    assert [p.tolist() for p in split.train] == [[1, 2, 5], [8, 9], [0, 3, 4, 6], [7, 10, 11]]


@pytest.mark.parametrize(("num_groups", "num_clients"), [(2, 10), (5, 10), (3, 3), (7, 21)])
def test_by_group_clients_hold_one_group_contiguously(num_groups: int, num_clients: int) -> None:
    groups = np.random.default_rng(num_groups).integers(0, num_groups, len(LABELS)) * 10 + 3  # ids need not be 0..G-1
    split = ByGroup(num_clients)(LABELS, seed=0, groups=groups)
    per_group = num_clients // num_groups
    np.testing.assert_array_equal(np.sort(np.concatenate(split.train)), np.arange(len(LABELS)))
    for g, value in enumerate(np.unique(groups)):
        chunks = split.train[g * per_group : (g + 1) * per_group]
        np.testing.assert_array_equal(np.concatenate(chunks), np.flatnonzero(groups == value))
        n = int((groups == value).sum())
        assert [len(c) for c in chunks] == [n // per_group + (k < n % per_group) for k in range(per_group)]


def test_by_group_ignores_labels_and_seed_but_holds_out_per_client() -> None:
    groups = LABELS % 3
    plain = ByGroup(6)(LABELS, seed=0, groups=groups)
    other = ByGroup(6)(np.zeros_like(LABELS), seed=5, groups=groups)
    assert all(np.array_equal(a, b) for a, b in zip(plain.train, other.train))
    held = ByGroup(6, test_fraction=0.25)(LABELS, seed=1, groups=groups)
    for whole, train, test in zip(plain.train, held.train, held.test):
        np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), whole)
        assert len(test) == math.floor(0.25 * len(whole) + 0.5)


@pytest.mark.parametrize(
    ("num_clients", "groups", "match"),
    [
        (4, None, "partition='by_group': needs a dataset with sample groups (data=adult, data=shakespeare)"),
        (7, LABELS % 2, "partition.num_clients=7: by_group needs a multiple of the number of groups in the data (2)"),
        (6, np.r_[np.zeros(len(LABELS) - 2, int), 1, 1], "group 1 has 2 training samples but 3 clients must share it"),
    ],
)
def test_by_group_errors_are_one_line(num_clients: int, groups: np.ndarray | None, match: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)) as info:
        ByGroup(num_clients)(LABELS, seed=0, groups=groups)
    assert "\n" not in str(info.value)


def test_one_class_per_client_preset_is_drfas_split() -> None:
    """``partition=one_class_per_client``: 10 clients, client c holds every sample of class c and nothing else
    (80% to train on, 20% as its own test split for the per-client accuracy)."""
    from hydra.utils import instantiate

    from flx.config import precheck

    part = instantiate(precheck(["data=digits", "partition=one_class_per_client"]).partition)
    assert isinstance(part, OneClass) and part.num_clients == 10
    split = part(LABELS, seed=0)
    assert part.test_fraction == 0.2
    for c, (rows, test) in enumerate(zip(split.train, split.test)):
        np.testing.assert_array_equal(np.union1d(rows, test), np.flatnonzero(LABELS == c))
        assert len(np.intersect1d(rows, test)) == 0 and abs(len(test) - 0.2 * (LABELS == c).sum()) <= 1
