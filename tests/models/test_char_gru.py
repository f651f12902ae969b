"""Tests for ``CharGRU``, the DRFA paper's next-character RNN (embedding 50, one GRU layer of 50 units, linear head)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flx.errors import ConfigError
from flx.models.nets import CharGRU

VOCAB, SEQ = 81, 80  # LEAF Shakespeare: 80 characters + unknown, 80-character inputs


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_parameter_count_is_the_papers_model() -> None:
    """Embedding V E, GRU 3 H (E + H) + 2 * 3 H (input and hidden biases of gates r, z, n), head H C + C."""
    v = c = VOCAB
    e = h = 50
    model = CharGRU(input_shape=(SEQ,), num_classes=c)
    assert n_params(model.embed) == v * e
    assert n_params(model.gru) == 3 * h * (e + h) + 6 * h
    assert n_params(model.head) == h * c + c
    assert n_params(model) == v * e + 3 * h * (e + h) + 6 * h + h * c + c == 23481


def test_options_change_the_count_by_formula() -> None:
    model = CharGRU(input_shape=(12,), num_classes=7, vocab_size=9, embed_dim=4, hidden=6, num_layers=2)
    second_layer = 3 * 6 * (6 + 6) + 6 * 6
    assert n_params(model) == 9 * 4 + (3 * 6 * (4 + 6) + 6 * 6) + second_layer + 6 * 7 + 7


def test_output_shape_and_gradients() -> None:
    torch.manual_seed(0)
    model = CharGRU(input_shape=(SEQ,), num_classes=VOCAB)
    x = torch.randint(0, VOCAB, (4, SEQ))  # (B, L) int64 token ids
    logits = model(x)
    assert logits.shape == (4, VOCAB) and logits.dtype == torch.float32
    nn.functional.cross_entropy(logits, torch.arange(4)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_one_token_equals_the_gru_cell_from_a_zero_state() -> None:
    """For ``L = 1`` and ``h_0 = 0``: ``r = s(W_ir e + b_ir + b_hr)``, ``z = s(W_iz e + b_iz + b_hz)``,
    ``n = tanh(W_in e + b_in + r * b_hn)``, ``h_1 = (1 - z) * n``; the logits are ``W h_1 + b``."""
    torch.manual_seed(1)
    model = CharGRU(input_shape=(1,), num_classes=5, embed_dim=3, hidden=4)
    tokens = torch.tensor([[0], [3], [4]])
    e = model.embed.weight[tokens[:, 0]]  # (3, E)
    gi = e @ model.gru.weight_ih_l0.T + model.gru.bias_ih_l0  # (3, 3H): gates r, z, n
    bh = model.gru.bias_hh_l0
    r = torch.sigmoid(gi[:, :4] + bh[:4])
    z = torch.sigmoid(gi[:, 4:8] + bh[4:8])
    n = torch.tanh(gi[:, 8:] + r * bh[8:])
    expected = model.head((1 - z) * n)
    torch.testing.assert_close(model(tokens), expected)


def test_prediction_uses_the_last_position_and_no_other_sample() -> None:
    torch.manual_seed(2)
    model = CharGRU(input_shape=(6,), num_classes=10)
    x = torch.randint(0, 10, (5, 6))
    out = model(x)
    torch.testing.assert_close(model(x[2:3]), out[2:3])  # each row alone gives the same logits
    hidden, _ = model.gru(model.embed(x))
    torch.testing.assert_close(out, model.head(hidden[:, -1]))


def test_memorises_a_tiny_task() -> None:
    """Smoke check: the next token of 8 fixed sequences (the first token: the GRU must carry it) is learnt."""
    torch.manual_seed(0)
    model = CharGRU(input_shape=(5,), num_classes=8, embed_dim=16, hidden=32)
    x = torch.randint(0, 8, (8, 5))
    x[:, 0] = torch.arange(8)
    y = x[:, 0]
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    first = nn.functional.cross_entropy(model(x), y).item()
    for _ in range(60):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.1 * first
    assert torch.equal(model(x).argmax(-1), y)


def test_config_errors_are_one_line() -> None:
    with pytest.raises(ConfigError, match=r"model=gru needs token sequences \(L,\); got input_shape=\(1, 8, 8\)"):
        CharGRU(input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(ConfigError, match=r"model.hidden=\(0,\)"):
        CharGRU(input_shape=(8,), num_classes=10, hidden=0)
    with pytest.raises(ConfigError, match="model=gru needs integer token ids .* got torch.float32 inputs"):
        CharGRU(input_shape=(8,), num_classes=10)(torch.randn(2, 8))
