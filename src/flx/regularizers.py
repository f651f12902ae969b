r"""STAND-IN for the prox library (branch ``prox-lib``): the agreed API only, so the pFedFBE parts can be tested.

Drop this file at merge in favour of the real ``flx/regularizers.py``. A regulariser :math:`h = \mu R` acts on the
trainable tensors whose names match ``params`` (fnmatch patterns, resolved once by :meth:`Regularizer.bind`); the
others see the identity prox and add nothing to :math:`h`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatch
from typing import Any

import torch
from torch import Tensor, nn

REGULARIZERS = ("none", "l1", "elastic_net", "group_l2", "nuclear", "nonneg", "box")


def _soft(v: Tensor, t: float) -> Tensor:
    return torch.sign(v) * (v.abs() - t).clamp_min(0)


class Regularizer:
    """:math:`h(w) = \\mu R(w)` on the selected tensors; ``options``: ``mu2`` (elastic net), ``low``/``high`` (box)."""

    def __init__(self, name: str = "none", mu: float = 0.0, params: Sequence[str] = ("*",), **options: Any) -> None:
        if name not in REGULARIZERS:
            raise ValueError(f"regularizer {name!r}: allowed {', '.join(REGULARIZERS)}")
        self.name, self.mu, self.patterns, self.options = name, float(mu), tuple(params), dict(options)
        self.index: list[int] | None = None

    def bind(self, net: nn.Module) -> None:
        names = [n for n, p in net.named_parameters() if p.requires_grad]
        self.index = [i for i, n in enumerate(names) if any(fnmatch(n, pat) for pat in self.patterns)]

    def select(self, net: nn.Module) -> list[int]:
        if self.index is None:
            self.bind(net)
        return list(self.index)

    def _chosen(self, tensors: Sequence[Tensor]) -> list[int]:
        return list(range(len(tensors))) if self.index is None else self.index

    def _one_value(self, t: Tensor) -> Tensor:
        if self.name in ("l1", "elastic_net"):
            extra = 0.5 * (self.options.get("mu2") or 0.0) * t.pow(2).sum() if self.name == "elastic_net" else 0.0
            return self.mu * t.abs().sum() + extra
        if self.name == "group_l2":
            return self.mu * t.norm()
        if self.name == "nuclear":
            return self.mu * torch.linalg.svdvals(t).sum()
        return t.new_zeros(())

    def value(self, tensors: Sequence[Tensor]) -> Tensor:
        total = tensors[0].new_zeros(())
        for i in self._chosen(tensors):
            total = total + self._one_value(tensors[i])
        return total

    def _one_prox(self, v: Tensor, gamma: float) -> Tensor:
        t = gamma * self.mu
        if self.name == "l1":
            return _soft(v, t)
        if self.name == "elastic_net":
            return _soft(v, t) / (1 + gamma * (self.options.get("mu2") or 0.0))
        if self.name == "group_l2":
            norm = v.norm()
            return v * (1 - t / norm).clamp_min(0) if norm > 0 else v.clone()
        if self.name == "nuclear":
            u, s, vh = torch.linalg.svd(v, full_matrices=False)
            return u @ torch.diag_embed((s - t).clamp_min(0)) @ vh
        if self.name == "nonneg":
            return v.clamp_min(0)
        if self.name == "box":
            return v.clamp(self.options.get("low"), self.options.get("high"))
        return v.clone()

    def prox(self, tensors: Sequence[Tensor], gamma: float) -> list[Tensor]:
        out = [t.clone() for t in tensors]
        if self.name != "none":
            for i in self._chosen(tensors):
                out[i] = self._one_prox(tensors[i], gamma)
        return out

    @torch.no_grad()
    def prox_(self, tensors: Sequence[Tensor], gamma: float) -> None:
        for t, p in zip(tensors, self.prox(tensors, gamma)):
            t.copy_(p)


def make_regularizer(cfg: Mapping[str, Any] | None) -> Regularizer:
    """A :class:`Regularizer` from ``{name, mu, params, **options}`` (null options left out); None: the identity."""
    if cfg is None:
        return Regularizer()
    cfg = {k: v for k, v in cfg.items() if v is not None}
    return Regularizer(str(cfg.pop("name", "none")), float(cfg.pop("mu", 0.0)), tuple(cfg.pop("params", ("*",))), **cfg)
