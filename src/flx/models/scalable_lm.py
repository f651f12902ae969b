r"""The width-scalable Transformer masked language model of HeteroFL and WHALE-FL (BERT-style, WikiText-2).

Papers: E. Diao, J. Ding, V. Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning for
Heterogeneous Clients", ICLR 2021, arXiv:2010.01264 (the Transformer's Scalers, head count kept); H. Su et al.,
"WHALE-FL: Wireless and Heterogeneity Aware Latency Efficient Federated Learning over Mobile Devices via Adaptive
Subnetwork Scheduling", arXiv:2405.00885 (a Transformer on WikiText-2; sizes from the authors' code: embedding 256, 8
heads, FFN 512, 4 layers, dropout 0.2, bptt 64); J. Devlin et al., "BERT", NAACL 2019, arXiv:1810.04805 (the
masked-LM objective, post-LN encoder, learned positions). Token ids ``x`` of shape ``(B, L)``:

.. math::
    h_0 = \mathrm{drop}(\mathrm{LN}_0(S(E_{tok}[x] + E_{pos}[0..L-1])))                         \qquad (B, L, d)

    a_j = S(W^o_j\, \mathrm{MHA}(S(W^q_j h), S(W^k_j h), S(W^v_j h)))                          \qquad (B, L, d)

    h' = \mathrm{LN}_{j,1}(h + \mathrm{drop}(a_j)), \qquad
    h_{j+1} = \mathrm{LN}_{j,2}(h' + \mathrm{drop}(S(W^2_j\, \mathrm{drop}(\mathrm{GELU}(S(W^1_j h'))))))

    \mathrm{logits} = W^{dec} h_N + b^{dec}                                                        \qquad (B, L, V)

    P = V_{in} d + L d + 2 d + N (4 d a + 2 d f + 3 a + f + 6 d) + d V + V   \qquad \text{(parameters)}

with ``S`` HeteroFL's :class:`~flx.models.scalable.Scaler`, ``heads`` heads over ``attn_dim`` (``a``), ``f`` = ``ffn``,
``V_in`` = ``vocab_size`` (default ``V + 1``: the last id is ``<mask>``, read, never predicted). The file owns the net,
its channel groups for :mod:`flx.models.width` (``embed``, per layer ``layer{j}.attn`` in ``heads`` blocks and
``layer{j}.ffn``) and the two layers that make a masked full net compute its sub-model exactly
(:class:`MaskedLayerNorm` over the kept ``embed`` channels, scores scaled by the sub-model's :math:`1/\sqrt{k_h}`).
Initialisation, the vocabulary, the Scalers' placement and the deviations from HeteroFL's code:
docs/whale.md#the-transformer-masked-lm.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flx.errors import ConfigError, bad_value
from flx.models.nets import as_shape, check_num_classes
from flx.models.scalable import Scaler, set_width
from flx.models.width import CLASSES, tag_width

__all__ = ["MaskedLayerNorm", "ScalableTransformerLM", "num_parameters"]

EMBED = "embed"


class MaskedLayerNorm(nn.LayerNorm):
    r"""LayerNorm over the kept channels :math:`A` of the last dimension only; 0 on the others.

    .. math::
        \mu = \tfrac{1}{|A|} \textstyle\sum_{i \in A} x_i, \quad
        \sigma^2 = \tfrac{1}{|A|} \textstyle\sum_{i \in A} (x_i - \mu)^2, \quad
        y_i = [i \in A] \big(\gamma_i (x_i - \mu) / \sqrt{\sigma^2 + \epsilon} + \beta_i\big)

    ``keep`` (a 0/1 vector, a plain attribute: never uploaded or checkpointed) is set by the net's ``set_width``;
    ``None`` (every channel) is ``nn.LayerNorm``.
    """

    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__(d, eps=eps)
        self.keep: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.keep is None:
            return super().forward(x)
        m = self.keep.to(x.dtype)
        k = m.sum()
        xc = (x - (x * m).sum(-1, keepdim=True) / k) * m  # (B, L, d), 0 outside A
        var = xc.square().sum(-1, keepdim=True) / k
        return (xc / torch.sqrt(var + self.eps) * self.weight + self.bias) * m


class _Attention(nn.Module):
    """Multi-head self-attention with per-tensor q, k, v, output maps: ``(B, L, d) -> (B, L, d)``."""

    def __init__(self, d: int, a: int, heads: int, group: str) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, a // heads
        self.active = self.head_dim  # k_h: the kept channels per head (set_width)
        self.q, self.k, self.v = (tag_width(nn.Linear(d, a), group, EMBED) for _ in range(3))
        self.o = tag_width(nn.Linear(a, d), EMBED, group)
        self.scaler = Scaler()

    def forward(self, h: Tensor) -> Tensor:
        b, length, _ = h.shape
        q, k, v = (self.scaler(f(h)).view(b, length, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.active)  # (B, H, L, L)
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, -1)  # (B, H, L, d_h) -> (B, L, a)
        return self.scaler(self.o(out))


class _Layer(nn.Module):
    """A post-LN encoder layer: ``LN(h + drop(MHA(h)))``, then ``LN(h + drop(FFN(h)))``."""

    def __init__(self, d: int, a: int, heads: int, ffn: int, dropout: float, j: int) -> None:
        super().__init__()
        self.attn = _Attention(d, a, heads, f"layer{j}.attn")
        self.ln1, self.ln2 = tag_width(MaskedLayerNorm(d), EMBED), tag_width(MaskedLayerNorm(d), EMBED)
        self.fc1 = tag_width(nn.Linear(d, ffn), f"layer{j}.ffn", EMBED)
        self.fc2 = tag_width(nn.Linear(ffn, d), EMBED, f"layer{j}.ffn")
        self.scaler, self.drop = Scaler(), nn.Dropout(dropout)

    def forward(self, h: Tensor) -> Tensor:
        h = self.ln1(h + self.drop(self.attn(h)))
        f = self.scaler(self.fc2(self.drop(F.gelu(self.scaler(self.fc1(h))))))  # (B, L, d) -> (B, L, ffn) -> ...
        return self.ln2(h + self.drop(f))


class ScalableTransformerLM(nn.Module):
    """The masked LM of HeteroFL / WHALE-FL (see the module docstring): token ids ``(B, L)`` -> logits ``(B, L, V)``.

    Args:
        input_shape: ``(seq_len,)``: the rows' length ``L`` (the number of learned positions).
        num_classes: ``V``, the output vocabulary (decoder rows).
        vocab_size: rows of the input embedding; ``None``: ``V + 1`` (the last id is ``<mask>``).
        embed: ``d``, the residual stream (embedding) width.
        heads: attention heads (kept by every sub-model).
        ffn: the FFN's hidden width.
        layers: encoder layers ``N``.
        dropout: dropout rate (embedding, both residual branches, inside the FFN).
        attn_dim: the attention's inner q / k / v width, a multiple of ``heads``; ``None``: ``embed`` (a sub-model's
            is ``heads * k_h``, which need not be its ``embed``).

    Attributes:
        width_groups: group -> full channel count; width_blocks: ``layer{j}.attn`` -> ``heads``.
    """

    def __init__(
        self,
        *,
        input_shape: Sequence[int],
        num_classes: int,
        vocab_size: int | None = None,
        embed: int = 256,
        heads: int = 8,
        ffn: int = 512,
        layers: int = 4,
        dropout: float = 0.2,
        attn_dim: int | None = None,
    ) -> None:
        super().__init__()
        shape, self.num_classes = as_shape(input_shape), check_num_classes(num_classes)
        if len(shape) != 1:
            raise ConfigError(f"model=transformer_scalable needs token sequences (L,); got input_shape={shape}")
        self.seq_len = shape[0]
        vocab = self.num_classes + 1 if vocab_size is None else _positive("model.vocab_size", vocab_size)
        d, heads, ffn = (_positive(f"model.{k}", v) for k, v in (("embed", embed), ("heads", heads), ("ffn", ffn)))
        layers, a = _positive("model.layers", layers), d if attn_dim is None else _positive("model.attn_dim", attn_dim)
        if a % heads:
            key, value = ("model.embed", d) if attn_dim is None else ("model.attn_dim", a)
            raise bad_value(key, value, f"must be a multiple of model.heads={heads} (the attention's per-head split)")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise bad_value("model.dropout", dropout, "must be a number in [0, 1)")
        self.heads, self.vocab_size = heads, vocab
        self.width_groups = {EMBED: d}
        for j in range(layers):
            self.width_groups |= {f"layer{j}.attn": a, f"layer{j}.ffn": ffn}
        self.width_blocks = {f"layer{j}.attn": heads for j in range(layers)}
        self.tok = tag_width(nn.Embedding(vocab, d), None, EMBED)  # (V_in, d): rows unscaled
        self.pos = tag_width(nn.Embedding(self.seq_len, d), None, EMBED)
        self.ln = tag_width(MaskedLayerNorm(d), EMBED)
        self.scaler, self.drop = Scaler(), nn.Dropout(dropout)
        self.layers = nn.ModuleList(_Layer(d, a, heads, ffn, dropout, j) for j in range(layers))
        self.decoder = tag_width(nn.Linear(d, self.num_classes), CLASSES, EMBED)
        self.apply(_init)

    def set_width(self, ratio: float, indices: Mapping[str, Tensor] | None = None) -> None:
        """Sets the Scalers' ``rho``, and from the sub-model's index sets (:func:`~flx.models.width.width_indices`;
        ``None``: every channel) the LayerNorms' kept ``embed`` channels and each attention's ``k_h``."""
        set_width(self, ratio)
        d, keep = self.width_groups[EMBED], None
        if indices is not None and EMBED in indices and len(indices[EMBED]) < d:
            keep = torch.zeros(d, dtype=self.decoder.weight.dtype, device=self.decoder.weight.device)
            keep[indices[EMBED].to(keep.device)] = 1
        for m in self.modules():
            if isinstance(m, MaskedLayerNorm):
                m.keep = keep
        for j, layer in enumerate(self.layers):
            kept = None if indices is None else indices.get(f"layer{j}.attn")
            layer.attn.active = layer.attn.head_dim if kept is None else len(kept) // self.heads

    def forward(self, x: Tensor) -> Tensor:
        """Maps token ids ``(B, L)`` (int64, ``L <= seq_len``) to logits ``(B, L, num_classes)``."""
        if x.is_floating_point():
            raise ConfigError(f"model=transformer_scalable needs integer token ids (data=wikitext2), got {x.dtype}")
        positions = torch.arange(x.shape[-1], device=x.device)
        h = self.drop(self.ln(self.scaler(self.tok(x) + self.pos(positions))))  # (B, L, d)
        for layer in self.layers:
            h = layer(h)
        return self.decoder(h)


def num_parameters(vocab_in: int, vocab_out: int, seq_len: int, d: int, a: int, ffn: int, layers: int) -> int:
    """The parameter count ``P`` of the module docstring."""
    per_layer = 4 * d * a + 2 * d * ffn + 3 * a + ffn + 6 * d
    return vocab_in * d + seq_len * d + 2 * d + layers * per_layer + d * vocab_out + vocab_out


def _positive(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_value(key, value, "must be an integer >= 1")
    return value


def _init(m: nn.Module) -> None:
    """BERT's initialisation: N(0, 0.02^2) weights, zero biases (LayerNorms keep scale 1, shift 0)."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)
