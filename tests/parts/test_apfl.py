r"""APFL against FedAvg and an autograd computation on linear least squares (``least_squares``).

Per local step, from the values before it: :math:`\bar v = \alpha v + (1 - \alpha) w`,
:math:`v \leftarrow v - \eta \nabla_v f(\bar v)`, :math:`\alpha \leftarrow \Pi_{[0,1]}(\alpha - \eta_\alpha
\partial_\alpha f(\bar v))`, :math:`w \leftarrow w - \eta \nabla f(w)`; the hand computation differentiates the
written-out loss :math:`f(\alpha v + (1 - \alpha) w)` with respect to the leaves :math:`v` and :math:`\alpha`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import linear, make_fed, raises_one_line, run_rounds
from least_squares import f64, flat, grad, mse, regression, xt
from test_one_collective import Group

from flx.federation import Federation
from flx.parts.personalisation.apfl import APFL
from flx.sampling import derive_seed, local_batches


def _fed(data, parts, **kw) -> Federation:
    kw = {"local_steps": 3, "batch_size": 3, "lr": 0.1} | kw
    return make_fed(linear(data.x.shape[1], 1, dtype=f64), data, parts, loss_fn=mse, **kw)


@pytest.mark.parametrize("options", [dict(alpha=0.0, adapt_alpha=False), dict(alpha=0.25, adapt_alpha=True)])
def test_the_global_model_is_fedavgs_bitwise(options: dict) -> None:
    data = regression([7, 5, 9, 4])
    kw = dict(clients_per_round=3, seed=2)
    avg, apfl = _fed(data, [], **kw), _fed(data, [APFL(**options)], **kw)
    run_rounds(avg, 3)
    run_rounds(apfl, 3)
    assert all(torch.equal(a, b) for a, b in zip(avg.params, apfl.params))


def test_alpha_zero_without_adaptation_personalises_to_the_global_model() -> None:
    data = regression([7, 5, 9])
    fed = _fed(data, [APFL(alpha=0.0, adapt_alpha=False)], clients_per_round=2, seed=1)
    run_rounds(fed, 2)
    w = flat(fed.params)
    for cid in fed.store.client_ids():
        with fed.personalize(cid):
            assert torch.equal(flat(fed.params), w)


def _hand(data, rounds: int, seed: int, alpha: float, eta: float, eta_a: float, adapt: bool, w0):
    """One client, ``rounds`` rounds of K = 3 steps on B = 3 of its rows, by autograd on the written-out loss."""
    idx, w, v, a = data.client_indices[0], w0.clone(), None, torch.tensor(alpha, dtype=f64)
    for r in range(rounds):
        v = w.clone() if v is None else v
        for rows in local_batches(idx, 3, 3, torch.Generator().manual_seed(derive_seed(seed, r, 0))):
            x, y = data.x[rows], data.y[rows].reshape(-1)
            vl, al = v.clone().requires_grad_(True), a.clone().requires_grad_(True)
            loss = ((xt(x) @ (al * vl + (1 - al) * w) - y) ** 2).mean()
            gv, ga = torch.autograd.grad(loss, (vl, al))
            v = v - eta * gv
            a = (a - eta_a * ga).clamp(0, 1) if adapt else a
            w = w - eta * grad(x, y, w)
    return w, v, a


@pytest.mark.parametrize(("adapt", "alpha_lr"), [(True, None), (True, 0.5), (False, None)])
def test_two_rounds_match_the_autograd_computation(adapt: bool, alpha_lr: float | None) -> None:
    """One client: round 1 continues from the stored v_1 and alpha_1; the personalised model mixes them with the
    global model (the client's local w: it is the only client)."""
    seed, alpha, eta = 3, 0.4, 0.1
    data = regression([7])
    fed = _fed(data, [APFL(alpha=alpha, adapt_alpha=adapt, alpha_lr=alpha_lr)], clients_per_round=1, seed=seed)
    w0 = flat(fed.params)
    run_rounds(fed, 2)
    w, v, a = _hand(data, 2, seed, alpha, eta, alpha_lr or eta, adapt, w0)
    torch.testing.assert_close(flat(fed.params), w, rtol=0, atol=1e-12)
    state = fed.store.get(0)
    torch.testing.assert_close(flat([state["apfl/v/0"], state["apfl/v/1"]]), v, rtol=0, atol=1e-12)
    torch.testing.assert_close(state["apfl/alpha"], a, rtol=0, atol=1e-12)
    assert adapt or a == alpha
    with fed.personalize(0):
        torch.testing.assert_close(flat(fed.params), a * v + (1 - a) * w, rtol=0, atol=1e-12)


def test_alpha_is_projected_onto_the_unit_interval() -> None:
    data = regression([7, 6])
    fed = _fed(data, [APFL(alpha=0.5, alpha_lr=1e6)], clients_per_round=2, seed=0)
    run_rounds(fed, 2)
    alphas = [float(fed.store.get(c)["apfl/alpha"]) for c in (0, 1)]
    assert all(a in (0.0, 1.0) for a in alphas), alphas


def test_a_client_never_sampled_is_evaluated_with_the_global_model() -> None:
    data = regression([5, 6, 7])
    fed = _fed(data, [APFL()], clients_per_round=1)
    run_rounds(fed, 1)
    unseen = next(c for c in range(3) if c not in fed.store)
    w = flat(fed.params)
    with fed.personalize(unseen):
        assert torch.equal(flat(fed.params), w)


def test_bad_options_stop_with_one_line() -> None:
    raises_one_line(APFL, alpha=1.5, match="algo.alpha")
    raises_one_line(APFL, alpha_lr=0.0, match="algo.alpha_lr")
    raises_one_line(APFL, adapt_alpha="yes", match="algo.adapt_alpha")


def test_resumed_equals_uninterrupted() -> None:
    """v_i and alpha_i ride in the checkpointed store: 1 round, save, load into a fresh federation, 1 more round ==
    2 rounds (global and personalised models)."""
    data = regression([7, 5, 6])
    kw = dict(clients_per_round=2, seed=4)
    whole = _fed(data, [APFL()], **kw)
    run_rounds(whole, 2)
    first = _fed(data, [APFL()], **kw)
    run_rounds(first, 1)
    second = _fed(data, [APFL()], **kw)
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


def test_two_ranks_equal_one() -> None:
    """v_i and alpha_i of clients trained on either rank reach both through the round's state all-gather."""
    data = regression([7, 5, 6, 8])
    kw = dict(clients_per_round=3, seed=4)
    one = _fed(data, [APFL()], **kw)
    run_rounds(one, 3)
    group = Group(2)
    ranks = [
        _fed(data, [APFL()], rank=r, world_size=2, reduce_sum=group.reduce_sum(r), gather=group.gather(r), **kw)
        for r in (0, 1)
    ]
    group.run([lambda r=r: run_rounds(ranks[r], 3) for r in (0, 1)])
    for fed in ranks:
        torch.testing.assert_close(flat(fed.params), flat(one.params), rtol=0, atol=1e-12)
        for cid in one.store.client_ids():
            with one.personalize(cid):
                expected = flat(one.params)
            with fed.personalize(cid):
                torch.testing.assert_close(flat(fed.params), expected, rtol=0, atol=1e-12)
