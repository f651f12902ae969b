r"""FedALA's local initialisation against the global model and a hand computation on a one-hidden-layer ReLU net.

With :math:`p = 1` the top layer is the output ``Linear`` (weight and bias); the hidden layer takes the global model.
One ALA step on a minibatch :math:`D`: :math:`\hat\Theta = \Theta_i + (\Theta - \Theta_i) \odot W`,
:math:`W \leftarrow \mathrm{clip}_{[0,1]}(W - \eta \nabla_{\hat\Theta} \mathrm{CE}(\hat\Theta; D) \odot (\Theta -
\Theta_i))`, the gradient by plain autograd on the written-out net.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_fed, raises_one_line, run_rounds, toy_data
from least_squares import flat
from test_one_collective import Group
from torch import Tensor, nn

from flx.federation import Federation
from flx.hooks import FederatedCallback
from flx.models.nets import MLP
from flx.parts.personalisation.fedala import _TAG, FedALA, top_params
from flx.sampling import derive_seed

f64 = torch.float64


def _net() -> nn.Module:
    torch.manual_seed(0)
    return MLP(input_shape=(5,), num_classes=3, hidden=[4]).to(f64)


def _data():
    return toy_data([10, 8, 9], dtype=f64)


def _fed(parts, data=None, **kw) -> Federation:
    kw = {"local_steps": 3, "batch_size": 4, "lr": 0.1, "clients_per_round": 2, "seed": 1} | kw
    return make_fed(_net(), data or _data(), parts, **kw)


class _Init(FederatedCallback):
    """Records each client's starting model (after the parts before it ran ``on_client_start``)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], list[Tensor]] = {}

    def on_client_start(self, fed, client) -> None:
        self.seen[(client.round.round, client.cid)] = [p.detach().clone() for p in fed.params]


def test_top_layers_are_modules_owning_parameters() -> None:
    net = _net()  # Flatten, Linear(5, 4), ReLU, Linear(4, 3): parameters W1, b1, W2, b2
    assert top_params(net, 1) == (2, 3)
    assert top_params(net, 2) == (0, 1, 2, 3)


def test_first_round_starts_from_the_global_model() -> None:
    """No old local model: ALA is off; round 0 is FedAvg's bit for bit."""
    rec = _Init()
    avg, ala = _fed([]), _fed([FedALA(), rec])
    w0 = [p.detach().clone() for p in ala.params]
    run_rounds(avg, 1)
    run_rounds(ala, 1)
    assert all(torch.equal(a, b) for a, b in zip(avg.params, ala.params))
    assert all(torch.equal(a, b) for seen in rec.seen.values() for a, b in zip(seen, w0))


def test_weights_fixed_at_one_start_from_the_global_model() -> None:
    """eta = 0: W stays 1, so Theta_i + (Theta - Theta_i) * 1 = Theta up to rounding: FedAvg's rounds."""
    avg, ala = _fed([]), _fed([FedALA(eta=0.0)])
    run_rounds(avg, 3)
    run_rounds(ala, 3)
    torch.testing.assert_close(flat(ala.params), flat(avg.params), rtol=0, atol=1e-14)
    assert torch.equal(ala.store.get(0)["fedala/W/0"], torch.ones(3, 4, dtype=f64))


def _ala_steps(old, g, w, x: Tensor, y: Tensor, eta: float, batch: int, epochs: int) -> list[Tensor]:
    """``epochs`` passes of ALA steps over the rows ``x, y`` in minibatches of ``batch`` (top layer only)."""
    for _ in range(epochs):
        for xb, yb in zip(x.split(batch), y.split(batch)):
            top = [(old[k] + (g[k] - old[k]) * wj).requires_grad_(True) for k, wj in zip((2, 3), w)]
            h = torch.relu(xb @ g[0].T + g[1])  # the hidden layer: the global model's
            grads = torch.autograd.grad(F.cross_entropy(h @ top[0].T + top[1], yb), top)
            w = [(wj - eta * gj * (g[k] - old[k])).clamp(0, 1) for wj, gj, k in zip(w, grads, (2, 3))]
    return w


@pytest.mark.parametrize(
    ("stop", "first_epochs"),
    [(dict(num_pre_loss=1, threshold=1e9), 2), (dict(num_pre_loss=1, threshold=0.0, max_epochs=3), 3)],
)
def test_initialisation_matches_the_hand_computation(stop: dict, first_epochs: int) -> None:
    """Client 0 over rounds 1 (its first ALA: W from 1, epochs until the losses settle: with a window of 1 an
    always-met threshold stops after 2 epochs, a threshold of 0 never, so max_epochs does) and 2 (one epoch from the
    stored W); s = 50: 5 of its 10 rows, drawn from its (seed, round, 0, copy 0, tag) stream; minibatches of 2 (a
    short last one)."""
    seed, eta = 1, 0.7
    rec = _Init()
    parts = [FedALA(rand_percent=50, eta=eta, **stop), rec]
    fed = _fed(parts, toy_data([10, 8], dtype=f64), batch_size=2, seed=seed)  # both clients every round
    data, idx = fed.data, fed.data.client_indices[0]
    w = [torch.ones(3, 4, dtype=f64), torch.ones(3, dtype=f64)]
    run_rounds(fed, 1)
    for r, epochs in ((1, first_epochs), (2, 1)):
        g = [p.detach().clone() for p in fed.params]
        old = [fed.store.get(0)[f"fedala/theta/{k}"] for k in range(4)]
        run_rounds(fed, 1, start=r)
        assert (r, 0) in rec.seen
        gen = torch.Generator().manual_seed(derive_seed(seed, r, 0, 0, _TAG))
        rows = idx[torch.randperm(10, generator=gen)[:5]]
        w = _ala_steps(old, g, w, data.x[rows], data.y[rows], eta, 2, epochs)
        start = rec.seen[(r, 0)]
        assert torch.equal(start[0], g[0]) and torch.equal(start[1], g[1])  # lower layer: the global model
        expected = [old[k] + (g[k] - old[k]) * wj for k, wj in zip((2, 3), w)]
        torch.testing.assert_close(flat(start[2:]), flat(expected), rtol=0, atol=1e-12)
        torch.testing.assert_close(
            flat([fed.store.get(0)[f"fedala/W/{j}"] for j in (0, 1)]), flat(w), rtol=0, atol=1e-12
        )
    assert not torch.equal(flat(w), torch.ones(15, dtype=f64))


def test_personalised_model_is_the_last_local_model() -> None:
    fed = _fed([FedALA()], clients_per_round=1)
    run_rounds(fed, 2)
    for cid in fed.store.client_ids():
        local = flat([fed.store.get(cid)[f"fedala/theta/{k}"] for k in range(4)])
        with fed.personalize(cid):
            assert torch.equal(flat(fed.params), local)
    unseen = next(c for c in range(3) if c not in fed.store)
    w = flat(fed.params)
    with fed.personalize(unseen):
        assert torch.equal(flat(fed.params), w)


def test_resumed_equals_uninterrupted() -> None:
    """Theta_i and W_i ride in the checkpointed store: 2 rounds, save, load, 2 more == 4 rounds."""
    whole = _fed([FedALA()])
    run_rounds(whole, 4)
    first = _fed([FedALA()])
    run_rounds(first, 2)
    second = _fed([FedALA()])
    second.load_state_dict(first.state_dict())
    with torch.no_grad():
        for a, b in zip(second.params, first.params):
            a.copy_(b)
    run_rounds(second, 2, start=2)
    assert torch.equal(flat(second.params), flat(whole.params))
    for cid in whole.store.client_ids():
        assert torch.equal(flat(list(second.store.get(cid).values())), flat(list(whole.store.get(cid).values())))


def test_bad_options_stop_with_one_line() -> None:
    raises_one_line(FedALA, rand_percent=0, match="algo.rand_percent")
    raises_one_line(FedALA, rand_percent=101, match="algo.rand_percent")
    raises_one_line(FedALA, layer_idx=0, match="algo.layer_idx")
    raises_one_line(FedALA, eta=-1.0, match="algo.eta")
    raises_one_line(FedALA, threshold=-0.1, match="algo.threshold")
    raises_one_line(FedALA, num_pre_loss=0, match="algo.num_pre_loss")
    raises_one_line(FedALA, max_epochs=0, match="algo.max_epochs")
    raises_one_line(FedALA, layer_idx=1.5, match="algo.layer_idx")
    raises_one_line(_fed, [FedALA(layer_idx=3)], match="at most the net's 2 layers")


def test_two_ranks_equal_one() -> None:
    """Theta_i and W_i of clients trained on either rank reach both through the round's state all-gather."""
    one = _fed([FedALA()])
    run_rounds(one, 4)
    group = Group(2)
    ranks = [
        _fed([FedALA()], rank=r, world_size=2, reduce_sum=group.reduce_sum(r), gather=group.gather(r)) for r in (0, 1)
    ]
    group.run([lambda r=r: run_rounds(ranks[r], 4) for r in (0, 1)])
    for fed in ranks:
        torch.testing.assert_close(flat(fed.params), flat(one.params), rtol=0, atol=1e-12)
        for cid in one.store.client_ids():
            torch.testing.assert_close(flat(list(fed.store.get(cid).values())), flat(list(one.store.get(cid).values())))
