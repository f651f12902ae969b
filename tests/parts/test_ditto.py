r"""Ditto against FedAvg and hand computations on linear least squares (``least_squares``).

The global model is FedAvg's bit for bit; the personal model steps once per local step on the step's minibatch,
:math:`v \leftarrow \mathrm{prox}_{\eta_v h}(v - \eta_v(\nabla f(v; D) + \lambda(v - w^t)))`, from :math:`w^t` at the
client's first round and from the stored :math:`v_i` afterwards.
"""

from __future__ import annotations

import pytest
import torch
from helpers import linear, make_fed, raises_one_line, run_rounds
from least_squares import f64, flat, grad, l1, mse, prox, regression

from flx.federation import Federation
from flx.hooks import FederatedCallback
from flx.parts.personalisation.ditto import Ditto
from flx.sampling import derive_seed, local_batches


def _fed(data, parts, **kw) -> Federation:
    kw = {"local_steps": 3, "batch_size": 3, "lr": 0.1} | kw
    return make_fed(linear(data.x.shape[1], 1, dtype=f64), data, parts, loss_fn=mse, **kw)


def test_the_global_model_is_fedavgs_bitwise() -> None:
    data = regression([7, 5, 9, 4])
    kw = dict(clients_per_round=3, seed=2)
    avg, ditto = _fed(data, [], **kw), _fed(data, [Ditto(lam=0.5, regularizer=l1(0.1))], **kw)
    run_rounds(avg, 3)
    run_rounds(ditto, 3)
    assert all(torch.equal(a, b) for a, b in zip(avg.params, ditto.params))


@pytest.mark.parametrize(("mu", "personal_lr"), [(0.0, None), (0.2, 0.05)])
def test_personal_model_over_two_rounds_matches_the_hand_computation(mu: float, personal_lr: float | None) -> None:
    """One client, two rounds of K = 3 steps on B = 3 of n = 7 rows (the core's (seed, round, client) stream); the
    proximal centre is the round's global model w^t; round 1 continues from the stored v."""
    lam, eta, seed = 0.5, 0.1, 3
    data = regression([7])
    fed = _fed(
        data,
        [Ditto(lam=lam, personal_lr=personal_lr, regularizer=l1(mu) if mu else None)],
        clients_per_round=1,
        seed=seed,
    )
    eta_v, idx = personal_lr or eta, data.client_indices[0]
    v = None
    for r in range(2):
        wt = flat(fed.params)
        v = wt.clone() if v is None else v
        run_rounds(fed, 1, start=r)
        for rows in local_batches(idx, 3, 3, torch.Generator().manual_seed(derive_seed(seed, r, 0))):
            v = prox(v - eta_v * (grad(data.x[rows], data.y[rows], v) + lam * (v - wt)), eta_v * mu)
    with fed.personalize(0):
        torch.testing.assert_close(flat(fed.params), v, rtol=0, atol=1e-12)
    assert sorted(fed.store.get(0)) == ["ditto/v/0", "ditto/v/1"]


def test_a_client_never_sampled_is_evaluated_with_the_global_model() -> None:
    data = regression([5, 6, 7])
    fed = _fed(data, [Ditto()], clients_per_round=1)
    run_rounds(fed, 1)
    unseen = next(c for c in range(3) if c not in fed.store)
    w = flat(fed.params)
    with fed.personalize(unseen):
        assert torch.equal(flat(fed.params), w)


class _Picks(FederatedCallback):
    """Another part that chooses the minibatches: rows ``step, step + 1, step + 2`` of client 0 at step ``step``."""

    def sample_batch(self, fed, client):
        return fed.data.client_indices[client.cid][client.step : client.step + 3]


def test_personal_steps_use_the_rows_another_part_chose() -> None:
    """v_i steps on the step's rows (``client.rows``) whichever part chose them: one round, K = 3, by hand."""
    lam, eta = 0.5, 0.1
    data = regression([7])
    fed = _fed(data, [_Picks(), Ditto(lam=lam)], clients_per_round=1)
    v = wt = flat(fed.params)
    run_rounds(fed, 1)
    for k in range(3):
        rows = torch.arange(k, k + 3)
        v = v - eta * (grad(data.x[rows], data.y[rows], v) + lam * (v - wt))
    with fed.personalize(0):
        torch.testing.assert_close(flat(fed.params), v, rtol=0, atol=1e-12)


def test_bad_options_stop_with_one_line() -> None:
    raises_one_line(Ditto, lam=-1.0, match="algo.lam")
    raises_one_line(Ditto, personal_lr=0.0, match="algo.personal_lr")


@pytest.mark.parametrize("minibatch", ["epochs", "fresh"])
def test_resumed_equals_uninterrupted(minibatch: str) -> None:
    """The personal models ride in the federation's checkpointed store: 1 round, save, load into a fresh federation,
    1 more round == 2 rounds (global and personal models), under either minibatch stream."""
    data = regression([7, 5, 6])
    kw = dict(clients_per_round=2, seed=4, minibatch=minibatch)
    whole = _fed(data, [Ditto(lam=0.5)], **kw)
    run_rounds(whole, 2)
    first = _fed(data, [Ditto(lam=0.5)], **kw)
    run_rounds(first, 1)
    second = _fed(data, [Ditto(lam=0.5)], **kw)
    second.load_state_dict(first.state_dict())
    with torch.no_grad():
        for a, b in zip(second.params, first.params):
            a.copy_(b)
    run_rounds(second, 1, start=1)
    assert torch.equal(flat(second.params), flat(whole.params))
    for cid in range(3):
        with whole.personalize(cid):
            expected = flat(whole.params)
        with second.personalize(cid):
            assert torch.equal(flat(second.params), expected)
