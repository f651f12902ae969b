r"""MOON against FedAvg and a written-out loss on a one-hidden-layer ReLU net (float64).

With :math:`h(w; x) = \mathrm{relu}(W_1 x + b_1)` (the penultimate features) and logits :math:`W_2 h + b_2`, one
local step is :math:`w \leftarrow w - \eta \nabla_w [\mathrm{CE}(w) + \mu \ell_{con}(w)]` with

.. math::
    \ell_{con} = \frac1B \sum_j -\log \frac{e^{c_g / \tau}}{e^{c_g / \tau} + e^{c_p / \tau}}, \quad
    c_g = \cos(h(w; x_j), h(w^t; x_j)), \quad c_p = \cos(h(w; x_j), h(w_i^{prev}; x_j)),

:math:`w^t` and :math:`w_i^{prev}` held constant.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from helpers import make_fed, raises_one_line, run_rounds, toy_data
from least_squares import flat
from test_one_collective import Group
from torch import Tensor, nn

from flx.federation import Federation
from flx.models.nets import MLP
from flx.parts.proximal.moon import Moon, contrastive_loss
from flx.sampling import derive_seed, local_batches

f64 = torch.float64


def _net() -> nn.Module:
    torch.manual_seed(0)
    return MLP(input_shape=(5,), num_classes=3, hidden=[4]).to(f64)


def _fed(data, parts, **kw) -> Federation:
    kw = {"local_steps": 3, "batch_size": 4, "lr": 0.1, "clients_per_round": 2, "seed": 1} | kw
    return make_fed(_net(), data, parts, **kw)


def _data():
    return toy_data([9, 7, 8], dtype=f64)


def test_mu_zero_is_fedavg_bitwise() -> None:
    avg, moon = _fed(_data(), []), _fed(_data(), [Moon(mu=0.0)])
    run_rounds(avg, 3)
    run_rounds(moon, 3)
    assert all(torch.equal(a, b) for a, b in zip(avg.params, moon.params))


def test_first_visit_term_has_zero_gradient() -> None:
    """Round 0: every client's previous model is w^t, so z_prev = z_glob, l_con = log 2 and its gradient vanishes
    exactly: the global model is FedAvg's bit for bit even with mu > 0."""
    avg, moon = _fed(_data(), []), _fed(_data(), [Moon(mu=5.0)])
    run_rounds(avg, 1)
    run_rounds(moon, 1)
    assert all(torch.equal(a, b) for a, b in zip(avg.params, moon.params))


def test_contrastive_loss_is_eq_3() -> None:
    g = torch.Generator().manual_seed(0)
    z, zg, zp = (torch.randn(6, 4, generator=g, dtype=f64) for _ in range(3))
    t = 0.5
    cg = (z * zg).sum(1) / (z.norm(dim=1) * zg.norm(dim=1))
    cp = (z * zp).sum(1) / (z.norm(dim=1) * zp.norm(dim=1))
    expected = -torch.log(torch.exp(cg / t) / (torch.exp(cg / t) + torch.exp(cp / t))).mean()
    torch.testing.assert_close(contrastive_loss(z, zg, zp, t), expected, rtol=0, atol=1e-14)


def _hand_step(w: list[Tensor], wt: list[Tensor], wp: list[Tensor], x: Tensor, y: Tensor, mu, tau, lr) -> Tensor:
    """One SGD step on CE + mu l_con, written out (plain torch autograd, no flx)."""
    w = [p.clone().requires_grad_(True) for p in w]

    def h(p: list[Tensor]) -> Tensor:
        return torch.relu(x @ p[0].T + p[1])

    z, zg, zp = h(w), h(wt).detach(), h(wp).detach()
    ce = F.cross_entropy(z @ w[2].T + w[3], y)
    cg = (z * zg).sum(1) / (z.norm(dim=1) * zg.norm(dim=1))
    cp = (z * zp).sum(1) / (z.norm(dim=1) * zp.norm(dim=1))
    con = -torch.log(torch.exp(cg / tau) / (torch.exp(cg / tau) + torch.exp(cp / tau))).mean()
    grads = torch.autograd.grad(ce + mu * con, w)
    return flat([p - lr * g for p, g in zip(w, grads)])


def test_one_step_matches_the_written_out_loss() -> None:
    """Round 1, client 0, K = 1: from w^1 (the mean of round 0's locals), against client 0's round-0 local model."""
    mu, tau, lr, seed = 2.0, 0.5, 0.1, 1
    data = toy_data([9, 7], dtype=f64)
    fed = _fed(data, [Moon(mu=mu, temperature=tau)], local_steps=1, seed=seed)
    run_rounds(fed, 1)
    wt = [p.detach().clone() for p in fed.params]
    prev = [fed.store.get(0)[f"moon/prev/{k}"] for k in range(4)]
    assert not torch.equal(flat(prev), flat(wt))
    run_rounds(fed, 1, start=1)
    (rows,) = local_batches(data.client_indices[0], 4, 1, torch.Generator().manual_seed(derive_seed(seed, 1, 0)))
    expected = _hand_step(wt, wt, prev, data.x[rows], data.y[rows], mu, tau, lr)
    local = flat([fed.store.get(0)[f"moon/prev/{k}"] for k in range(4)])  # round 1's local model
    torch.testing.assert_close(local, expected, rtol=0, atol=1e-12)


def test_resumed_equals_uninterrupted() -> None:
    """The previous local models ride in the checkpointed store: 2 rounds == 1 round, save, load, 1 more round."""
    whole = _fed(_data(), [Moon(mu=1.0)])
    run_rounds(whole, 3)
    first = _fed(_data(), [Moon(mu=1.0)])
    run_rounds(first, 2)
    second = _fed(_data(), [Moon(mu=1.0)])
    second.load_state_dict(first.state_dict())
    with torch.no_grad():
        for a, b in zip(second.params, first.params):
            a.copy_(b)
    run_rounds(second, 1, start=2)
    assert torch.equal(flat(second.params), flat(whole.params))
    for cid in range(3):
        assert torch.equal(flat(list(second.store.get(cid).values())), flat(list(whole.store.get(cid).values())))


def _two_ranks(parts: Callable[[], list], rounds: int) -> list[Federation]:
    group = Group(2)
    ranks = [
        _fed(_data(), parts(), rank=r, world_size=2, reduce_sum=group.reduce_sum(r), gather=group.gather(r))
        for r in (0, 1)
    ]
    group.run([lambda r=r: run_rounds(ranks[r], rounds) for r in (0, 1)])
    return ranks


def test_two_ranks_equal_one() -> None:
    one = _fed(_data(), [Moon(mu=1.0)])
    run_rounds(one, 3)
    for fed in _two_ranks(lambda: [Moon(mu=1.0)], 3):
        torch.testing.assert_close(flat(fed.params), flat(one.params), rtol=0, atol=1e-12)
        for cid in range(3):
            torch.testing.assert_close(fed.store.get(cid)["moon/prev/0"], one.store.get(cid)["moon/prev/0"])


def test_bad_options_stop_with_one_line() -> None:
    raises_one_line(Moon, mu=-1.0, match="algo.mu")
    raises_one_line(Moon, temperature=0.0, match="algo.temperature")
    raises_one_line(Moon, temperature="warm", match="algo.temperature")


def test_a_net_without_penultimate_features_stops_with_one_line() -> None:
    torch.manual_seed(0)
    raises_one_line(make_fed, nn.Linear(5, 3), _data(), [Moon()], match="penultimate")


def test_term_moves_the_model() -> None:
    """From round 1 on the term is not zero: MOON's global model differs from FedAvg's."""
    avg, moon = _fed(_data(), []), _fed(_data(), [Moon(mu=1.0)])
    run_rounds(avg, 2)
    run_rounds(moon, 2)
    assert not torch.equal(flat(avg.params), flat(moon.params))
