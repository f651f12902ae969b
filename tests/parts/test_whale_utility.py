"""WHALE-FL's scheduling maths: the Eq. 9 boundaries, the cap, the ablations, TE (Eq. 5) and FI per batch (Eq. 3)
against hand computations on a linear softmax model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flx.models.scalable import ScalableCNN
from flx.models.scalable_lm import ScalableTransformerLM
from flx.models.width import apply_masks, local_entries, masks_from_indices, width_indices
from flx.parts.systems import whale_utility as wu
from flx.tasks import MaskedLM


@pytest.mark.parametrize(("u_n", "p"), [(0.8, 1), (0.6, 2), (0.4, 3), (0.2, 4), (0.19, 5), (0.0, 5), (0.7999, 2)])
def test_quantise_boundaries(u_n: float, p: int) -> None:
    """Eq. 9 for P = 5: U_n >= 0.8 -> 1, [0.6, 0.8) -> 2, [0.4, 0.6) -> 3, [0.2, 0.4) -> 4, < 0.2 -> 5."""
    assert wu.quantise(u_n, 5) == p


@pytest.mark.parametrize("util", [50.0, 51.0, 1e9])
def test_utility_at_or_above_threshold_is_the_full_model(util: float) -> None:
    """Eq. 7: U_n = min(Util / U_th, 1) = 1 -> level 1 (width 1)."""
    assert wu.level(util, u_th=50.0, levels=5, p_max=1) == 1
    assert wu.width(1) == 1.0


def test_device_cap_takes_the_smaller_subnetwork() -> None:
    """Eq. 8: p = max(p_hat, p_max): a Nano (p_max 4) never trains more than level 4; a weak utility stays small."""
    assert wu.level(100.0, u_th=10.0, levels=5, p_max=4) == 4
    assert wu.level(0.5, u_th=10.0, levels=5, p_max=2) == 5  # U_n = 0.05 -> p_hat 5
    assert wu.level(6.5, u_th=10.0, levels=5, p_max=3) == 3  # U_n = 0.65 -> p_hat 2, capped at 3
    assert [wu.width(p) for p in range(1, 6)] == [1.0, 0.5, 0.25, 0.125, 0.0625]


def test_utility_and_its_ablations() -> None:
    """Util = TE * (T / (T^co + T^tr))^beta; TE-only drops SE, SE-only drops TE."""
    te, t_co, t_tr, T, beta = 3.0, 0.75, 0.25, 2.0, 2.0
    se = T / (t_co + t_tr)
    assert wu.utility(te, t_co, t_tr, T=T, beta=beta) == pytest.approx(te * se**beta)
    assert wu.utility(te, t_co, t_tr, T=T, beta=beta, mode="te_only") == te
    assert wu.utility(te, t_co, t_tr, T=T, beta=beta, mode="se_only") == pytest.approx(se**beta)


def test_training_efficiency_by_hand() -> None:
    """Eq. 5 with D = 3 rounds of K = 2 batches, FI = (1, 2), (2, 2), (3, 1), |B| = 4: the window keeps each round's
    mean of FI^2 over its batches, TE = 4 sqrt((1 + 4 + 4 + 4 + 9 + 1) / 6)."""
    rounds = [(1.0, 2.0), (2.0, 2.0), (3.0, 1.0)]
    window = [sum(f * f for f in fi) / len(fi) for fi in rounds]
    assert wu.training_efficiency(window, 4) == pytest.approx(4 * math.sqrt(23 / 6), rel=1e-12)


def _linear_batch() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Linear(4, 3).double()
    g = torch.Generator().manual_seed(1)
    return net, torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)


def _per_sample_by_hand(net: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Softmax regression: grad_W l_n = (p_n - e_{y_n}) x_n^T, grad_b l_n = p_n - e_{y_n}, so
    ||g_n||^2 = ||p_n - e_{y_n}||^2 (||x_n||^2 + 1)."""
    with torch.no_grad():
        r = torch.softmax(net(x), dim=-1) - F.one_hot(y, 3).double()
    return (r**2).sum(1) * ((x**2).sum(1) + 1)


def test_trace_empirical_is_the_mean_per_sample_squared_norm() -> None:
    net, x, y = _linear_batch()
    fi = float(wu.batch_fisher_tensor(net, F.cross_entropy, x, y, None, "trace_empirical"))
    expected = _per_sample_by_hand(net, x, y).mean()
    assert fi == pytest.approx(float(expected), rel=1e-10)
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    batch_sq = sum(float((p.grad**2).sum()) for p in net.parameters()) * len(x)  # NOT the trace
    assert abs(batch_sq - fi) > 1e-3 * fi


def test_trace_with_masks_counts_only_the_sub_model() -> None:
    """A mask keeping only the bias: ||g_n||^2 = ||p_n - e_{y_n}||^2."""
    net, x, y = _linear_batch()
    masks = [torch.zeros_like(net.weight), torch.ones_like(net.bias)]
    with torch.no_grad():
        r = torch.softmax(net(x), dim=-1) - F.one_hot(y, 3).double()
    fi = float(wu.batch_fisher_tensor(net, F.cross_entropy, x, y, masks, "trace_empirical"))
    assert fi == pytest.approx(float((r**2).sum(1).mean()), rel=1e-10)


def test_trace_sampled_uses_labels_from_the_model() -> None:
    """Labels y_hat ~ Categorical(softmax(f(x))) from the given generator; then the empirical formula on y_hat."""
    net, x, y = _linear_batch()
    fi = float(
        wu.batch_fisher_tensor(
            net, F.cross_entropy, x, y, None, "trace_sampled", generator=torch.Generator().manual_seed(5)
        )
    )
    with torch.no_grad():
        probs = torch.softmax(net(x).double(), dim=-1)
    y_hat = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(5)).squeeze(-1)
    assert fi == pytest.approx(float(_per_sample_by_hand(net, x, y_hat).mean()), rel=1e-10)


def test_max_tensor_mean_is_the_authors_reduction() -> None:
    """max over tensors of mean(g^2) / |b| of the training gradient already in p.grad."""
    net, x, y = _linear_batch()
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    fi = float(wu.batch_fisher_tensor(net, F.cross_entropy, x, y, None, "max_tensor_mean"))
    expected = max(float((net.weight.grad**2).mean()), float((net.bias.grad**2).mean())) / len(x)
    assert fi == pytest.approx(expected, rel=1e-12)


def test_static_bn_per_sample_grads_use_the_batch_statistics() -> None:
    """With sBN, each sample is normalised by the batch's statistics (held fixed): the sum of the per-sample squared
    norms of a one-sample batch is that sample's gradient norm; modes and statistics are restored."""
    torch.manual_seed(0)
    net = ScalableCNN(input_shape=(1, 8, 8), num_classes=3, widths=[2, 3, 3, 4]).double().train()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(5, 1, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g)
    ones = [torch.ones_like(p) for p in net.parameters()]
    sq = wu.per_sample_sq_norms(net, F.cross_entropy, x, y, ones)
    # sample 0 with the batch's statistics, by hand: eval-mode sBN given stat_mean / stat_var of the batch
    stats = wu._batch_stats(net, [m for m in net.modules() if hasattr(m, "stat_mean")], x)
    for m, (mean, var) in stats.items():
        m.stat_mean, m.stat_var, m.training = mean, var, False
    net.zero_grad()
    F.cross_entropy(net(x[:1]), y[:1]).backward()
    assert float(sq[0]) == pytest.approx(sum(float((p.grad**2).sum()) for p in net.parameters()), rel=1e-9)
    net.train()
    for m in stats:
        m.stat_mean = m.stat_var = None
    wu.per_sample_sq_norms(net, F.cross_entropy, x, y, ones)
    assert all(m.training and m.stat_mean is None for m in stats)


def _lm_batch(dropout: float = 0.0) -> tuple[ScalableTransformerLM, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """A tiny masked LM at width 1/2 (prefix: masked entries zeroed, ``set_width(1/2, indices)``), 4 rows of 6 token
    ids; row 2 has no scored position."""
    torch.manual_seed(0)
    net = ScalableTransformerLM(input_shape=(6,), num_classes=7, embed=8, heads=2, ffn=8, layers=1, dropout=dropout)
    net = net.double().train()
    indices = width_indices(net, 0.5, "prefix")
    masks = masks_from_indices(net, indices)
    apply_masks([p for _, p in local_entries(net)], masks)
    net.set_width(0.5, indices=indices)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 8, (4, 6), generator=g)
    y = torch.full((4, 6), -100)
    y[0, 1], y[1, [0, 4, 5]], y[3, 2] = 3, torch.tensor([1, 6, 0]), 5
    return net, masks, x, y


def test_lm_per_sample_norms_are_each_rows_masked_gradient() -> None:
    """A sample is a row: ``||m * grad l(x_n, y_n)||^2`` with ``l`` the row's mean loss over its scored tokens (0 for
    row 2, which has none), the sub-model's masked LayerNorm and softmax scale included; fp64, dropout 0."""
    net, masks, x, y = _lm_batch()
    loss = MaskedLM().loss
    sq = wu.per_sample_sq_norms(net, loss, x, y, masks)
    for n in range(4):
        net.zero_grad()
        loss(net(x[n : n + 1]), y[n : n + 1]).backward()
        expected = sum(float(((p.grad * m) ** 2).sum()) for p, m in zip(net.parameters(), masks))
        assert float(sq[n]) == pytest.approx(expected, rel=1e-10)
    assert float(sq[2]) == 0.0 and float(sq[0]) > 0


def test_lm_fisher_with_dropout_draws_a_mask_per_sample() -> None:
    """Dropout in training mode inside ``vmap`` (``randomness="different"``): finite, reproducible from torch's seeded
    stream (the client's), and different from the dropout-free value."""
    net, masks, x, y = _lm_batch(dropout=0.3)
    loss = MaskedLM().loss
    torch.manual_seed(11)
    a = float(wu.batch_fisher_tensor(net, loss, x, y, masks, "trace_empirical"))
    torch.manual_seed(11)
    b = float(wu.batch_fisher_tensor(net, loss, x, y, masks, "trace_empirical"))
    for m in net.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    assert math.isfinite(a) and a == b and a != float(wu.batch_fisher_tensor(net, loss, x, y, masks, "trace_empirical"))


def test_lm_trace_sampled_draws_a_word_per_scored_position() -> None:
    """Token targets: ``y_hat_{bt} ~ softmax(f(x)_{bt})`` at the scored positions (one draw per position, rows in
    order), -100 kept elsewhere; then the empirical trace on ``y_hat``."""
    net, masks, x, y = _lm_batch()
    loss = MaskedLM().loss
    fi = float(
        wu.batch_fisher_tensor(net, loss, x, y, masks, "trace_sampled", generator=torch.Generator().manual_seed(5))
    )
    with torch.no_grad():
        probs = torch.softmax(net(x).double(), dim=-1)  # (4, 6, 7)
    drawn = torch.multinomial(probs.reshape(24, 7), 1, generator=torch.Generator().manual_seed(5)).view(4, 6)
    y_hat = torch.where(y < 0, y, drawn)
    assert fi == pytest.approx(float(wu.per_sample_sq_norms(net, loss, x, y_hat, masks).mean()), rel=1e-10)
