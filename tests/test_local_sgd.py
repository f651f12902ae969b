"""flx's plain-SGD local step (flx.local_sgd) is torch.optim.SGD's step, bitwise, without its per-call machinery."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, params, run_rounds, toy_data
from torch import nn

from flx import clients, local_sgd
from flx.hooks import FederatedCallback
from flx.local_sgd import clear_grads, is_plain_sgd, minibatches, sgd_step


def _pair(dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 3)).to(dtype)
    b = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3), nn.Linear(3, 3)).to(dtype)
    b.load_state_dict(a.state_dict())
    return a, b


def _groups(net: nn.Module) -> list[dict]:
    """Two groups with their own learning rates; the last layer is left out of the loss (its grads stay None)."""
    return [{"params": list(net[0].parameters()), "lr": 0.3}, {"params": [*net[2].parameters(), *net[3].parameters()]}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sgd_step_is_torch_sgd_step_bitwise(dtype: torch.dtype) -> None:
    """20 steps on random batches, two groups (one with its own lr), a parameter without a gradient, and an lr changed
    in param_groups halfway (as parts do): the same parameters bit for bit as torch.optim.SGD's step and zero_grad."""
    ref_net, net = _pair(dtype)
    ref, opt = torch.optim.SGD(_groups(ref_net), lr=0.1), torch.optim.SGD(_groups(net), lr=0.1)
    assert is_plain_sgd(opt)
    gen = torch.Generator().manual_seed(1)
    for k in range(20):
        x, y = torch.randn(8, 6, generator=gen, dtype=dtype), torch.randint(0, 3, (8,), generator=gen)
        if k == 10:
            for o in (ref, opt):
                o.param_groups[1]["lr"] = 0.05
        ref.zero_grad(set_to_none=True)
        F.cross_entropy(ref_net[:3](x), y).backward()
        ref.step()
        clear_grads(opt)
        F.cross_entropy(net[:3](x), y).backward()
        sgd_step(opt)
    for p, q in zip(ref_net.parameters(), net.parameters()):
        assert torch.equal(p, q)
    assert all(p.grad is None for p in net[3].parameters())
    clear_grads(opt)
    assert all(p.grad is None for p in net.parameters())


def test_sparse_gradients_take_torch_sgd_step() -> None:
    """An embedding with sparse gradients (which _foreach_add_ does not take) steps as torch.optim.SGD does."""
    torch.manual_seed(0)
    ref, emb = nn.Embedding(10, 4, sparse=True), nn.Embedding(10, 4, sparse=True)
    emb.load_state_dict(ref.state_dict())
    o_ref, o = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(emb.parameters(), lr=0.5)
    idx = torch.tensor([1, 3, 3, 7])
    ref(idx).square().sum().backward()
    o_ref.step()
    emb(idx).square().sum().backward()
    sgd_step(o)
    assert torch.equal(ref.weight, emb.weight)


@pytest.mark.parametrize(
    "kwargs",
    [dict(momentum=0.9), dict(weight_decay=1e-4), dict(maximize=True), dict(lr=torch.tensor(0.1))],
)
def test_other_sgd_settings_are_not_plain(kwargs: dict) -> None:
    """Momentum, weight decay, maximize and a tensor lr keep torch.optim's own step; so do other optimizers."""
    params = list(nn.Linear(3, 2).parameters())
    assert not is_plain_sgd(torch.optim.SGD(params, **{"lr": 0.1, **kwargs}))
    assert not is_plain_sgd(torch.optim.Adam(params, lr=0.1))
    assert not is_plain_sgd(torch.optim.SGD([torch.zeros(2, dtype=torch.complex64, requires_grad=True)], lr=0.1))


class _Watch(FederatedCallback):
    """A no-op step hook: the federation takes its hooked step loop (with the per-step client context)."""

    def on_local_step_end(self, fed, client) -> None:
        pass


def test_federation_rounds_equal_torch_sgd_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three FedAvg rounds with flx's plain step, on both step loops (with and without step hooks), give the models of
    the same rounds with torch.optim's step (flx.clients told that the optimizer is not plain), bit for bit."""
    data = toy_data([9, 14, 6, 11], dtype=torch.float64)
    kw = dict(clients_per_round=3, local_steps=4, batch_size=4, lr=0.2, seed=3)
    runs = {}
    for name, parts, plain in (("fast", [], True), ("hooked", [_Watch()], True), ("torch", [], False)):
        if not plain:
            monkeypatch.setattr(clients, "is_plain_sgd", lambda opt: False)
        fed = make_fed(linear(dtype=torch.float64), data, parts, **kw)
        run_rounds(fed, 3)
        runs[name] = (params(fed.net), fed.train_loss)
    for name in ("fast", "hooked"):
        assert all(torch.equal(p, q) for p, q in zip(runs[name][0], runs["torch"][0])), name
        assert runs[name][1] == runs["torch"][1]


@pytest.mark.parametrize("label_rows", [1 << 16, 7])  # every step in one gather; groups of >= 7 rows (3 steps)
@pytest.mark.parametrize("y_dtype", [torch.int64, torch.float32])
def test_minibatches_are_one_gather_each(monkeypatch: pytest.MonkeyPatch, label_rows: int, y_dtype: torch.dtype):
    """``minibatches`` yields ``(x[rows], y[rows])`` of every step, in order, equal to one gather each; integer labels
    come from one gather per group of steps (views of it), float targets and the inputs from one gather a step."""
    monkeypatch.setattr(local_sgd, "LABEL_ROWS", label_rows)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, generator=gen), torch.randint(0, 5, (40,), generator=gen).to(y_dtype)
    steps = [torch.randint(0, 40, (n,), generator=gen) for n in (3, 3, 2, 3, 1, 3, 3)]
    got = list(minibatches(x, y, iter(steps)))
    assert len(got) == len(steps)
    for (xb, yb), rows in zip(got, steps):
        assert torch.equal(xb, x[rows]) and torch.equal(yb, y[rows]) and yb.dtype == y_dtype
        assert xb.storage_offset() == 0  # the inputs: a gather of their own, never a view into a larger one
    views = sum(yb.storage_offset() > 0 for _, yb in got)
    assert views == (0 if y_dtype.is_floating_point else {1 << 16: 6, 7: 4}[label_rows])
    assert list(minibatches(x, y, iter([]))) == []
