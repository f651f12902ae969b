r"""Nonsmooth regularisers :math:`h` and their proximal operators, for federated composite optimisation.

The problem is :math:`\min_w \frac1N \sum_i f_i(w) + h(w)` with :math:`h` convex, closed and cheap to prox. Every
operator here is a closed form of

.. math::
    \mathrm{prox}_{\gamma h}(v) = \arg\min_u\; h(u) + \frac{1}{2\gamma}\lVert u - v \rVert^2, \qquad \gamma \ge 0,

written as a pure function ``prox_<name>(v, gamma, **params)`` next to ``value_<name>(v, **params)`` (:math:`h(v)`):

- ``l1``: :math:`h = \mu \lVert v \rVert_1`, prox :math:`\mathrm{sign}(v) \max(|v| - \gamma\mu, 0)` (soft threshold);
- ``elastic_net``: :math:`h = \mu_1 \lVert v\rVert_1 + \frac{\mu_2}{2}\lVert v\rVert^2`, prox
  :math:`\mathrm{soft}(v, \gamma\mu_1) / (1 + \gamma\mu_2)`;
- ``group_l2``: :math:`h = \mu \sum_g \lVert v_g \rVert_2`, prox :math:`\max(1 - \gamma\mu / \lVert v_g\rVert_2, 0)\,
  v_g` per group (block soft threshold; a zero group stays zero);
- ``nuclear``: :math:`h = \mu \lVert V \rVert_* = \mu \sum_j \sigma_j(V)`, prox
  :math:`U \mathrm{diag}(\max(\sigma_j - \gamma\mu, 0)) Q^\top` for the thin SVD
  :math:`V = U \mathrm{diag}(\sigma) Q^\top`;
- ``nonneg``: :math:`h = \iota_{\{v \ge 0\}}`, prox :math:`\max(v, 0)` (any :math:`\gamma`);
- ``box``: :math:`h = \iota_{\{l \le v \le u\}}`, prox :math:`\mathrm{clip}(v, l, u)` (any :math:`\gamma`).

``group_l2``'s groups are the slices along ``dim`` (torch's norm convention: ``dim=1`` on a ``Linear`` weight of
shape ``(out, in)`` takes one norm per row, i.e. per output neuron; ``None``: the whole tensor is one block, the
non-squared :math:`\ell_2` norm of pFedFBE's MNIST experiment). ``nuclear`` works on a matrix: a 2-D tensor as it
is, a tensor of more dimensions as ``(size(0), -1)``, any tensor reshaped by ``shape`` (a 1-D parameter of 1024
entries as ``(32, 32)`` for matrix completion). Indicators (``nonneg``, ``box``) take no weight: their prox is the
projection and their value is 0 or ``inf``.

:class:`Regularizer` applies one of them to the parameters of a net whose names match ``params`` (``fnmatch``
patterns on ``named_parameters()`` names, e.g. ``["*weight"]`` to leave biases unregularised): :math:`h(w)` is the
sum over the selected tensors, so its prox is the per-tensor prox of the selected ones and the identity elsewhere.
Built from ``algo.regularizer`` by :func:`make_regularizer`; a wrong value stops with one line naming the key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import Tensor, nn

from flx.errors import bad_value, number_error

__all__ = [
    "REGULARIZERS",
    "Regularizer",
    "make_regularizer",
    "prox_box",
    "prox_elastic_net",
    "prox_group_l2",
    "prox_l1",
    "prox_nonneg",
    "prox_none",
    "prox_nuclear",
    "value_box",
    "value_elastic_net",
    "value_group_l2",
    "value_l1",
    "value_nonneg",
    "value_none",
    "value_nuclear",
]

REGULARIZERS = ("none", "l1", "elastic_net", "group_l2", "nuclear", "nonneg", "box")
KEY = "algo.regularizer"  # the config node every message names


# ---------------------------------------------------------------------------------------------- closed forms
def prox_none(v: Tensor, gamma: float) -> Tensor:
    """The identity: :math:`h = 0`."""
    return v


def value_none(v: Tensor) -> Tensor:
    return v.new_zeros(())


def _soft(v: Tensor, t: float) -> Tensor:
    """``sign(v) * max(|v| - t, 0)`` (``v`` itself when ``t == 0``)."""
    return v if t == 0 else v.sign() * (v.abs() - t).clamp_min(0)


def prox_l1(v: Tensor, gamma: float, mu: float) -> Tensor:
    """Soft threshold at ``gamma * mu``: the prox of ``mu * ||v||_1``.

    >>> prox_l1(torch.tensor([3.0, -0.5, 1.0, -2.0]), gamma=0.5, mu=2.0)
    tensor([ 2., -0.,  0., -1.])
    """
    return _soft(v, gamma * mu)


def value_l1(v: Tensor, mu: float) -> Tensor:
    return mu * v.abs().sum()


def prox_elastic_net(v: Tensor, gamma: float, mu1: float, mu2: float) -> Tensor:
    """Prox of ``mu1 ||v||_1 + mu2 / 2 ||v||^2``: soft threshold at ``gamma mu1``, then shrink by ``1 + gamma mu2``.

    >>> prox_elastic_net(torch.tensor([3.0, -0.5]), gamma=0.5, mu1=2.0, mu2=2.0)
    tensor([1., -0.])
    """
    u = _soft(v, gamma * mu1)
    return u if gamma * mu2 == 0 else u / (1.0 + gamma * mu2)


def value_elastic_net(v: Tensor, mu1: float, mu2: float) -> Tensor:
    return mu1 * v.abs().sum() + 0.5 * mu2 * v.square().sum()


def prox_group_l2(v: Tensor, gamma: float, mu: float, dim: int | Sequence[int] | None = None) -> Tensor:
    """Block soft threshold: each group ``v_g`` (the norm runs over ``dim``; None: one block) is scaled by
    ``max(1 - gamma mu / ||v_g||, 0)``; a zero group stays zero.

    >>> prox_group_l2(torch.tensor([[3.0, 4.0], [0.3, 0.4]]), gamma=1.0, mu=1.0, dim=1)
    tensor([[2.4000, 3.2000],
            [0.0000, 0.0000]])
    """
    t = gamma * mu
    if t == 0:
        return v
    norm = torch.linalg.vector_norm(v, dim=dim, keepdim=True)
    return v * (1.0 - t / norm).clamp_min(0)  # a zero norm gives 1 - inf, clamped to 0


def value_group_l2(v: Tensor, mu: float, dim: int | Sequence[int] | None = None) -> Tensor:
    return mu * torch.linalg.vector_norm(v, dim=dim).sum()


def as_matrix(v: Tensor, shape: Sequence[int] | None = None) -> Tensor:
    """``v`` as the matrix the nuclear norm reads: reshaped to ``shape``, else as is (2-D) or ``(size(0), -1)``."""
    if shape is not None:
        return v.reshape(tuple(shape))
    if v.dim() < 2:
        raise ValueError(f"the nuclear norm needs a matrix: give `shape` for a tensor of shape {tuple(v.shape)}")
    return v if v.dim() == 2 else v.reshape(v.shape[0], -1)


def prox_nuclear(v: Tensor, gamma: float, mu: float, shape: Sequence[int] | None = None) -> Tensor:
    """Singular-value soft threshold: ``V = U diag(s) Q^T`` -> ``U diag(max(s - gamma mu, 0)) Q^T`` (thin SVD).

    >>> prox_nuclear(torch.diag(torch.tensor([3.0, 1.0])), gamma=1.0, mu=1.5)
    tensor([[1.5000, 0.0000],
            [0.0000, 0.0000]])
    """
    t = gamma * mu
    if t == 0:
        return v
    u, s, qh = torch.linalg.svd(as_matrix(v, shape), full_matrices=False)
    return ((u * (s - t).clamp_min(0)) @ qh).reshape(v.shape)


def value_nuclear(v: Tensor, mu: float, shape: Sequence[int] | None = None) -> Tensor:
    return mu * torch.linalg.svdvals(as_matrix(v, shape)).sum()


def prox_nonneg(v: Tensor, gamma: float) -> Tensor:
    """Projection onto ``v >= 0`` (independent of ``gamma``)."""
    return v.clamp_min(0)


def _indicator(v: Tensor, inside: bool) -> Tensor:
    return v.new_zeros(()) if inside else v.new_full((), math.inf)


def value_nonneg(v: Tensor) -> Tensor:
    return _indicator(v, bool((v >= 0).all()))


def prox_box(v: Tensor, gamma: float, low: float | None = None, high: float | None = None) -> Tensor:
    """Projection onto ``low <= v <= high`` (None: no bound on that side; independent of ``gamma``)."""
    return v.clamp(low, high)


def value_box(v: Tensor, low: float | None = None, high: float | None = None) -> Tensor:
    inside = (low is None or bool((v >= low).all())) and (high is None or bool((v <= high).all()))
    return _indicator(v, inside)


# name -> (prox, value, options besides mu); elastic_net's mu is its mu1
_TABLE: dict[str, tuple[Callable[..., Tensor], Callable[..., Tensor], tuple[str, ...]]] = {
    "none": (prox_none, value_none, ()),
    "l1": (prox_l1, value_l1, ()),
    "elastic_net": (prox_elastic_net, value_elastic_net, ("mu2",)),
    "group_l2": (prox_group_l2, value_group_l2, ("dim",)),
    "nuclear": (prox_nuclear, value_nuclear, ("shape",)),
    "nonneg": (prox_nonneg, value_nonneg, ()),
    "box": (prox_box, value_box, ("low", "high")),
}
_WEIGHTED = ("l1", "elastic_net", "group_l2", "nuclear")  # the names that take mu


# ---------------------------------------------------------------------------------------------- config checks
def _number(key: str, value: Any, low: float | None = 0.0) -> float:
    err = number_error(f"{KEY}.{key}", value)
    if err is not None:
        raise err
    x = float(value)
    if low is not None and not (x >= low and math.isfinite(x)):
        raise bad_value(f"{KEY}.{key}", value, f"must be a finite number >= {low:g}")
    return x


def _ints(key: str, value: Any, allowed: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else value
    if isinstance(value, (bool, str)) or not isinstance(items, Sequence) or not items:
        raise bad_value(f"{KEY}.{key}", value, allowed)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise bad_value(f"{KEY}.{key}", value, allowed)
    return tuple(items)


def _options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``name``'s prox and value besides ``mu``, checked."""
    takes = _TABLE[name][2]
    for key in options:
        if key not in takes:
            allowed = ", ".join(("name", "mu", "params", *takes) if name in _WEIGHTED else ("name", "params", *takes))
            raise bad_value(f"{KEY}.{key}", options[key], f"not an option of name={name}; it takes: {allowed}")
    kw: dict[str, Any] = {}
    if name == "elastic_net":
        kw["mu2"] = _number("mu2", options.get("mu2", 0.0))
    elif name == "group_l2" and options.get("dim") is not None:
        dim = _ints("dim", options["dim"], "the dims the l2 norm runs over: an int or a list of ints, or null")
        kw["dim"] = dim[0] if isinstance(options["dim"], int) else dim
    elif name == "nuclear" and options.get("shape") is not None:
        shape = _ints("shape", options["shape"], "the matrix shape: two ints, e.g. [32, 32] (one may be -1)")
        if len(shape) != 2 or any(s == 0 or s < -1 for s in shape) or shape == (-1, -1):
            raise bad_value(f"{KEY}.shape", options["shape"], "the matrix shape: two ints > 0 (one may be -1)")
        kw["shape"] = shape
    elif name == "box":
        low, high = options.get("low"), options.get("high")
        kw["low"] = None if low is None else _number("low", low, low=None)
        kw["high"] = None if high is None else _number("high", high, low=None)
        if kw["low"] is not None and kw["high"] is not None and kw["low"] > kw["high"]:
            raise bad_value(f"{KEY}.low", low, f"must be <= {KEY}.high={high}")
    return kw


# ---------------------------------------------------------------------------------------------- the regulariser
class Regularizer:
    """h(w) = sum over the selected parameters; built from config `algo.regularizer`.

    Args:
        name: one of :data:`REGULARIZERS`.
        mu: the weight ``mu >= 0`` (``l1``, ``group_l2``, ``nuclear``; ``mu1`` of ``elastic_net``; indicators
            ignore it).
        params: ``fnmatch`` patterns on the net's ``named_parameters()`` names; a parameter is regularised when
            its name matches any of them. ``("*",)`` selects every trainable parameter.
        **options: ``mu2`` (elastic_net), ``dim`` (group_l2), ``shape`` (nuclear), ``low`` / ``high`` (box).

    Until :meth:`bind` is called, ``params=("*",)`` selects every tensor given; other patterns need the names.
    """

    def __init__(self, name: str = "none", mu: float = 0.0, params: Sequence[str] = ("*",), **options: Any) -> None:
        if name not in _TABLE:
            raise bad_value(f"{KEY}.name", name, f"allowed: {', '.join(REGULARIZERS)}")
        self.name, self.mu = name, _number("mu", mu)
        patterns = (params,) if isinstance(params, str) else tuple(params) if isinstance(params, Sequence) else None
        if not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise bad_value(f"{KEY}.params", params, 'a list of parameter-name patterns, e.g. ["*weight"]')
        self.patterns = patterns
        self.kwargs = _options(name, options)
        if name == "elastic_net":
            self.kwargs = {"mu1": self.mu, **self.kwargs}
        elif name in _WEIGHTED:
            self.kwargs = {"mu": self.mu, **self.kwargs}
        self._prox, self._value = _TABLE[name][:2]
        self.indices: list[int] | None = None

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"Regularizer({self.name!r}{opts}, params={list(self.patterns)!r})"

    @property
    def identity(self) -> bool:
        """Whether the prox is the identity for every ``gamma`` (``none``, zero weights, an unbounded box)."""
        if self.name == "box":
            return self.kwargs["low"] is None and self.kwargs["high"] is None
        weights = [v for k, v in self.kwargs.items() if k in ("mu", "mu1", "mu2")]
        return self.name == "none" or (self.name in _WEIGHTED and not any(weights))

    # ------------------------------------------------------------------ selection
    def select(self, net: nn.Module) -> list[int]:
        """Indices into ``[p for p in net.parameters() if p.requires_grad]`` whose name matches a pattern.

        Raises:
            ConfigError: a pattern matches no trainable parameter (the message lists the names).
        """
        names = [n for n, p in net.named_parameters() if p.requires_grad]
        for pattern in self.patterns:
            if not any(fnmatchcase(n, pattern) for n in names):
                shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
                raise bad_value(f"{KEY}.params", list(self.patterns), f"{pattern!r} matches no parameter of {shown}")
        return [i for i, n in enumerate(names) if any(fnmatchcase(n, p) for p in self.patterns)]

    def bind(self, net: nn.Module) -> None:
        """Resolves ``params`` against the net's names once and checks the selected shapes (nuclear, group_l2)."""
        indices = self.select(net)
        named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
        for i in indices:
            self._check_shape(*named[i])
        self.indices = indices

    def _check_shape(self, name: str, t: Tensor) -> None:
        what = f"parameter {name!r} of shape {tuple(t.shape)}"
        if self.name == "nuclear":
            try:
                as_matrix(t, self.kwargs.get("shape"))
            except (ValueError, RuntimeError):
                shape = self.kwargs.get("shape")
                why = f"{what} is not a matrix: set [rows, cols]" if shape is None else f"does not fit {what}"
                raise bad_value(f"{KEY}.shape", shape, f"{why}, or leave it out of {KEY}.params") from None
        elif self.name == "group_l2" and self.kwargs.get("dim") is not None:
            dims, n = self.kwargs["dim"], max(t.dim(), 1)
            if any(not -n <= d < n for d in ((dims,) if isinstance(dims, int) else dims)):
                raise bad_value(f"{KEY}.dim", dims, f"out of range for {what}")

    def selected(self, tensors: Sequence[Tensor]) -> list[int]:
        """The indices of ``tensors`` (the full trainable list) the regulariser applies to."""
        if self.indices is None:
            if self.patterns != ("*",):
                raise RuntimeError(f"{self!r}: call bind(net) first to resolve the parameter patterns")
            return list(range(len(tensors)))
        if self.indices and self.indices[-1] >= len(tensors):
            raise ValueError(f"{self!r} was bound to a net with more trainable tensors than the {len(tensors)} given")
        return self.indices

    # ------------------------------------------------------------------ maths
    def value(self, tensors: Sequence[Tensor]) -> Tensor:
        """``h`` of the selected tensors (a 0-dim tensor; ``inf`` outside an indicator's set)."""
        total = tensors[0].new_zeros(()) if tensors else torch.zeros(())
        for i in self.selected(tensors):
            total = total + self._value(tensors[i], **self.kwargs)
        return total

    def prox(self, tensors: Sequence[Tensor], gamma: float) -> list[Tensor]:
        """``prox_{gamma h}``, out of place: new tensors for the selected ones, the others returned as they are."""
        if gamma < 0:
            raise ValueError(f"prox step gamma={gamma} must be >= 0")
        out = list(tensors)
        for i in self.selected(tensors):
            out[i] = self._prox(tensors[i], gamma, **self.kwargs)
        return out

    @torch.no_grad()
    def prox_(self, tensors: Sequence[Tensor], gamma: float) -> None:
        """``prox_{gamma h}`` in place (e.g. on ``fed.params`` after a local step)."""
        if self.identity:
            return
        if gamma < 0:
            raise ValueError(f"prox step gamma={gamma} must be >= 0")
        for i in self.selected(tensors):
            t = tensors[i]
            t.copy_(self._prox(t.detach(), gamma, **self.kwargs))


def make_regularizer(cfg: Mapping[str, Any] | None) -> Regularizer:
    """The :class:`Regularizer` of ``algo.regularizer`` (``null`` or ``name: none``: the identity).

    Keys set to ``null`` are left out, so a config can list every option (``mu2``, ``dim``, ``shape``, ``low``,
    ``high``) and set only those of its ``name``.
    """
    if cfg is None:
        return Regularizer()
    if not isinstance(cfg, Mapping):
        raise bad_value(KEY, cfg, "a mapping such as {name: l1, mu: 0.01, params: ['*weight']}, or null")
    given = {str(k): v for k, v in cfg.items() if v is not None}
    if isinstance(given.get("params"), Sequence) and not isinstance(given["params"], str):
        given["params"] = [str(p) for p in given["params"]]
    return Regularizer(**given)
