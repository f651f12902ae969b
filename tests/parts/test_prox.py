"""FedProx: mu=0 is FedAvg exactly; mu>0 matches the hand-derived local update."""

from __future__ import annotations

import pytest
import torch
from helpers import linear, make_fed, params, run_rounds, toy_data

from flx.errors import ConfigError
from flx.parts.proximal.prox import Prox


def test_mu_zero_is_fedavg_exactly() -> None:
    data = toy_data([13, 8, 21, 5])
    kw = dict(clients_per_round=3, local_steps=5, batch_size=4, lr=0.1, seed=2)
    avg = make_fed(linear(), data, **kw)
    prox = make_fed(linear(), data, parts=[Prox(mu=0.0)], **kw)
    run_rounds(avg, 3)
    run_rounds(prox, 3)
    for a, b in zip(avg.net.parameters(), prox.net.parameters()):
        assert torch.equal(a, b)


def test_local_update_matches_hand_derivation() -> None:
    """Least squares f(w) = 1/(2n) ||X w - y||^2, grad f = X^T (X w - y) / n, full batch, K=3, one client:

    w_{k+1} = w_k - eta (grad f(w_k) + mu (w_k - w_g)),  w_0 = w_g; the global model becomes w_3.
    """
    mu, eta = 0.7, 0.2
    data = toy_data([11], dim=4, dtype=torch.float64)
    data.y = data.x @ torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)  # a real-valued target

    def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((out.squeeze(-1) - y) ** 2).mean()

    net = linear(4, 1, dtype=torch.float64, bias=False)
    wg = params(net)[0].squeeze(0)
    fed = make_fed(net, data, parts=[Prox(mu)], loss_fn=mse, clients_per_round=1, local_steps=3, batch_size=64, lr=eta)
    run_rounds(fed, 1)

    x, y, w = data.x, data.y, wg.clone()
    for _ in range(3):
        w = w - eta * (x.T @ (x @ w - y) / len(y) + mu * (w - wg))
    torch.testing.assert_close(net.weight.detach().squeeze(0), w, rtol=0, atol=1e-12)


def test_negative_mu_rejected() -> None:
    with pytest.raises(ConfigError, match="algo.mu"):
        Prox(mu=-0.1)
