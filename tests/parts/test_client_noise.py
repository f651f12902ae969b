"""Per-client input noise: the local step sees x + mu_i (+ sigma eps); evaluation sees clean inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import linear, make_fed, run_rounds, toy_data

from flx.parts.xrisk.client_noise import ClientNoise


def test_shift_only_noise_is_training_on_shifted_inputs() -> None:
    """sigma=0: client 1's full-batch step is GD on x + (mu0 + 1 * delta) (float64, one client sampled)."""
    data = toy_data([6, 9], dtype=torch.float64)

    class OnlyClientOne(ClientNoise):
        def sample_clients(self, fed, round_idx, rng):
            return [1]

    net = linear(dtype=torch.float64)
    part = OnlyClientOne(mu0=-0.5, delta=0.25, sigma=0.0)
    run_rounds(make_fed(net, data, parts=[part], clients_per_round=1, local_steps=1, batch_size=64, lr=0.3), 1)
    ref = linear(dtype=torch.float64)
    idx = data.client_indices[1]
    F.cross_entropy(ref(data.x[idx] - 0.25), data.y[idx]).backward()
    for p, r in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), (r - 0.3 * r.grad).detach(), rtol=0, atol=1e-12)
    x = data.x[:3]
    torch.testing.assert_close(net(x), x @ net.weight.T + net.bias)  # hook gone after the client


def test_noise_is_seeded_per_round_and_client() -> None:
    data = toy_data([10, 10])
    kw = dict(clients_per_round=2, local_steps=2, batch_size=5, lr=0.1)
    a = make_fed(linear(), data, parts=[ClientNoise()], **kw)
    b = make_fed(linear(), data, parts=[ClientNoise()], **kw)
    clean = make_fed(linear(), data, **kw)
    for fed in (a, b, clean):
        run_rounds(fed, 2)
    assert all(torch.equal(p, q) for p, q in zip(a.net.parameters(), b.net.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.net.parameters(), clean.net.parameters()))
