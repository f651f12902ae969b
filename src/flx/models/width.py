r"""Width sub-models as index sets and 0/1 masks over ONE full-width net (HeteroFL, FedRolex, Federated Dropout).

The core reuses one full-width net for every client; a client's sub-network of width ratio :math:`\rho` is realised by
masks: at client start the entries outside the sub-model are zeroed (:func:`apply_masks`), after each backward their
gradients are zeroed (:func:`mask_grads`), and ``client.masks`` tells ``algo.aggregator=count_mean`` which entries the
client holds (each entry is averaged over the clients covering it, uncovered entries keep :math:`w^t`; WHALE-FL
Eqs. 1-2, 10).

**Channel groups.** A width-scalable net (:mod:`flx.models.scalable`) names its hidden channel *groups* in
``net.width_groups`` (group -> full channel count :math:`C`) and tags each layer with the group of every dimension of
its tensors (:func:`tag_width`): a conv weight ``(out, in, k, k)`` is ``(g_out, g_in)``, its bias and a norm's scale
and shift ``(g_out,)``. ``None`` is an unscaled dimension (the input image's channels); :data:`CLASSES` is the output
dimension of the classifier, unscaled unless a client's ``classes`` are given (HeteroFL's label-aware output layer:
only the rows of the client's classes). A group is one index set: every layer that reads or writes those channels uses
the same indices, e.g. a ResNet stage's residual stream, which the identity shortcuts add together, is one group, and a
block's 1x1 shortcut conv is tagged with the block's input and output groups, tying its indices to the block's convs.

**Index sets** (one per group, :func:`width_indices`), with :math:`k = \lceil \rho C \rceil` (at least 1):

.. math::
    I^{\mathrm{prefix}} = \{0, \dots, k - 1\}                                   \qquad\text{(HeteroFL)}

    I^{\mathrm{rolling}}_r = \mathrm{roll}(0..C-1,\ r \bmod C)[:k]
        = \{(j - r) \bmod C : 0 \le j < k\}                                       \qquad\text{(FedRolex, round } r)

    I^{\mathrm{random}} = \mathrm{randperm}(C)[:k]                               \qquad\text{(Federated Dropout)}

The random draws take ``generator`` (the scheduler seeds it by ``(seed, round, client)``), one ``randperm`` per group in
``net.width_groups`` order.

**Blocked groups** (attention heads). A net may declare ``net.width_blocks`` (group -> ``b``; groups not listed have
``b = 1``): the group's ``C`` channels are ``b`` equal blocks of ``c = C / b`` (head ``h`` holds channels
``h c .. h c + c - 1``) and the index set keeps :math:`k = \lceil \rho c \rceil` channels **in each block**, by the
formulas above applied to the block (``C`` replaced by ``c``) and shifted by its offset:

.. math::
    I = \bigcup_{h=0}^{b-1} \{h c + i : i \in I_h\}, \qquad |I| = b k

(prefix: the first ``k`` of each block; rolling: each block's window rolled by ``r mod c``; random: one
``randperm(c)`` per block, blocks in order, from the same generator), listed block by block, so a sub-model keeps
every head with ``k`` channels each. With ``b = 1`` these are exactly the formulas above.

The **mask** of a tensor is the outer product of its dimensions' 0/1 selections (:func:`masks_from_indices`); masks
follow ``fed.local_state``: the trainable parameters, then the float buffers (:func:`local_entries`).
:func:`extract_state` slices the same index sets out into the state of an independent small net, which the tests use
to show that masking realises the sub-model exactly.

``k`` is computed as ``ceil(round(rho * C, 9))``: the rounding keeps ``ceil(0.28 * 25) = 7`` where the float product
``7.000000000000001`` would give 8; for the dyadic ratios of the papers (1, 1/2, ..., 1/16) it is the plain ceiling.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from flx.errors import bad_value

__all__ = [
    "CLASSES",
    "MODES",
    "apply_masks",
    "channels",
    "extract_state",
    "local_entries",
    "mask_grads",
    "masks_from_indices",
    "tag_width",
    "width_indices",
    "width_masks",
]

#: The group of the classifier's output dimension: unscaled, or the client's classes (label-aware output layer).
CLASSES = "classes"
#: Extraction modes: HeteroFL's static prefix, FedRolex's rolling window, Federated Dropout's random subset.
MODES = ("prefix", "rolling", "random")

Dims = tuple[str | None, ...]


def tag_width(module: nn.Module, out: str | None, inp: str | None = None) -> nn.Module:
    """Records the channel groups of ``module``'s tensors (``module.width_dims``: name -> group per dimension).

    Weights with two or more dimensions are ``(out, inp)`` (conv, linear); one-dimensional tensors (biases, a norm's
    scale and shift and any running statistics) are ``(out,)``. An embedding table ``(num_embeddings, dim)`` reads the
    same way: ``tag_width(nn.Embedding(V, d), None, "embed")`` leaves its rows unscaled. Returns ``module``.
    """
    dims: dict[str, Dims] = {}
    for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
        dims[name] = (out, inp) if t.dim() >= 2 else (out,)
    module.width_dims = dims
    return module


def channels(ratio: float, c: int) -> int:
    """``k = ceil(ratio * c)``, at least 1: the channels a width ``ratio`` keeps of a group of ``c``."""
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise bad_value("width ratio", ratio, "expected a ratio in (0, 1]")
    return max(1, min(c, math.ceil(round(ratio * c, 9))))


def local_entries(net: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` in the order of ``fed.local_state``: the trainable parameters, then the float buffers."""
    params = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    return params + [(n, b) for n, b in net.named_buffers() if b.is_floating_point()]


def width_indices(
    net: nn.Module, ratio: float, mode: str, *, round_idx: int = 0, generator: torch.Generator | None = None
) -> dict[str, Tensor]:
    """One index set per channel group of ``net.width_groups`` (int64, on the CPU), see the module docstring; a group
    of ``net.width_blocks`` keeps ``k`` channels in each of its blocks.

    Args:
        net: a width-scalable net (has ``width_groups``, optionally ``width_blocks``).
        ratio: width ratio ``rho`` in ``(0, 1]``.
        mode: ``prefix`` | ``rolling`` | ``random``.
        round_idx: the round ``r`` (``rolling``).
        generator: the stream of the ``random`` draws (None: torch's global one).
    """
    if mode not in MODES:
        raise bad_value("width mode", mode, f"allowed: {', '.join(MODES)}")
    groups: Mapping[str, int] = _groups(net)
    blocks: Mapping[str, int] = getattr(net, "width_blocks", None) or {}
    out = {}
    for name, size in groups.items():
        b = int(blocks.get(name, 1))
        if b < 1 or size % b:
            raise ValueError(f"{name}: {size} channels do not split into {b} equal blocks (net.width_blocks)")
        c = size // b
        k = channels(ratio, c)
        out[name] = torch.cat([h * c + _block_indices(c, k, mode, round_idx, generator) for h in range(b)])
    return out


def _block_indices(c: int, k: int, mode: str, round_idx: int, generator: torch.Generator | None) -> Tensor:
    """``k`` of the channels ``0..c-1`` of one block (one group when it has no blocks), by ``mode``."""
    if mode == "prefix":
        return torch.arange(k)
    if mode == "rolling":
        return torch.roll(torch.arange(c), int(round_idx) % c)[:k]
    return torch.randperm(c, generator=generator)[:k]


def masks_from_indices(
    net: nn.Module, indices: Mapping[str, Tensor], *, classes: Sequence[int] | Tensor | None = None
) -> list[Tensor]:
    """0/1 masks (each in its tensor's dtype and device) aligned with :func:`local_entries`.

    Args:
        net: a width-scalable net.
        indices: group -> kept channels (:func:`width_indices`).
        classes: the client's classes: the classifier keeps only these output rows (label-aware output layer); None
            keeps every class.
    """
    selections = dict(indices)
    if classes is not None:
        selections[CLASSES] = torch.as_tensor(classes, dtype=torch.long)
    masks = []
    for name, t in local_entries(net):
        mask = torch.ones_like(t)
        for d, group in enumerate(_dims(net, name)):
            if group in selections:
                keep = torch.zeros(t.shape[d], dtype=t.dtype, device=t.device)
                keep[selections[group].to(t.device)] = 1
                mask.mul_(keep.view(-1, *([1] * (t.dim() - d - 1))))  # broadcast along dimension d
        masks.append(mask)
    return masks


def width_masks(
    net: nn.Module,
    ratio: float,
    mode: str,
    *,
    round_idx: int = 0,
    generator: torch.Generator | None = None,
    classes: Sequence[int] | Tensor | None = None,
) -> list[Tensor]:
    """The masks of the width-``ratio`` sub-model: :func:`width_indices`, then :func:`masks_from_indices`."""
    indices = width_indices(net, ratio, mode, round_idx=round_idx, generator=generator)
    return masks_from_indices(net, indices, classes=classes)


def extract_state(
    net: nn.Module, indices: Mapping[str, Tensor], tensors: Sequence[Tensor] | None = None
) -> dict[str, Tensor]:
    """The sub-model's tensors, sliced out of ``net`` by the index sets (the classifier keeps every class).

    Keys are those of :func:`local_entries`, so the result loads into a net built with the sub-model's widths (each
    group ``g`` of ``len(indices[g])`` channels, the channels in the order of ``indices[g]``).

    Args:
        net: a width-scalable net.
        indices: group -> kept channels (:func:`width_indices`).
        tensors: tensors aligned with :func:`local_entries` to slice instead of the net's own (gradients, an upload).
    """
    entries = local_entries(net)
    sources = [t for _, t in entries] if tensors is None else list(tensors)
    state = {}
    for (name, t), src in zip(entries, sources):
        out = src.detach()
        for d, group in enumerate(_dims(net, name)):
            if group in indices:
                out = out.index_select(d, indices[group].to(t.device))
        state[name] = out.clone()
    return state


@torch.no_grad()
def apply_masks(tensors: Sequence[Tensor], masks: Sequence[Tensor]) -> None:
    """Zeroes, in place, the entries of ``tensors`` outside their masks (a client's start: ``fed.local_state``)."""
    torch._foreach_mul_(list(tensors), [m.to(t.dtype) for t, m in zip(tensors, masks)])


@torch.no_grad()
def mask_grads(params: Sequence[Tensor], masks: Sequence[Tensor]) -> None:
    """Zeroes, in place, the gradients outside the masks (after each backward; ``masks`` may be longer: buffers)."""
    for p, m in zip(params, masks):
        if p.grad is not None:
            p.grad.mul_(m)


def _groups(net: nn.Module) -> Mapping[str, int]:
    groups = getattr(net, "width_groups", None)
    if not isinstance(groups, Mapping):
        raise bad_value("model", type(net).__name__, "not a width-scalable net (no width_groups): use model=*_scalable")
    return groups


def _dims(net: nn.Module, name: str) -> Dims:
    """The channel group of each leading dimension of the tensor ``name`` (untagged dimensions are unscaled)."""
    owner, _, leaf = name.rpartition(".")
    dims = getattr(net.get_submodule(owner), "width_dims", None)
    if dims is None or leaf not in dims:
        raise ValueError(f"{name}: its module has no width tags (flx.models.width.tag_width)")
    return dims[leaf]
