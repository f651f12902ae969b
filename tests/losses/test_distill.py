"""R_h options: L2-to-PM and logit KD against hand computations and their closed-form gradients, the dispatcher."""

from __future__ import annotations

import math

import pytest
import torch

from flx.errors import ConfigError
from flx.losses.crd import CRD
from flx.losses.distill import (
    RH_INPUTS,
    RH_OPTIONS,
    l2_to_pm,
    l2_to_pm_grad,
    logit_kd,
    logit_kd_grad,
    make_rh,
)

TOL = dict(rtol=1e-12, atol=1e-12)


def _tensors(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


SHAPES = [(3, 4), (4,), (2, 3, 2)]


def test_l2_value_and_gradient_are_the_closed_forms() -> None:
    """R = sum_k sum (theta_k - theta_pk)^2, dR/dtheta_k = 2 (theta_k - theta_pk); the PM gets no gradient."""
    theta = [t.requires_grad_() for t in _tensors(SHAPES, 0)]
    pm = [t.requires_grad_() for t in _tensors(SHAPES, 1)]
    value = l2_to_pm(theta, pm)
    expected = sum(float(((a - b) ** 2).sum()) for a, b in zip(_tensors(SHAPES, 0), _tensors(SHAPES, 1)))
    assert math.isclose(value.item(), expected, rel_tol=1e-12)
    grads = torch.autograd.grad(value, theta, retain_graph=True)
    for a, b, got, closed in zip(theta, pm, grads, l2_to_pm_grad(theta, pm)):
        torch.testing.assert_close(got, 2 * (a - b).detach(), **TOL)
        torch.testing.assert_close(closed, got, **TOL)
    value.backward()
    assert all(p.grad is None for p in pm)


def test_l2_is_zero_at_the_pm() -> None:
    pm = _tensors(SHAPES, 2)
    assert float(l2_to_pm([p.clone() for p in pm], pm)) == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in l2_to_pm_grad(pm, pm))


@pytest.mark.parametrize(
    ("pm_shapes", "why"), [(SHAPES[:2], "3 vs 2 tensors"), ([(3, 4), (5,), (2, 3, 2)], "tensor 1 is (4,) vs (5,)")]
)
def test_l2_refuses_a_different_architecture_in_one_line(pm_shapes: list[tuple[int, ...]], why: str) -> None:
    with pytest.raises(ConfigError) as e:
        l2_to_pm(_tensors(SHAPES, 0), _tensors(pm_shapes, 1))
    assert str(e.value).startswith("algo.rh='l2'") and why in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        l2_to_pm_grad(_tensors(SHAPES, 0), _tensors(pm_shapes, 1))


def test_kd_value_by_hand() -> None:
    """Two samples, three classes, T = 2: T^2 * mean_b sum_k p_t log(p_t / p_s), softmax written out."""
    s = [[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]]
    t = [[0.0, 1.0, 3.0], [0.5, 2.0, 1.0]]
    big_t = 2.0

    def softmax(row: list[float]) -> list[float]:
        e = [math.exp(x / big_t) for x in row]
        return [x / sum(e) for x in e]

    kl = [sum(pt * math.log(pt / ps) for pt, ps in zip(softmax(tb), softmax(sb))) for sb, tb in zip(s, t)]
    expected = big_t**2 * sum(kl) / 2
    got = logit_kd(torch.tensor(s, dtype=torch.float64), torch.tensor(t, dtype=torch.float64), big_t)
    assert math.isclose(float(got), expected, rel_tol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 4.0, 0.5])
def test_kd_gradient_is_the_closed_form(temperature: float) -> None:
    """d/ds [T^2 / B sum_b KL(p_t || p_s)] = T^2 / B * (p_s - p_t) / T = T (p_s - p_t) / B; teacher detached."""
    s, t = _tensors([(5, 7), (5, 7)], 3)
    s.requires_grad_(), t.requires_grad_()
    value = logit_kd(s, t, temperature)
    (got,) = torch.autograd.grad(value, s, retain_graph=True)
    expected = temperature * (torch.softmax(s / temperature, 1) - torch.softmax(t / temperature, 1)) / 5
    torch.testing.assert_close(got, expected.detach(), **TOL)
    torch.testing.assert_close(logit_kd_grad(s, t, temperature), got, **TOL)
    value.backward()
    assert t.grad is None


def test_kd_is_zero_when_the_logits_agree() -> None:
    """Equal logits, or logits shifted by a per-row constant (same softmax): value and gradient 0."""
    (t,) = _tensors([(4, 6)], 4)
    for s in (t.clone(), t + torch.arange(4, dtype=t.dtype)[:, None]):
        s.requires_grad_()
        value = logit_kd(s, t)
        (grad,) = torch.autograd.grad(value, s)
        assert abs(value.item()) < 1e-12
        torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-15)


def _inputs(name: str) -> tuple:
    if RH_INPUTS[name] == "params":
        return _tensors(SHAPES, 0), _tensors(SHAPES, 1)
    if RH_INPUTS[name] == "logits":
        return tuple(_tensors([(3, 5), (3, 5)], 0))
    s, c = _tensors([(3, 4), (3, 6)], 0)
    return s.float(), c.float(), torch.tensor([0, 2, 5]), torch.Generator().manual_seed(0)


KWARGS = {
    "l2": {},
    "kd": {"temperature": 3.0},
    "crd": {"student_dim": 4, "teacher_dim": 6, "num_data": 8, "feat_dim": 4, "num_negatives": 5},
}


@pytest.mark.parametrize("name", RH_OPTIONS)
def test_every_option_builds_and_returns_a_finite_scalar(name: str) -> None:
    assert set(RH_INPUTS) == set(RH_OPTIONS) == set(KWARGS)
    rh = make_rh(name, **KWARGS[name])
    value = rh(*_inputs(name))
    assert value.shape == () and torch.isfinite(value)
    if name == "crd":
        assert isinstance(rh, CRD) and rh.num_negatives == 5


def test_unknown_option_and_bad_temperature_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match=r"^algo\.rh='mse': allowed: l2, kd, crd$"):
        make_rh("mse")
    with pytest.raises(ConfigError, match=r"^algo\.rh\.temperature=0\.0: must be > 0$"):
        make_rh("kd", temperature=0.0)
