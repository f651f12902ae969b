"""CODASCA: rounds against an independent re-implementation, control variates cancel for one client, c = mean c_i."""

from __future__ import annotations

import pytest
import torch
from helpers import binary_store, linear, make_fed, run_rounds
from torch import nn

from flx.datamodules.datamodule import ClientStore
from flx.errors import ConfigError
from flx.losses import aucm
from flx.parts.xrisk.codasca import Codasca


def _data(pos: list[int], neg: list[int]) -> ClientStore:
    return binary_store(pos, neg, seed=1, shift=0.5)


def _net() -> nn.Module:
    return linear(4, 2, dtype=torch.float64)


def _reference(
    data: ClientStore,
    rounds: int,
    k: int,
    lr0: float,
    t0: int,
    decay: float,
    gamma: float,
    clip: float,
    wd: float,
    margin: float,
) -> dict[str, torch.Tensor]:
    """CODASCA written out directly (full participation, full-batch local steps, uniform weights)."""
    net = _net()
    w = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    shapes = [p.shape for p in net.parameters()]
    n, clients = w.numel(), range(len(data.client_indices))
    p_ratio = float((data.y == 1).double().mean())
    abz = torch.zeros(3, dtype=torch.float64)
    c = torch.zeros(n + 3, dtype=torch.float64)
    ci = {i: torch.zeros(n + 3, dtype=torch.float64) for i in clients}
    ref = torch.cat([w, torch.zeros(2, dtype=torch.float64)])
    ref_sum, count, stage = torch.zeros(n + 2, dtype=torch.float64), 0, 0

    def scores(wv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        weight, bias = wv[: shapes[0].numel()].view(shapes[0]), wv[shapes[0].numel() :]
        logits = x @ weight.T + bias
        return torch.sigmoid(logits[:, 1] - logits[:, 0])

    for r in range(rounds):
        if r * k // t0 != stage:
            ref, ref_sum, count, stage = ref_sum / count, torch.zeros_like(ref_sum), 0, r * k // t0
        lr = lr0 / decay**stage
        finals, new_ci = [], {}
        for i in clients:
            x, y = data.x[data.client_indices[i]], data.y[data.client_indices[i]]
            wk, ak, bk, alk = w.clone(), abz[0].clone(), abz[1].clone(), abz[2].clone()
            corr, acc = c - ci[i], torch.zeros(n + 3, dtype=torch.float64)
            for _ in range(k):
                vs = [t.clone().requires_grad_() for t in (wk, ak, bk, alk)]
                gw, ga, gb, _ = torch.autograd.grad(aucm.aucm(scores(vs[0], x), y, *vs[1:], p_ratio, margin), vs)
                acc[:n] += gw
                acc[n] += ga
                acc[n + 1] += gb
                wk = wk - lr * (gw.clamp(-clip, clip) + corr[:n] + (wk - ref[:n]) / gamma + wd * wk)
                ak = ak - lr * (ga + corr[n] + (ak - ref[n]) / gamma + wd * ak)
                bk = bk - lr * (gb + corr[n + 1] + (bk - ref[n + 1]) / gamma + wd * bk)
                galpha = 2 * (margin + bk - ak) - 2 * alk
                acc[n + 2] += galpha
                alk = torch.clamp(alk + lr * (galpha + corr[n + 2]), min=0)
            finals.append(torch.cat([wk, torch.stack([ak, bk, alk])]))
            new_ci[i] = acc / k
        mean = torch.stack(finals).mean(0)
        w, abz = mean[:n], mean[n:]
        c = c + sum(new_ci[i] - ci[i] for i in clients) / len(clients)
        ci = new_ci
        ref_sum, count = ref_sum + torch.cat([w, abz[:2]]), count + 1
    return {"w": w, "abz": abz, "c": c}


def test_rounds_match_the_written_out_algorithm() -> None:
    """3 rounds, 2 clients, K=3, a stage boundary at round 2 (t0=6): lr / decay and the reference = mean of the
    stage's global iterates; clipping active; control variates from round 2 on. Float64, 1e-12."""
    data = _data([4, 2], [6, 9])
    hp = {"t0": 6, "decay": 3.0, "gamma": 2.0, "clip": 0.05, "margin": 0.7}
    part = Codasca(**hp)
    net = _net()
    fed = make_fed(
        net,
        data,
        parts=[part],
        clients_per_round=2,
        local_steps=3,
        lr=0.4,
        batch_size=100,
        weighting="uniform",
        weight_decay=0.01,
    )
    run_rounds(fed, 3)
    ref = _reference(data, 3, 3, 0.4, wd=0.01, **hp)
    got = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(got, ref["w"], rtol=0, atol=1e-12)
    torch.testing.assert_close(part.state["abz"], ref["abz"], rtol=0, atol=1e-12)
    torch.testing.assert_close(part.state["c"], ref["c"], rtol=0, atol=1e-12)
    assert part.state["stage"] == 1 and part.lr == pytest.approx(0.4 / 3)
    assert part.state["abz"][2] > 0  # the dual variable moved off its bound


def test_with_one_client_the_control_variates_cancel() -> None:
    """N = 1: c = c_1 after every round, so CODASCA is CODA+ (control=none). To rounding, not bit for bit: the server
    forms c + (c_1^new - c_1), which equals c_1^new exactly only for some values (it passed bitwise on one CPU and
    failed on an AVX-512 one, whose gradients differ in the last bits)."""
    data = _data([5], [9])
    nets = []
    for control in ("grad_mean", "none"):
        nets.append(_net())
        fed = make_fed(
            nets[-1],
            data,
            parts=[Codasca(control=control, t0=4)],
            clients_per_round=1,
            local_steps=2,
            lr=0.3,
            batch_size=4,
            weighting="uniform",
        )
        run_rounds(fed, 4)
    for p, q in zip(nets[0].parameters(), nets[1].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-14)


def test_server_control_variate_is_the_mean_of_the_clients() -> None:
    data = _data([3, 4, 2], [5, 6, 8])
    part = Codasca()
    fed = make_fed(
        _net(), data, parts=[part], clients_per_round=3, local_steps=2, lr=0.2, batch_size=4, weighting="uniform"
    )
    run_rounds(fed, 3)
    mean_ci = torch.stack([fed.store.get(i, torch.device("cpu"))["c"] for i in range(3)]).mean(0)
    torch.testing.assert_close(part.state["c"], mean_ci, rtol=0, atol=1e-14)
    assert part.state["c"].abs().sum() > 0


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"control": "scaffold"}, "algo.control"),
        ({"alpha_grad": "x"}, "algo.alpha_grad"),
        ({"gamma": 0}, "gamma"),
        ({"clip": -1}, "algo.clip"),
        ({"p": 1.5}, "algo.p"),
    ],
)
def test_bad_options_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        Codasca(**kwargs)
