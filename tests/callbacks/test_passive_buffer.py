"""FeDXL passive buffers: the local step against the hand-built estimator, pool merging, u (Eq. 11), momentum."""

from __future__ import annotations

import pytest
import torch
from helpers import binary_store, linear, make_fed, params, run_rounds
from torch import nn

from flx.callbacks.passive_buffer import PassiveBuffer
from flx.datamodules.datamodule import ClientStore
from flx.errors import ConfigError
from flx.losses import xrisk


def _binary_data(pos: list[int], neg: list[int], dim: int = 4) -> ClientStore:
    return binary_store(pos, neg, dim)


def _constant_pools(c1: float, c2: float, n: int = 50) -> list[dict[str, torch.Tensor]]:
    return [
        {
            "pos": torch.full((n,), c1, dtype=torch.float64),
            "u": torch.ones(n, dtype=torch.float64),
            "neg": torch.full((n,), c2, dtype=torch.float64),
        }
    ]


def _net() -> nn.Module:
    return linear(4, 2, dtype=torch.float64)


def _score(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = net(x)
    return torch.sigmoid(out[:, 1] - out[:, 0])


def test_fedxl1_step_is_the_linear_estimator() -> None:
    """One client with exactly B1 positives and B2 negatives, constant passive pools (c1, c2), K=1, PSM:

    w_1 = w_0 - eta * grad_w [ mean_s ell(a_s(w), c2) + mean_t ell(c1, b_t(w)) ]   (Eqs. 5-6, Alg. 1 line 16)
    """
    data = _binary_data([3], [5])
    part = PassiveBuffer(b1=3, b2=5, loss="psm", compositional=False, beta=1.0)
    part.pools = _constant_pools(0.7, 0.2)
    net = _net()
    run_rounds(make_fed(net, data, parts=[part], clients_per_round=1, local_steps=1, lr=0.5), 1)

    ref = _net()
    x, y = data.x, data.y
    a, b = _score(ref, x[y == 1]), _score(ref, x[y == 0])
    c1, c2 = torch.tensor(0.7, dtype=torch.float64), torch.tensor(0.2, dtype=torch.float64)
    loss = xrisk.psm(a, c2).mean() + xrisk.psm(c1, b).mean()
    loss.backward()
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), (r - 0.5 * r.grad).detach(), rtol=0, atol=1e-12)


def test_pools_merge_every_clients_round_scores() -> None:
    """After a round the new pool holds K*B1 positive and K*B2 negative scores per client; depth keeps rounds."""
    data = _binary_data([4, 6, 5], [7, 5, 9])
    part = PassiveBuffer(b1=2, b2=3, loss="squared_hinge", compositional=False, beta=1.0, depth=2)
    fed = make_fed(_net(), data, parts=[part], clients_per_round=3, local_steps=4, lr=0.1, weighting="uniform")
    w0 = _net()
    run_rounds(fed, 1)
    h0, first = part.pools
    torch.testing.assert_close(h0["pos"], _score(w0, data.x[data.y == 1]).detach())  # H^0: all samples at w^0
    assert (len(first["pos"]), len(first["neg"])) == (3 * 4 * 2, 3 * 4 * 3)
    run_rounds(fed, 1, start=1)
    assert len(part.pools) == 2 and part.pools[0] is first  # depth 2: H^0 dropped, rounds 1-2 kept


def test_u_is_the_moving_average_of_eq_11() -> None:
    """gamma=1: u_s = ell(a_s, c2) at the last step that drew s (every positive is drawn at every step here)."""
    data = _binary_data([3], [4])
    part = PassiveBuffer(b1=3, b2=4, loss="kl_opauc", lam=2.0, gamma=1.0, beta=1.0)
    part.pools = _constant_pools(0.6, 0.3)
    fed = make_fed(_net(), data, parts=[part], clients_per_round=1, local_steps=3, lr=0.2)
    run_rounds(fed, 1)
    u = fed.store.get(0)["u"]
    last_a = part.pools[-1]["pos"][-3:]
    expected = xrisk.kl_opauc_inner(last_a, torch.tensor(0.3, dtype=torch.float64), lam=2.0)
    torch.testing.assert_close(u.sort().values, expected.sort().values, rtol=0, atol=1e-12)


def test_momentum_scales_the_first_step_by_beta() -> None:
    """Round 1 starts from m = 0, so the first step moves w by -eta * beta * g: half of the beta=1 step."""
    moves = {}
    for beta in (1.0, 0.5):
        part = PassiveBuffer(b1=2, b2=3, loss="kl_opauc", gamma=0.5, beta=beta)
        part.pools = _constant_pools(0.6, 0.3)
        net = _net()
        w0 = params(net)
        run_rounds(make_fed(net, _binary_data([2], [3]), parts=[part], clients_per_round=1, local_steps=1, lr=0.3), 1)
        moves[beta] = [p.detach() - w for p, w in zip(net.parameters(), w0)]
    for full, half in zip(moves[1.0], moves[0.5]):
        torch.testing.assert_close(half, 0.5 * full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [{"loss": "hinge"}, {"b1": 0}, {"gamma": 0.0}, {"score": "prob"}])
def test_bad_params(bad: dict) -> None:
    with pytest.raises(ConfigError):
        PassiveBuffer(**bad)


def test_local_pair_step_is_the_within_client_pairwise_gradient() -> None:
    """pairs=local, linear f: w_1 = w_0 - eta * grad_w mean_{s,t} ell(a_s(w), b_t(w)) (both sides differentiated)."""
    data = _binary_data([3], [5])
    part = PassiveBuffer(b1=3, b2=5, loss="squared_hinge", compositional=False, beta=1.0, pairs="local")
    net = _net()
    run_rounds(make_fed(net, data, parts=[part], clients_per_round=1, local_steps=1, lr=0.5), 1)
    ref = _net()
    a, b = _score(ref, data.x[data.y == 1]), _score(ref, data.x[data.y == 0])
    xrisk.squared_hinge(a[:, None], b[None, :]).mean().backward()
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), (r - 0.5 * r.grad).detach(), rtol=0, atol=1e-12)
    assert part.pools == []  # no score pools for the baseline


def test_partial_participation_freezes_absent_clients_u() -> None:
    """Appendix F: with 1 of 3 clients per round, only the sampled clients' u tables exist / change."""
    data = _binary_data([4, 5, 3], [6, 4, 7])
    part = PassiveBuffer(b1=2, b2=2, loss="kl_opauc", gamma=0.5, beta=0.5)
    fed = make_fed(_net(), data, parts=[part], clients_per_round=1, local_steps=2, lr=0.1, weighting="uniform")
    run_rounds(fed, 1)
    (first,) = fed.rnd.cohort
    assert fed.store.client_ids() == [first] and len(part.pools[-1]["pos"]) == 2 * 2
