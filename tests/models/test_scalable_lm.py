"""The width-scalable Transformer masked LM (:mod:`flx.models.scalable_lm`): the masked full net is the extracted
small net (outputs and gradients, every width and extractor, fp64), the masked LayerNorm and the sub-model's softmax
scale by formula, ``set_width(1.0)`` restores the full net, channel groups and blocks, the parameter count, the config,
and one-line errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import raises_one_line
from torch import Tensor

from flx.config import precheck
from flx.models.build import net_from_config
from flx.models.scalable_lm import MaskedLayerNorm, ScalableTransformerLM, num_parameters
from flx.models.width import (
    CLASSES,
    apply_masks,
    channels,
    extract_state,
    local_entries,
    mask_grads,
    masks_from_indices,
    width_indices,
)

f64 = torch.float64
RATIOS = (1.0, 1 / 2, 1 / 4, 1 / 8)
MODES = ("prefix", "rolling", "random")
# V = 10 output words, 11 input ids (<mask>), L = 6; d = 16 and 2 heads of 8: width 1/8 keeps 2 embed channels and 1
# channel per head
SIZES = dict(input_shape=(6,), num_classes=10, embed=16, heads=2, ffn=24, layers=2, dropout=0.0)


def _lm(seed: int = 0, **kw: object) -> ScalableTransformerLM:
    """A tiny LM in fp64 with every parameter ~ N(0, 0.5^2) (LayerNorm scales and shifts included: not 1 and 0)."""
    torch.manual_seed(seed)
    net = ScalableTransformerLM(**{**SIZES, **kw}).to(f64)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.5)
    return net


def _batch(n: int = 3, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Token ids ``(n, 6)`` over the 11 input ids (the last is <mask>); targets: a word at about half the positions."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (n, 6), generator=g)
    y = torch.randint(0, 10, (n, 6), generator=g)
    return x, torch.where(torch.rand(n, 6, generator=g) < 0.5, y, -100)


def _loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def _small(indices: dict[str, Tensor], seed: int = 1) -> ScalableTransformerLM:
    """An independent LM with the sub-model's sizes: ``embed = k_e``, ``attn_dim = heads * k_h``, ``ffn = k_f``."""
    return _lm(seed, embed=len(indices["embed"]), attn_dim=len(indices["layer0.attn"]), ffn=len(indices["layer0.ffn"]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ratio", RATIOS)
def test_masked_full_net_is_the_extracted_small_net(ratio: float, mode: str) -> None:
    """Entries outside the width-``ratio`` index sets zeroed and ``set_width(ratio, indices)``: the full net computes
    what an LM of the sub-model's sizes (``d = ceil(rho 16)``, 2 heads of ``ceil(rho 8)``, ``ffn = ceil(rho 24)``)
    holding the slices ``W[I_out][:, I_in]`` computes (training mode, dropout 0, fp64), and its masked gradients are the
    small net's gradients on the slices and zero elsewhere."""
    full = _lm()
    indices = width_indices(full, ratio, mode, round_idx=3, generator=torch.Generator().manual_seed(7))
    masks = masks_from_indices(full, indices)
    small = _small(indices)
    assert (small.width_groups["embed"], small.layers[0].attn.head_dim) == (channels(ratio, 16), channels(ratio, 8))
    small.load_state_dict(extract_state(full, indices), strict=True)
    apply_masks([t for _, t in local_entries(full)], masks)
    full.set_width(ratio, indices=indices)
    small.set_width(ratio)
    x, y = _batch()

    out_full, out_small = full(x), small(x)
    assert out_full.shape == (3, 6, 10)
    torch.testing.assert_close(out_full, out_small, rtol=1e-12, atol=1e-12)

    _loss(out_full, y).backward()
    _loss(out_small, y).backward()
    params = [p for _, p in local_entries(full)]
    mask_grads(params, masks)
    grads = extract_state(full, indices, [p.grad for p in params])
    scale = max(float(p.grad.abs().max()) for p in small.parameters())
    for (name, p), m in zip(local_entries(full), masks):
        assert not p.grad[m == 0].any(), name
        torch.testing.assert_close(grads[name], small.get_parameter(name).grad, rtol=1e-9, atol=1e-11 * scale)


@pytest.mark.parametrize("ratio", [1 / 2, 1 / 8])
def test_without_the_indices_the_masked_net_is_not_the_sub_model(ratio: float) -> None:
    """The two layers that read the kept channels matter: ``set_width(ratio)`` alone (full-width LayerNorm over zeroed
    channels, the full ``1 / sqrt(d_h)``) computes something else than the small net."""
    full = _lm()
    indices = width_indices(full, ratio, "prefix")
    small = _small(indices)
    small.load_state_dict(extract_state(full, indices))
    apply_masks([t for _, t in local_entries(full)], masks_from_indices(full, indices))
    full.set_width(ratio)
    small.set_width(ratio)
    x, _ = _batch()
    assert (full(x) - small(x)).abs().max() > 1e-3


def test_set_width_one_restores_the_full_net() -> None:
    """After a sub-model (LayerNorms over 8 channels, ``k_h = 4``), ``set_width(1.0)`` gives back every channel and
    ``1 / sqrt(d_h)``: the output is that of the untouched net."""
    net, ref = _lm(), _lm()
    x, _ = _batch()
    net.set_width(0.5, indices=width_indices(net, 0.5, "random", generator=torch.Generator().manual_seed(0)))
    assert all(m.keep is not None and int(m.keep.sum()) == 8 for m in net.modules() if isinstance(m, MaskedLayerNorm))
    assert [layer.attn.active for layer in net.layers] == [4, 4]
    net.set_width(1.0)
    assert all(m.keep is None for m in net.modules() if isinstance(m, MaskedLayerNorm))
    assert [layer.attn.active for layer in net.layers] == [8, 8]
    torch.testing.assert_close(net(x), ref(x), rtol=0, atol=0)


def test_masked_layernorm_normalises_over_the_kept_channels_only() -> None:
    """``y_i = [i in A] (gamma_i (x_i - mu_A) / sqrt(var_A + eps) + beta_i)``, mean and biased variance over the
    ``|A|`` kept channels; ``keep=None`` is ``nn.LayerNorm``."""
    torch.manual_seed(0)
    ln = MaskedLayerNorm(6).to(f64)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(2, 3, 6, dtype=f64)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (6,), ln.weight, ln.bias, 1e-5), rtol=0, atol=0)
    kept = [0, 2, 5]
    ln.keep = torch.zeros(6, dtype=f64)
    ln.keep[kept] = 1
    xa = x[..., kept]
    mu, var = xa.mean(-1, keepdim=True), xa.var(-1, unbiased=False, keepdim=True)
    expected = torch.zeros_like(x)
    expected[..., kept] = (xa - mu) / torch.sqrt(var + 1e-5) * ln.weight[kept] + ln.bias[kept]
    torch.testing.assert_close(ln(x), expected, rtol=1e-14, atol=1e-14)


def test_attention_scales_a_head_by_its_kept_channels() -> None:
    """One layer, one head of ``d_h = 4`` with a single kept q/k/v channel ``c``: the scores are
    ``q_c k_c / sqrt(1)``, so the attention output is ``softmax(q_c k_c^T) v_c`` in channel ``c`` and 0 elsewhere."""
    net = _lm(embed=4, heads=1, ffn=4, layers=1)
    attn = net.layers[0].attn
    h = torch.randn(2, 6, 4, dtype=f64)
    c = 2
    with torch.no_grad():
        for lin in (attn.q, attn.k, attn.v):
            keep = torch.zeros(4, 1, dtype=f64)
            keep[c] = 1
            lin.weight.mul_(keep)
            lin.bias.mul_(keep[:, 0])
    net.set_width(1.0, indices={"layer0.attn": torch.tensor([c])})
    q, k, v = (lin(h)[..., c] for lin in (attn.q, attn.k, attn.v))  # (2, 6) each
    inner = torch.zeros(2, 6, 4, dtype=f64)
    weights = (q[:, :, None] * k[:, None, :] / math.sqrt(1)).softmax(-1)  # (2, 6, 6): position t attends to s
    inner[..., c] = torch.einsum("bts,bs->bt", weights, v)
    torch.testing.assert_close(attn(h), attn.o(inner), rtol=1e-13, atol=1e-13)


def test_groups_blocks_and_tags() -> None:
    """``embed`` is one group; per layer ``attn`` (2 blocks: the heads) and ``ffn``; the vocabulary is unscaled: the
    embeddings' rows untagged, the decoder's rows :data:`CLASSES`. No buffers: the upload is the parameters."""
    net = _lm()
    assert net.width_groups == {"embed": 16, "layer0.attn": 16, "layer0.ffn": 24, "layer1.attn": 16, "layer1.ffn": 24}
    assert net.width_blocks == {"layer0.attn": 2, "layer1.attn": 2}
    assert net.tok.width_dims == {"weight": (None, "embed")} and net.tok.weight.shape == (11, 16)
    assert net.decoder.width_dims == {"weight": (CLASSES, "embed"), "bias": (CLASSES,)}
    assert net.layers[1].attn.o.width_dims["weight"] == ("embed", "layer1.attn")
    assert net.layers[0].fc1.width_dims["weight"] == ("layer0.ffn", "embed")
    assert list(net.buffers()) == [] and len(local_entries(net)) == len(list(net.parameters()))
    idx = width_indices(net, 0.25, "prefix")
    assert idx["layer0.attn"].tolist() == [0, 1, 8, 9]  # every head keeps ceil(8 / 4) = 2 channels


def test_parameter_count_is_the_formula() -> None:
    """``P = V_in d + L d + 2 d + N (4 d a + 2 d f + 3 a + f + 6 d) + d V + V``, for a tiny net counted by torch and
    for the paper's sizes on WikiText-2's 33,278 words (V_in = 33,279 with <mask>): 19,197,182."""
    net = _lm(attn_dim=6, heads=3)
    assert sum(p.numel() for p in net.parameters()) == num_parameters(11, 10, 6, 16, 6, 24, 2)
    assert num_parameters(33_279, 33_278, 64, 256, 256, 512, 4) == 19_197_182
    per_layer = 4 * 256 * 256 + 2 * 256 * 512 + 3 * 256 + 512 + 6 * 256
    assert 19_197_182 == 33_279 * 256 + 64 * 256 + 512 + 4 * per_layer + 256 * 33_278 + 33_278


def test_config_builds_the_paper_net() -> None:
    """``model=transformer_scalable``: embed 256, 8 heads, FFN 512, 4 layers, dropout 0.2 (WHALE-FL's released code);
    ``L`` and ``V`` come from the data (here 64 and a small vocabulary of 50 words)."""
    cfg = precheck(["model=transformer_scalable", "data=digits"])
    m = cfg.model
    assert (m.embed, m.heads, m.ffn, m.layers, m.dropout, m.attn_dim, m.vocab_size) == (256, 8, 512, 4, 0.2, None, None)
    net = net_from_config(m, (64,), 50)
    assert net.seq_len == 64 and net.tok.weight.shape == (51, 256) and net.decoder.weight.shape == (50, 256)
    assert sum(p.numel() for p in net.parameters()) == num_parameters(51, 50, 64, 256, 256, 512, 4)
    assert {k: len(v) for k, v in width_indices(net, 1 / 16, "prefix").items()}["layer3.attn"] == 8 * 2


def test_errors_are_one_line() -> None:
    raises_one_line(ScalableTransformerLM, **{**SIZES, "embed": 10, "heads": 4}, match="model.embed=10: must be a")
    raises_one_line(ScalableTransformerLM, **{**SIZES, "attn_dim": 9}, match="model.attn_dim=9: must be a multiple")
    raises_one_line(ScalableTransformerLM, **{**SIZES, "dropout": 1.0}, match="model.dropout=1.0")
    raises_one_line(ScalableTransformerLM, **{**SIZES, "layers": 0}, match="model.layers=0")
    raises_one_line(ScalableTransformerLM, **{**SIZES, "input_shape": (1, 8, 8)}, match="needs token sequences")
    raises_one_line(_lm(), torch.zeros(2, 6), match="needs integer token ids")


def test_eval_mode_ignores_scalers_and_dropout() -> None:
    """In ``eval()`` the Scalers and dropout are the identity: a net with dropout 0.5 at width 1/2 (no indices)
    computes the dropout-free full net."""
    net, ref = _lm(dropout=0.5), _lm()
    net.set_width(0.5)
    x, _ = _batch()
    torch.testing.assert_close(net.eval()(x), ref.eval()(x), rtol=0, atol=0)
    with torch.no_grad():
        assert not torch.allclose(net.train()(x), ref.train()(x))
