"""FeDXL passive buffers: the local step against the hand-built estimator, pool merging, u (Eq. 11), momentum."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import binary_store, linear, make_fed, params, raises_one_line, run_rounds
from torch import nn

from flx.datamodules.datamodule import ClientStore
from flx.errors import ConfigError
from flx.losses import xrisk
from flx.models import heads
from flx.parts.xrisk.client_noise import ClientNoise
from flx.parts.xrisk.passive_buffer import PassiveBuffer


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
    """After a round the new pool holds K*B1 positive and K*B2 negative scores per client; depth keeps rounds.

    ``init_pools="clean_pass"`` pinned (the default became "minibatch"): H^0 is every sample's score at w^0.
    """
    data = _binary_data([4, 6, 5], [7, 5, 9])
    part = PassiveBuffer(
        b1=2, b2=3, loss="squared_hinge", compositional=False, beta=1.0, depth=2, init_pools="clean_pass"
    )
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


# ---------------------------------------------------------------- protocol options (issue 8)
def test_minibatch_initial_pools_are_each_clients_k_noisy_minibatches_at_w0() -> None:
    """init_pools=minibatch (Alg. 1-2 line 2): client i scores K minibatches of its B1 positives / B2 negatives
    under w^0 with its input noise, no update. Shift-only noise (sigma=0) x + mu_i with mu_i = 0.5 + i, and clients
    holding exactly B1 positives and B2 negatives, so every minibatch is the whole client (in some order):

    H^0_1 = [client 0: K copies of h(w^0; x_pos + 0.5), client 1: K copies of h(w^0; x_pos + 1.5)], U^0 = u0.
    """
    data, k = _binary_data([2, 2], [3, 3]), 3
    part = PassiveBuffer(b1=2, b2=3, loss="psm", compositional=False, beta=1.0, u0=2.0)
    noise = ClientNoise(mu0=0.5, delta=1.0, sigma=0.0)
    fed = make_fed(_net(), data, parts=[part, noise], clients_per_round=2, local_steps=k, lr=0.1)
    fed.begin_round(0)
    (h0,) = part.pools
    w0 = _net()
    for key, label, b in (("pos", 1, 2), ("neg", 0, 3)):
        assert len(h0[key]) == 2 * k * b
        for cid, mu in ((0, 0.5), (1, 1.5)):
            rows = data.client_indices[cid][data.y[data.client_indices[cid]] == label]
            expected = _score(w0, data.x[rows] + mu).detach().repeat(k).sort().values
            got = h0[key][cid * k * b : (cid + 1) * k * b].sort().values
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(h0["u"], torch.full((2 * k * 2,), 2.0, dtype=torch.float64))


def test_minibatch_initial_pools_draw_noise_seeded_per_client_and_leave_the_run_unchanged() -> None:
    """sigma > 0: the H^0 scores carry noise (they differ from the clean ones), are the same on a rebuild, and the
    pass draws from its own (seed, 0, client) stream: the model after round 1 is the one trained from the same pools
    given by hand."""
    data = _binary_data([3, 4], [5, 6])

    def build(pools=None):
        part = PassiveBuffer(b1=2, b2=3, gamma=0.5, beta=0.5)
        part.pools = pools or []
        fed = make_fed(_net(), data, parts=[part, ClientNoise()], clients_per_round=2, local_steps=2, lr=0.1)
        run_rounds(fed, 1)
        return part, fed

    a, fed_a = build()
    b, _ = build()
    first = {k: v.clone() for k, v in a._merged.items()}  # the pools round 1 consumed
    torch.testing.assert_close(first, b._merged, rtol=0, atol=0)
    clean = _score(_net(), data.x[data.y == 1]).detach()
    assert not torch.isin(first["pos"], clean).any()  # noisy: no score equals a clean-pass score
    _, fed_c = build([first])
    assert all(torch.equal(p, q) for p, q in zip(fed_a.net.parameters(), fed_c.net.parameters()))


def test_duplicate_positive_updates_u_once_with_the_mean_of_its_estimates() -> None:
    """A client with ONE positive and B1=3 draws it 3 times per step (with replacement); with noise the copies score
    differently. gamma=1, constant passive negatives c2, K=1:

    u = (1/3) sum_c ell(a_c, c2), the same value for the table and for all 3 recorded u (not the last copy's).
    """
    data = _binary_data([1], [4])
    part = PassiveBuffer(b1=3, b2=4, loss="kl_opauc", lam=2.0, gamma=1.0, beta=1.0)
    part.pools = _constant_pools(0.6, 0.3)
    fed = make_fed(_net(), data, parts=[part, ClientNoise(sigma=0.5)], clients_per_round=1, local_steps=1, lr=0.1)
    run_rounds(fed, 1)
    a = part.pools[-1]["pos"]  # the 3 copies' scores
    assert len(a) == 3 and len(torch.unique(a)) == 3
    expected = xrisk.kl_opauc_inner(a, torch.tensor(0.3, dtype=torch.float64), lam=2.0).mean()
    torch.testing.assert_close(fed.store.get(0)["u"], expected.reshape(1), rtol=0, atol=1e-12)
    torch.testing.assert_close(part.pools[-1]["u"], expected.repeat(3), rtol=0, atol=1e-12)


def test_passive_draws_without_replacement_take_next_from_fresh_permutations() -> None:
    """replacement=false (the default): a client's draws over the round are a permutation of the pool, then a
    fresh one when the pool is used up. Pool n=5, P1=2 per step, K=4: draws 0-4 are {0..4}, draws 5-7 distinct;
    step k takes draws 2k, 2k+1."""
    part = PassiveBuffer(b1=2, b2=3)
    assert PassiveBuffer().params.replacement is False
    part._merged = {"pos": torch.zeros(5), "neg": torch.zeros(7)}
    client = SimpleNamespace(generator=torch.Generator().manual_seed(0), num_steps=4, step=0, extras={})
    order = part._passive_order(client)
    assert sorted(order["pos"][:5].tolist()) == list(range(5)) and len(set(order["pos"][5:].tolist())) == 3
    assert sorted(order["neg"][:7].tolist()) == list(range(7)) and len(order["neg"]) == 4 * 3
    client.extras["fedxl"] = {"order": order}
    for k in range(4):
        client.step = k
        assert part._draw(5, 2, client, "pos").tolist() == order["pos"][2 * k : 2 * k + 2].tolist()


def _local_pair_grad(w: list[torch.Tensor], x_pos: torch.Tensor, x_neg: torch.Tensor) -> torch.Tensor:
    """grad_w mean_{s,t} ell(a_s(w), b_t(w)), squared hinge, flattened (Local Pair with linear f)."""
    ref = _net()
    with torch.no_grad():
        for p, v in zip(ref.parameters(), w):
            p.copy_(v)
    xrisk.squared_hinge(_score(ref, x_pos)[:, None], _score(ref, x_neg)[None, :]).mean().backward()
    return torch.cat([p.grad.reshape(-1) for p in ref.parameters()])


@pytest.mark.parametrize("sync", ["client", "server"])
def test_local_pair_momentum_per_client_or_server_mean(sync: str) -> None:
    """Local Pair, beta=0.5, K=1, 2 clients holding exactly B1 positives and B2 negatives (g_i is deterministic):

    round 1: m_i = beta g_i(w^0);  round 2: m_i' = (1-beta) s_i + beta g_i(w^1) with s_i = m_i (client: kept in the
    client's state) or s_i = mean_j m_j (server, Alg. 2 line 5), then w^2 = w^1 - eta mean_i m_i'.
    """
    data, beta, eta = _binary_data([2, 2], [3, 3]), 0.5, 0.3
    part = PassiveBuffer(
        b1=2, b2=3, loss="squared_hinge", compositional=False, beta=beta, pairs="local", momentum_sync=sync
    )
    fed = make_fed(_net(), data, parts=[part], clients_per_round=2, local_steps=1, lr=eta, weighting="uniform")
    flat = lambda ws: torch.cat([w.reshape(-1) for w in ws])  # noqa: E731
    xs = [(data.x[r][data.y[r] == 1], data.x[r][data.y[r] == 0]) for r in data.client_indices]
    w0 = params(_net())
    run_rounds(fed, 1)
    w1 = params(fed.net)
    m1 = [beta * _local_pair_grad(w0, *x) for x in xs]
    torch.testing.assert_close(flat(w1), flat(w0) - eta * (m1[0] + m1[1]) / 2, rtol=0, atol=1e-12)
    run_rounds(fed, 1, start=1)
    start = m1 if sync == "client" else [(m1[0] + m1[1]) / 2] * 2
    m2 = [(1 - beta) * s + beta * _local_pair_grad(w1, *x) for s, x in zip(start, xs)]
    torch.testing.assert_close(flat(params(fed.net)), flat(w1) - eta * (m2[0] + m2[1]) / 2, rtol=0, atol=1e-12)
    if sync == "client":
        for cid in (0, 1):
            torch.testing.assert_close(fed.store.get(cid)["m"], m2[cid], rtol=0, atol=1e-12)
        assert part.gbar is None
    else:
        torch.testing.assert_close(part.gbar, (m2[0] + m2[1]) / 2, rtol=0, atol=1e-12)
        assert "m" not in fed.store.get(0)


def test_one_client_momentum_sync_client_equals_server() -> None:
    """With one client (the Centralized reference) the server mean of one momentum is that momentum."""
    runs = []
    for sync in ("client", "server"):
        part = PassiveBuffer(b1=2, b2=3, gamma=0.5, beta=0.3, pairs="local", momentum_sync=sync)
        fed = make_fed(_net(), _binary_data([4], [6]), parts=[part], clients_per_round=1, local_steps=3, lr=0.2)
        run_rounds(fed, 3)
        runs.append(params(fed.net))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_one_logit_head_step_is_the_linear_estimator() -> None:
    """model.binary_head=one_logit: the net has one output z and h = sigmoid(z); the FeDXL1 step is still
    w_1 = w_0 - eta grad_w [mean_s ell(a_s(w), c2) + mean_t ell(c1, b_t(w))]."""
    data = _binary_data([3], [5])
    part = PassiveBuffer(b1=3, b2=5, loss="psm", compositional=False, beta=1.0)
    part.pools = _constant_pools(0.7, 0.2)
    net = linear(4, 1, dtype=torch.float64)
    fed = make_fed(
        net, data, parts=[part], loss_fn=heads.classification_loss, clients_per_round=1, local_steps=1, lr=0.5
    )
    run_rounds(fed, 1)
    ref = linear(4, 1, dtype=torch.float64)
    a, b = torch.sigmoid(ref(data.x[data.y == 1])[:, 0]), torch.sigmoid(ref(data.x[data.y == 0])[:, 0])
    c1, c2 = torch.tensor(0.7, dtype=torch.float64), torch.tensor(0.2, dtype=torch.float64)
    (xrisk.psm(a, c2).mean() + xrisk.psm(c1, b).mean()).backward()
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), (r - 0.5 * r.grad).detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [{"init_pools": "full"}, {"momentum_sync": "rank"}, {"pairs": "global"}])
def test_bad_option_values(bad: dict) -> None:
    (key,) = bad
    where = "algo.parts.passive_buffer." if key == "pairs" else "algo."  # pairs is set on the part (fedxl_localpair)
    raises_one_line(PassiveBuffer, **bad, match=f"{where}{key}=")
