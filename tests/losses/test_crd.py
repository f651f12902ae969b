"""CRD: the loss of a hand-built case written out, gradient flow, bank update, Z, checkpoints, determinism, learning."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flx.errors import ConfigError
from flx.losses.crd import CRD, draw_negatives


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _hand_built(tau: float, z: tuple[float, float]) -> CRD:
    """2-d features and embeddings, D = 4, N = 2; identity heads, banks at fixed angles, Z fixed (no estimate)."""
    crd = CRD(2, 2, num_data=4, feat_dim=2, num_negatives=2, temperature=tau, momentum=0.5).double()
    with torch.no_grad():
        for head in (crd.head_s, crd.head_c):
            head.weight.copy_(torch.eye(2))
            head.bias.zero_()
        angles_s, angles_c = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0.5, 2.5, -1.0, 4.0])
        crd.bank_s.copy_(torch.stack([angles_s.cos(), angles_s.sin()], 1))
        crd.bank_c.copy_(torch.stack([angles_c.cos(), angles_c.sin()], 1))
        crd.z.copy_(torch.tensor(z))
    return crd


def test_loss_of_a_hand_built_case() -> None:
    """loss = sum over directions (v = v^s vs M^c with Z_s; v = v^c vs M^s with Z_c) of
    -1/B sum_i [log h(v_i, M_{idx_i}) + sum_{j in J_i} log(1 - h(v_i, M_j))], h = e / (e + N/D), e = exp(v.M / tau) / Z,
    v = feature / |feature| (identity heads), J the negatives the same generator seed draws."""
    tau, z, d, n = 0.5, (2.0, 0.25), 4, 2
    crd = _hand_built(tau, z)
    s = [[3.0, 4.0], [-1.0, 1.0]]
    c = [[1.0, 0.0], [0.6, -0.8]]
    idx = [1, 3]
    negatives = draw_negatives(torch.tensor(idx), d, n, _gen(7)).tolist()
    bank_s, bank_c = crd.bank_s.tolist(), crd.bank_c.tolist()

    def h(v: list[float], m: list[float], z_k: float) -> float:
        e = math.exp((v[0] * m[0] + v[1] * m[1]) / math.hypot(*v) / tau) / z_k
        return e / (e + n / d)

    expected = 0.0
    for feats, bank, z_k in ((s, bank_c, z[0]), (c, bank_s, z[1])):
        for v, i, neg in zip(feats, idx, negatives):
            expected -= (math.log(h(v, bank[i], z_k)) + sum(math.log(1 - h(v, bank[j], z_k)) for j in neg)) / 2
    got = crd(torch.tensor(s, dtype=torch.float64), torch.tensor(c, dtype=torch.float64), torch.tensor(idx), _gen(7))
    assert math.isclose(got.item(), expected, rel_tol=1e-12)


def test_negatives_exclude_the_own_index_and_cover_every_other() -> None:
    """N may exceed D - 1 (drawn with replacement); same seed, same draw."""
    idx = torch.tensor([0, 2, 4])
    neg = draw_negatives(idx, 5, 200, _gen(1))
    assert neg.shape == (3, 200) and torch.equal(neg, draw_negatives(idx, 5, 200, _gen(1)))
    for row, i in zip(neg, idx.tolist()):
        assert set(row.tolist()) == set(range(5)) - {i}


def _features(n: int, seed: int, ds: int = 6, dc: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Paired features: the teacher's are a fixed linear map of the student's plus a little noise."""
    g = _gen(seed)
    s = torch.randn(n, ds, generator=g)
    return s, s @ torch.randn(ds, dc, generator=g) + 0.1 * torch.randn(n, dc, generator=g)


def _crd(seed: int = 0, **kw) -> CRD:
    args = dict(num_data=32, feat_dim=8, num_negatives=12, temperature=0.1) | kw
    return CRD(6, 10, generator=_gen(seed), **args)


def test_gradient_reaches_heads_and_student_features_only() -> None:
    crd = _crd()
    s, c = (t.requires_grad_() for t in _features(8, 0))
    crd(s, c, torch.arange(8), _gen(0)).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0
    assert c.grad is None
    for name, p in crd.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(not b.requires_grad for b in crd.buffers())


def test_bank_update_is_the_normalised_momentum_average() -> None:
    """Rows idx: normalise(m old + (1 - m) f(feature)); other rows unchanged; update=False changes nothing."""
    crd, m = _crd(momentum=0.3), 0.3
    s, c = _features(32, 1)
    idx = torch.tensor([3, 7, 20, 31])
    old_s, old_c = crd.bank_s.clone(), crd.bank_c.clone()
    crd(s[idx], c[idx], idx, _gen(0), update=False)
    assert torch.equal(crd.bank_s, old_s) and torch.equal(crd.bank_c, old_c)
    crd(s[idx], c[idx], idx, _gen(0))
    with torch.no_grad():
        v_s, v_c = F.normalize(crd.head_s(s[idx]), dim=1), F.normalize(crd.head_c(c[idx]), dim=1)
    for bank, old, v in ((crd.bank_s, old_s, v_s), (crd.bank_c, old_c, v_c)):
        torch.testing.assert_close(bank[idx], F.normalize(m * old[idx] + (1 - m) * v, dim=1))
        rest = torch.ones(32, dtype=torch.bool).index_fill_(0, idx, False)
        assert torch.equal(bank[rest], old[rest])


def test_z_is_estimated_once_from_the_first_batch() -> None:
    """Z_s = D mean_{i, j in {idx_i} + J_i} exp(v^s_i . M^c_j / tau) on the first call, then fixed; Z = 1 without
    normalize."""
    crd = _crd()
    s, c = _features(32, 2)
    idx = torch.arange(6)
    cols = torch.cat([idx[:, None], draw_negatives(idx, 32, 12, _gen(3))], 1)
    with torch.no_grad():
        v_s = F.normalize(crd.head_s(s[idx]), dim=1)
        expected = 32 * torch.exp((v_s @ crd.bank_c.T).gather(1, cols) / 0.1).mean()
    crd(s[idx], c[idx], idx, _gen(3))
    torch.testing.assert_close(crd.z[0], expected)
    z = crd.z.clone()
    crd(s[6:12], c[6:12], torch.arange(6, 12), _gen(4))
    assert torch.equal(crd.z, z)
    plain = _crd(normalize=False)
    plain(s[idx], c[idx], idx, _gen(3))
    assert torch.equal(plain.z, torch.ones(2))


def _run(crd: CRD, steps: range, seed: int = 0) -> list[float]:
    """Losses of consecutive batches of 8 (cycling over the 32 samples), negatives drawn from seed + step."""
    s, c = _features(32, seed)
    out = []
    for t in steps:
        idx = torch.arange(8) + 8 * (t % 4)
        out.append(crd(s[idx], c[idx], idx, _gen(100 + t)).item())
    return out


def test_state_dict_round_trip_restores_identical_losses() -> None:
    crd = _crd(seed=0)
    _run(crd, range(3))
    state = {k: v.clone() for k, v in crd.state_dict().items()}
    assert {"bank_s", "bank_c", "z"} <= set(state)
    resumed = _crd(seed=1)
    resumed.load_state_dict(state)
    assert _run(crd, range(3, 7)) == _run(resumed, range(3, 7))


def test_deterministic_given_the_seeds() -> None:
    same = [_run(_crd(seed=5), range(4)) for _ in range(2)]
    assert same[0] == same[1]
    assert _run(_crd(seed=6), range(4)) != same[0]


def _train(lr: float, steps: int = 60) -> list[float]:
    """Adam on the heads, random batches of 8 of 32 paired samples (15 epochs), negatives from a seed per step."""
    crd = _crd(seed=0)
    opt = torch.optim.Adam(crd.parameters(), lr=lr)
    s, c = _features(32, 0)
    losses = []
    for t in range(steps):
        idx = torch.randperm(32, generator=_gen(t))[:8]
        loss = crd(s[idx], c[idx], idx, _gen(1000 + t))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_adam_on_the_heads_lowers_the_loss() -> None:
    """The heads learn to align each sample with its partner's bank row: the last 8 losses fall well below the first
    8, and below those of the same run with frozen heads (lr 0: only the banks move)."""
    learned, frozen = _train(lr=0.05), _train(lr=0.0)
    first, last, last_frozen = sum(learned[:8]) / 8, sum(learned[-8:]) / 8, sum(frozen[-8:]) / 8
    assert last < 0.5 * first and last < 0.5 * last_frozen, (first, last, last_frozen)


@pytest.mark.parametrize(
    ("kw", "key"),
    [
        ({"num_data": 1}, "algo.rh.num_data=1"),
        ({"num_negatives": 0}, "algo.rh.num_negatives=0"),
        ({"feat_dim": 0}, "algo.rh.feat_dim=0"),
        ({"temperature": 0.0}, "algo.rh.temperature=0.0"),
        ({"momentum": 1.5}, "algo.rh.momentum=1.5"),
    ],
)
def test_bad_arguments_are_one_line_errors(kw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        _crd(**kw)
    assert str(e.value).startswith(key + ":") and "\n" not in str(e.value)


def test_repeated_index_in_a_batch_is_refused() -> None:
    s, c = _features(4, 0)
    with pytest.raises(ValueError, match="repeats"):
        _crd()(s, c, torch.tensor([0, 1, 1, 2]), _gen(0))
