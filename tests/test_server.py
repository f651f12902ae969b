"""Server optimizer updates against their closed forms (Reddi et al. 2021, Alg. 2; FedAvgM)."""

from __future__ import annotations

import torch

from flx.server import ServerOptConfig, ServerOptimizer


def _run(cfg: ServerOptConfig, means: list[torch.Tensor], w0: torch.Tensor) -> tuple[torch.Tensor, ServerOptimizer]:
    w = [w0.clone()]
    opt = ServerOptimizer(w, cfg)
    for m in means:
        opt.step([m])
    return w[0], opt


W0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
M1 = torch.tensor([0.5, -1.0, 0.5], dtype=torch.float64)
M2 = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)


def test_fedavg_is_an_exact_copy_of_the_mean() -> None:
    m = torch.tensor([0.1, 0.2, 0.3])
    w, _ = _run(ServerOptConfig(), [m], torch.tensor([7.0, 8.0, 9.0]))
    assert torch.equal(w, m)


def test_server_sgd_with_momentum() -> None:
    """FedAvgM: v1 = d1, w1 = w0 + lr v1; v2 = beta v1 + d2, w2 = w1 + lr v2, with d_t = m_t - w_{t-1}."""
    lr, beta = 0.7, 0.9
    w, _ = _run(ServerOptConfig(name="sgd", lr=lr, momentum=beta), [M1, M2], W0)
    v1 = M1 - W0
    w1 = W0 + lr * v1
    v2 = beta * v1 + (M2 - w1)
    torch.testing.assert_close(w, w1 + lr * v2, rtol=0, atol=1e-14)


def test_fedadam_without_bias_correction() -> None:
    """m_t = b1 m + (1-b1) d, v_t = b2 v + (1-b2) d^2, w += lr m_t / (sqrt(v_t) + tau)."""
    lr, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    w, _ = _run(ServerOptConfig(name="adam", lr=lr, betas=(b1, b2), eps=tau), [M1, M2], W0)
    m = v = torch.zeros(3, dtype=torch.float64)
    x = W0.clone()
    for mean in (M1, M2):
        d = mean - x
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d
        x = x + lr * m / (v.sqrt() + tau)
    torch.testing.assert_close(w, x, rtol=0, atol=1e-14)


def test_state_dict_roundtrip_continues_identically() -> None:
    cfg = ServerOptConfig(name="adam", lr=0.1)
    full, _ = _run(cfg, [M1, M2], W0)
    half, opt = _run(cfg, [M1], W0)
    w = [half.clone()]
    resumed = ServerOptimizer(w, cfg)
    resumed.load_state_dict(opt.state_dict())
    resumed.step([M2])
    assert torch.equal(w[0], full) and resumed.state["step"] == 2
