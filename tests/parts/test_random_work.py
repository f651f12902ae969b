r"""RandomWork (systems heterogeneity: r_i ~ U{lo..hi} times the configured local work, per client and round): the
draws against numpy's generator on the (seed, round, client) seed, the steps each client trains (a closed form on
quadratic clients), work=None is FedAvg bit for bit, one-line errors.

Quadratic clients (as tests/parts/test_fednova.py): client ``i`` holds the 4 rows ``2 I`` with targets ``2 e_i``, a
bias-free ``Linear(4, 1)`` and the loss ``1/2 mse``: a full-batch local step is ``x <- x - eta (x - e_i)``, so ``tau``
steps from 0 end at ``(1 - (1 - eta)^tau) e_i``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, raises_one_line, run_rounds, toy_data

from flx.datamodules.datamodule import ClientStore
from flx.parts.systems.random_work import RandomWork, work_factor
from flx.sampling import derive_seed

f64 = torch.float64
D = 4
TARGETS = torch.tensor([[1.0, -2.0, 0.5, 3.0], [-1.0, 0.0, 2.0, 1.0], [0.5, 1.5, -1.0, -2.0]], dtype=f64)


def test_draws_are_the_seed_round_client_stream() -> None:
    """r_i = numpy's default_rng(derive_seed(seed, round, client, 0x4E0A)).integers(lo, hi + 1): the stream FedNova
    drew its random work from before the part existed (its draws unchanged); every value of [lo, hi] occurs, no
    other."""
    seen = set()
    for r in range(6):
        for cid in range(5):
            expected = int(np.random.default_rng(derive_seed(7, r, cid, 0x4E0A)).integers(2, 6))
            assert work_factor(7, r, cid, (2, 5)) == expected
            seen.add(expected)
    assert seen == {2, 3, 4, 5}


def _quad_fed(parts, eta: float, **kw: object):
    x = (2 * torch.eye(D, dtype=f64)).repeat(len(TARGETS), 1)
    y = (2 * TARGETS).reshape(-1, 1)
    store = ClientStore(x, y, [torch.arange(D * i, D * (i + 1)) for i in range(len(TARGETS))])
    net = linear(D, 1, dtype=f64, bias=False)
    with torch.no_grad():
        net.weight.zero_()
    cfg = dict(clients_per_round=3, local_steps=2, batch_size=D, lr=eta, seed=3) | kw

    def half_mse(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return 0.5 * F.mse_loss(out, t)

    return make_fed(net, store, parts, loss_fn=half_mse, **cfg)


@pytest.mark.parametrize("vectorize", [False, True])
def test_clients_train_r_times_k_steps(vectorize: bool) -> None:
    """K = 2 local steps, work [1, 4]: client i takes tau_i = 2 r_i full-batch steps from 0 and the round's mean is
    sum_i (1 - (1 - eta)^{tau_i}) e_i / 3 (equal sizes), with r_i the hand-drawn factors; fed.client_steps says
    tau_i in planning."""
    eta = 0.1
    fed = _quad_fed([RandomWork([1, 4])], eta, vectorize=vectorize)
    rnd = fed.begin_round(0)
    tau = [2 * work_factor(3, 0, i, (1, 4)) for i in range(3)]
    assert [fed.client_steps(i) for i in range(3)] == tau and len(set(tau)) > 1
    fed.train_clients(rnd.shard)
    fed.end_round()
    done = torch.tensor([1 - (1 - eta) ** t for t in tau], dtype=f64)
    expected = (done[:, None] * TARGETS).sum(0) / 3
    torch.testing.assert_close(fed.params[0].detach().reshape(-1), expected, rtol=0, atol=1e-13)


def test_none_is_fedavg_bitwise() -> None:
    """work=None: no step changes, the run is FedAvg's, torch.equal through 3 rounds (momentum, minibatches)."""
    data = toy_data([13, 8, 21, 5, 17], dtype=f64)
    kw = dict(clients_per_round=3, local_steps=4, batch_size=4, lr=0.1, momentum=0.5, seed=2)
    avg = make_fed(linear(dtype=f64), data, **kw)
    same = make_fed(linear(dtype=f64), data, [RandomWork(None)], **kw)
    for fed in (avg, same):
        run_rounds(fed, 3)
    assert all(torch.equal(a, b) for a, b in zip(avg.params, same.params))


@pytest.mark.parametrize(
    ("work", "match"),
    [
        ([0, 2], "algo.random_work=[0, 2]: null or [lo, hi]"),
        ([3, 2], "algo.random_work=[3, 2]"),
        ([1.5, 2], "algo.random_work=[1.5, 2]"),
        ([1, 2, 3], "algo.random_work=[1, 2, 3]"),
    ],
)
def test_bad_values_are_one_line(work: list, match: str) -> None:
    raises_one_line(RandomWork, work, match=match)
