"""FCUBE, NIID-Bench's synthetic feature-skew task: 3-D points in a cube, labelled by the sign of ``x1``.

Li, Diao, Chen, He, "Federated Learning on Non-IID Data Silos: An Experimental Study", ICDE 2022 (arXiv:2102.02079),
Section III-B ("synthetic feature imbalance") and IV: points uniform in the cube :math:`[-1, 1]^3`, label
:math:`y = 1[x_1 > 0]` (the plane :math:`x_1 = 0` separates the classes). The planes :math:`x_1 = 0, x_2 = 0, x_3 = 0`
cut the cube into 8 octants; every two octants symmetric about the origin form one party's subset, so there are 4
parties. Party ``c`` holds the octant with signs :math:`(+, s_2, s_3)`, :math:`s_2 = -` for ``c >= 2`` and
:math:`s_3 = -` for odd ``c``, and its mirror :math:`(-, -s_2, -s_3)`: its features differ from every other party's
while its labels stay balanced (one octant per class).

As the authors' generator: each party gets ``samples`` training points (their 1000), alternately in its positive
octant (even rows, label 1) and in the mirror (odd rows, label 0), each coordinate's magnitude uniform in ``(0, 1]``;
the test split is ``test_samples`` points (their 1000) uniform in the whole cube. The party is the sample group
(``groups_train``), so ``partition=by_group`` with 4 clients (``data=fcube`` picks it) is the paper's partition; a test
point's group is the party whose two octants hold it (for ``client_eval=test_group``). Everything is drawn from
``np.random.default_rng(seed)``: parties in order, then the test points.
"""

from __future__ import annotations

import numpy as np
import torch

from flx.datamodules.store import TensorData
from flx.errors import bad_value

NUM_PARTIES = 4
"""FCUBE's parties: the 4 pairs of octants symmetric about the origin."""


def party_signs(party: int) -> np.ndarray:
    """The signs ``(+1, s2, s3)`` of party ``party``'s positive octant (its other octant is the negation)."""
    return np.array([1.0, -1.0 if party >= 2 else 1.0, -1.0 if party % 2 else 1.0])


def party_of(x: np.ndarray) -> np.ndarray:
    """The party whose two octants hold each point of ``x`` ``(n, 3)``: fold the point into ``x1 > 0``, then read
    ``(s2, s3)``."""
    folded = np.where(x[:, :1] > 0, x, -x)
    return 2 * (folded[:, 1] < 0) + (folded[:, 2] < 0)


def _count(key: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise bad_value(f"data.loader.{key}", value, "must be an integer >= 1")
    return int(value)


def fcube(samples: int = 1000, test_samples: int = 1000, seed: int = 0, standardize: bool = False) -> TensorData:
    """FCUBE's 4 parties of ``samples`` points each and a test split of ``test_samples`` points in the whole cube.

    Args:
        samples: training points per party (the authors' 1000), alternately in its positive and its mirror octant.
        test_samples: test points, uniform in the cube (the authors' 1000).
        seed: seed of every draw.
        standardize: unused: the points are the inputs as the paper defines them (accepted like every loader's).

    Returns:
        float32 inputs ``(4 * samples, 3)``, int64 labels ``1[x1 > 0]``, ``groups_*`` = party.
    """
    n, m = _count("samples", samples), _count("test_samples", test_samples)
    rng = np.random.default_rng(seed)
    xs = []
    for party in range(NUM_PARTIES):
        magnitude = 1.0 - rng.random((n, 3))  # in (0, 1]: never on a plane
        mirror = np.where(np.arange(n) % 2 == 1, -1.0, 1.0)[:, None]
        xs.append(magnitude * party_signs(party) * mirror)
    x_train = np.concatenate(xs)
    x_test = rng.uniform(-1.0, 1.0, (m, 3))
    groups = np.repeat(np.arange(NUM_PARTIES), n)
    return TensorData(
        x_train=torch.from_numpy(x_train).float(),
        y_train=torch.from_numpy((x_train[:, 0] > 0).astype(np.int64)),
        x_test=torch.from_numpy(x_test).float(),
        y_test=torch.from_numpy((x_test[:, 0] > 0).astype(np.int64)),
        num_classes=2,
        name="fcube",
        groups_train=torch.from_numpy(groups),
        groups_test=torch.from_numpy(party_of(x_test).astype(np.int64)),
        group_names=tuple("({:+.0f},{:+.0f},{:+.0f})|mirror".format(*party_signs(p)) for p in range(NUM_PARTIES)),
    )
