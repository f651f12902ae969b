"""FCUBE (flx.datamodules.fcube): NIID-Bench's 4 parties, each the two octants symmetric about the origin."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from flx.config import precheck
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.fcube import NUM_PARTIES, fcube, party_of, party_signs
from flx.datamodules.partitioners import ByGroup
from flx.datamodules.protocol import DataProtocol


def test_each_party_holds_its_two_symmetric_octants_half_each_with_labels_by_x1() -> None:
    data = fcube(samples=400, test_samples=300, seed=3)
    x, y, g = data.x_train.numpy(), data.y_train.numpy(), data.groups_train.numpy()
    octants = set()
    for party in range(NUM_PARTIES):
        signs = np.sign(x[g == party])
        s = party_signs(party)
        positive, mirror = (signs == s).all(axis=1), (signs == -s).all(axis=1)
        assert (positive | mirror).all() and positive.sum() == mirror.sum() == 200  # its octants only, half each
        assert np.array_equal(positive, np.arange(400) % 2 == 0)  # alternately, as the authors' generator
        octants |= {tuple(s), tuple(-s)}
        assert (np.abs(x[g == party]) <= 1).all()
    assert octants == set(itertools.product((-1.0, 1.0), repeat=3))  # the 4 parties cover the 8 octants once
    assert np.array_equal(y, (x[:, 0] > 0).astype(np.int64)) and y.sum() == 2 * 400  # balanced labels
    xt = data.x_test.numpy()
    assert np.array_equal(data.y_test.numpy(), (xt[:, 0] > 0).astype(np.int64))
    assert (np.abs(xt) <= 1).all() and len(np.unique(np.sign(xt), axis=0)) == 8  # uniform in the whole cube
    for point, party in zip(np.sign(xt), data.groups_test.numpy()):  # a test point's group: the party of its octant
        assert (point == party_signs(party)).all() or (point == -party_signs(party)).all()


def test_party_of_folds_a_point_into_its_pair() -> None:
    for party in range(NUM_PARTIES):
        s = party_signs(party)
        assert party_of(np.array([0.5 * s, -0.25 * s])).tolist() == [party, party]


def test_config_gives_the_papers_four_clients_one_per_party() -> None:
    cfg = precheck(["data=fcube", "algo.clients_per_round=4", "paths.output_dir=/tmp/flx-unused"])
    assert cfg.partition._target_.endswith(".ByGroup") and cfg.partition.num_clients == 4
    dm = FederatedDataModule(fcube(samples=50), ByGroup(num_clients=4), protocol=DataProtocol(standardize=False))
    dm.setup("fit")
    for c, rows in enumerate(dm.client_train):
        assert rows.tolist() == list(range(50 * c, 50 * (c + 1)))


def test_same_seed_same_points() -> None:
    a, b, c = fcube(samples=10, seed=1), fcube(samples=10, seed=1), fcube(samples=10, seed=2)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.x_test, b.x_test)
    assert not torch.equal(a.x_train, c.x_train)
