"""Width index sets and masks (:mod:`flx.models.width`): ``k = ceil(rho C)``, the prefix / rolling / random formulas,
mask sizes as formulas, the label-aware output layer, the count-mean merge of extracted sub-models (one client: the
identity on its slice; two widths: the hand computation) and the masks' alignment with the federation's upload."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import make_fed, raises_one_line, run_rounds
from torch import Tensor

from flx.aggregation import CountMean
from flx.datamodules.datamodule import ClientStore
from flx.hooks import FederatedCallback
from flx.models.scalable import ScalableCNN, ScalableResNet18
from flx.models.width import (
    apply_masks,
    channels,
    local_entries,
    mask_grads,
    masks_from_indices,
    width_indices,
    width_masks,
)

f64 = torch.float64
RATIOS = (1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16)
WIDTHS = (16, 16, 32, 48)


def _cnn(seed: int = 0, widths: tuple[int, ...] = WIDTHS, in_ch: int = 2) -> ScalableCNN:
    torch.manual_seed(seed)
    return ScalableCNN(input_shape=(in_ch, 8, 8), num_classes=5, widths=widths).to(f64)


@pytest.mark.parametrize("c", [1, 3, 16, 64, 100])
@pytest.mark.parametrize("ratio", RATIOS)
def test_channels_is_the_ceiling_with_at_least_one(ratio: float, c: int) -> None:
    assert channels(ratio, c) == max(1, math.ceil(ratio * c))


def test_channels_rounds_off_float_noise_and_rejects_bad_ratios() -> None:
    assert 0.28 * 25 > 7 and channels(0.28, 25) == 7  # ceil of the float product would give 8
    for bad in (0.0, -0.5, 1.5):
        raises_one_line(channels, bad, 8, match="expected a ratio in (0, 1]")


@pytest.mark.parametrize("ratio", RATIOS)
def test_prefix_masks_have_the_sub_model_sizes(ratio: float) -> None:
    """Prefix: group ``j`` keeps channels ``[0, k_j)``, ``k_j = ceil(rho C_j)``; a conv's mask holds ``9 k_j k_{j-1}``
    ones (``k_{-1}`` = the 2 input channels, unscaled), an sBN's scale and shift ``k_j`` each, the head ``5 k_3 + 5``
    (every class). For every ratio down to 1/16 each group keeps at least one channel."""
    net = _cnn()
    indices = width_indices(net, ratio, "prefix")
    k = [channels(ratio, c) for c in WIDTHS]
    assert [indices[f"block{j}"].tolist() for j in range(4)] == [list(range(kj)) for kj in k]
    sums = [int(m.sum()) for m in masks_from_indices(net, indices)]
    per_block = [[9 * kj * ki, kj, kj] for ki, kj in zip((2, *k[:-1]), k)]
    assert sums == [s for block in per_block for s in block] + [5 * k[-1], 5]


@pytest.mark.parametrize("r", [0, 1, 5, 15, 16, 19, 33])
def test_rolling_indices_follow_the_fedrolex_formula(r: int) -> None:
    """``roll(arange(C), r % C)[:k] = [(j - r) mod C for j < k]``: the window moves one channel per round."""
    net = _cnn()
    indices = width_indices(net, 0.25, "rolling", round_idx=r)
    for g, c in net.width_groups.items():
        k = math.ceil(0.25 * c)
        assert indices[g].tolist() == [(j - r) % c for j in range(k)], g


def test_random_indices_are_one_seeded_randperm_per_group() -> None:
    """``randperm(C)[:k]`` per group, in ``width_groups`` order, from the generator: deterministic for a seed,
    distinct channels of the right count, and other seeds give other sets."""
    net = _cnn()
    a = width_indices(net, 0.5, "random", generator=torch.Generator().manual_seed(3))
    b = width_indices(net, 0.5, "random", generator=torch.Generator().manual_seed(3))
    c = width_indices(net, 0.5, "random", generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(3)
    for name, size in net.width_groups.items():
        expected = torch.randperm(size, generator=g)[: math.ceil(0.5 * size)]
        assert a[name].tolist() == b[name].tolist() == expected.tolist()
        assert len(set(a[name].tolist())) == size // 2 and 0 <= int(a[name].min()) and int(a[name].max()) < size
    assert any(a[n].tolist() != c[n].tolist() for n in net.width_groups)


def _blocked(blocks: dict[str, int] | None) -> torch.nn.Module:
    """A bare net with groups ``a`` (12 channels) and ``heads`` (12 channels); ``blocks``: its ``width_blocks``."""
    net = torch.nn.Module()
    net.width_groups = {"a": 12, "heads": 12}
    if blocks is not None:
        net.width_blocks = blocks
    return net


def test_blocked_prefix_keeps_the_first_k_of_each_block() -> None:
    """``heads``: 3 blocks of ``c = 4``; width 1/2 keeps ``k = 2`` per block: ``{0, 1, 4, 5, 8, 9}``; width 1/4 keeps
    one per block; the unlisted group ``a`` is one block (``k = ceil(12 rho)``)."""
    net = _blocked({"heads": 3})
    assert width_indices(net, 0.5, "prefix")["heads"].tolist() == [0, 1, 4, 5, 8, 9]
    assert width_indices(net, 0.25, "prefix")["heads"].tolist() == [0, 4, 8]
    assert width_indices(net, 0.25, "prefix")["a"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("r", [0, 1, 3, 6])
def test_blocked_rolling_rolls_each_blocks_window(r: int) -> None:
    """Block ``h`` keeps ``h c + ((j - r) mod c)`` for ``j < k``: ``c = 4``, ``k = 2``, listed block by block."""
    got = width_indices(_blocked({"heads": 3}), 0.5, "rolling", round_idx=r)["heads"].tolist()
    assert got == [h * 4 + (j - r) % 4 for h in range(3) for j in range(2)]


def test_blocked_random_is_one_randperm_per_block_in_order() -> None:
    """Groups in order (``a``: one ``randperm(12)``), then per block of ``heads`` one ``randperm(4)[:k]`` shifted
    by ``4 h``, all from the one generator."""
    got = width_indices(_blocked({"heads": 3}), 0.5, "random", generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    assert got["a"].tolist() == torch.randperm(12, generator=g)[:6].tolist()
    expected = [4 * h + int(i) for h in range(3) for i in torch.randperm(4, generator=g)[:2]]
    assert got["heads"].tolist() == expected
    assert [sorted(i // 4 for i in got["heads"].tolist()).count(h) for h in range(3)] == [2, 2, 2]


@pytest.mark.parametrize("mode", ["prefix", "rolling", "random"])
def test_no_blocks_or_one_block_is_the_unblocked_formula(mode: str) -> None:
    """``width_blocks`` absent, empty or 1 for a group: the index sets and the random stream are unchanged."""
    sets = [
        width_indices(_blocked(b), 0.25, mode, round_idx=5, generator=torch.Generator().manual_seed(1))
        for b in (None, {}, {"a": 1, "heads": 1})
    ]
    assert all(s[g].tolist() == sets[0][g].tolist() for s in sets for g in ("a", "heads"))
    if mode == "random":  # the second group's draw is the second randperm(12) of the stream
        g = torch.Generator().manual_seed(1)
        torch.randperm(12, generator=g)
        assert sets[0]["heads"].tolist() == torch.randperm(12, generator=g)[:3].tolist()


def test_resnet_shortcut_and_residual_stream_share_the_blocks_indices() -> None:
    """Random mode: a stage's residual stream is one index set, so the 1x1 shortcut's output rows are conv2's and
    its input columns are conv1's (the previous stage's stream); identity shortcuts add matching channels."""
    torch.manual_seed(0)
    net = ScalableResNet18(input_shape=(3, 8, 8), num_classes=4, widths=(8, 8, 16, 16))
    masks = dict(zip([n for n, _ in local_entries(net)], width_masks(net, 0.5, "random", generator=torch.Generator())))
    rows = lambda n: masks[n].flatten(1).amax(1)  # noqa: E731  (B, ...) -> which output channels are kept
    cols = lambda n: masks[n].amax(dim=(0, 2, 3))  # noqa: E731
    assert torch.equal(rows("layer2.0.shortcut.0.weight"), rows("layer2.0.unit2.0.weight"))
    assert torch.equal(cols("layer2.0.shortcut.0.weight"), cols("layer2.0.unit1.0.weight"))
    assert torch.equal(cols("layer2.0.unit1.0.weight"), rows("layer1.1.unit2.0.weight"))
    assert torch.equal(rows("layer1.0.unit2.0.weight"), rows("stem.0.weight"))  # identity shortcut: one stream
    assert not torch.equal(rows("layer1.0.unit1.0.weight"), rows("stem.0.weight"))  # a block's hidden set is its own


def test_label_aware_head_keeps_the_clients_class_rows_and_needs_the_gradient_mask() -> None:
    """``classes=[1, 3]``: the head's rows 1 and 3 (times the kept features) and bias entries 1 and 3. The softmax
    gives the other rows a gradient although their weights are zero, so the core's gradient mask is what keeps them."""
    net = _cnn()
    masks = width_masks(net, 0.5, "prefix", classes=[1, 3])
    w_mask, b_mask = masks[-2], masks[-1]
    assert b_mask.tolist() == [0, 1, 0, 1, 0]
    assert torch.equal(w_mask, b_mask[:, None] * (torch.arange(48) < 24).to(f64)[None])
    apply_masks(list(net.parameters()), masks)
    x = torch.randn(4, 2, 8, 8, dtype=f64)
    F.cross_entropy(net(x), torch.tensor([1, 3, 1, 3])).backward()
    head = net.head.weight.grad
    assert head[[0, 2, 4]][:, :24].abs().sum() > 0
    mask_grads(list(net.parameters()), masks)
    assert not head[[0, 2, 4]].any() and not net.head.bias.grad[[0, 2, 4]].any()


def test_errors_are_one_line() -> None:
    raises_one_line(width_indices, _cnn(), 0.5, "sorted", match="allowed: prefix, rolling, random")
    raises_one_line(width_masks, torch.nn.Linear(3, 2), 0.5, "prefix", match="not a width-scalable net")


def _trained(w: list[Tensor], masks: list[Tensor], seed: int) -> list[Tensor]:
    """A client's upload: ``w`` zeroed outside its masks, plus a masked perturbation (its local training)."""
    g = torch.Generator().manual_seed(seed)
    return [(t + torch.randn(t.shape, generator=g, dtype=t.dtype)) * m for t, m in zip(w, masks)]


def test_one_client_merge_is_the_identity_on_its_slice_and_keeps_the_rest() -> None:
    """CountMean with one client of mask ``m``: ``w' = m * u + (1 - m) * w``; an untrained extraction (``u = m w``)
    merges back to ``w`` exactly."""
    w = [p.detach().clone() for p in _cnn().parameters()]
    masks = width_masks(_cnn(), 0.5, "rolling", round_idx=7)
    agg = CountMean(w)
    agg.reset()
    agg.update([t * m for t, m in zip(w, masks)], masks=masks)  # extracted, not trained
    for o, prev in zip(agg.compute(w), w):
        torch.testing.assert_close(o, prev, rtol=0, atol=0)
    u = _trained(w, masks, seed=0)
    agg.reset()
    agg.update(u, masks=masks)
    for o, m, a, prev in zip(agg.compute(w), masks, u, w):
        torch.testing.assert_close(o, m * a + (1 - m) * prev, rtol=0, atol=0)


def test_two_widths_merge_is_the_per_entry_mean_over_covering_clients() -> None:
    """Prefix widths 1/2 (client a) and 1/4 (client b, nested in a): on b's slice ``(u_a + u_b) / 2``, on a's slice
    outside b's ``u_a``, elsewhere ``w`` (WHALE-FL Eq. 1's regions)."""
    net = _cnn()
    w = [p.detach().clone() for p in net.parameters()]
    m_a, m_b = width_masks(net, 0.5, "prefix"), width_masks(net, 0.25, "prefix")
    u_a, u_b = _trained(w, m_a, 1), _trained(w, m_b, 2)
    agg = CountMean(w)
    agg.reset()
    agg.update(u_a, masks=m_a)
    agg.update(u_b, masks=m_b)
    for o, a, b, ma, mb, prev in zip(agg.compute(w), u_a, u_b, m_a, m_b, w):
        assert torch.equal(ma * mb, mb)  # nested
        expected = mb * (a + b) / 2 + (ma - mb) * a + (1 - ma) * prev
        torch.testing.assert_close(o, expected, rtol=1e-15, atol=1e-15)


class _Width(FederatedCallback):
    """Test part: client ``c`` trains the prefix sub-model of width ``RATIO[c]`` (what the scheduler part will do)."""

    RATIO = {0: 0.5, 1: 0.25}

    def __init__(self) -> None:
        self.uploads: dict[int, list[Tensor]] = {}

    def on_client_start(self, fed, client) -> None:
        client.masks = width_masks(fed.net, self.RATIO[client.cid], "prefix")
        assert [m.shape for m in client.masks] == [t.shape for t in fed.local_state]
        apply_masks(fed.local_state, client.masks)
        fed.net.set_width(self.RATIO[client.cid])

    def on_local_grad(self, fed, client) -> None:
        mask_grads(fed.params, client.masks)

    def on_client_end(self, fed, client) -> None:
        fed.net.set_width(1.0)
        self.uploads[client.cid] = [t.detach().clone() for t in fed.local_state]


def test_a_federated_round_with_width_masks_merges_by_count() -> None:
    """One round through the core (``aggregator=count_mean``): each upload is zero outside its client's masks, and
    the global model is the two-width hand computation of the test above."""
    g = torch.Generator().manual_seed(0)
    data = ClientStore(torch.randn(12, 2, 8, 8, generator=g, dtype=f64), torch.randint(0, 5, (12,), generator=g),
                       [torch.arange(6), torch.arange(6, 12)])  # fmt: skip
    net = _cnn()
    w0 = [p.detach().clone() for p in net.parameters()]
    part = _Width()
    fed = make_fed(net, data, [part], clients_per_round=2, local_steps=2, batch_size=3, aggregator="count_mean")
    run_rounds(fed, 1)
    m_a, m_b = width_masks(net, 0.5, "prefix"), width_masks(net, 0.25, "prefix")
    u_a, u_b = part.uploads[0], part.uploads[1]
    for p, a, b, ma, mb, prev in zip(net.parameters(), u_a, u_b, m_a, m_b, w0):
        assert not a[ma == 0].any() and not b[mb == 0].any()
        expected = mb * (a + b) / 2 + (ma - mb) * a + (1 - ma) * prev
        torch.testing.assert_close(p.detach(), expected, rtol=1e-14, atol=1e-14)
