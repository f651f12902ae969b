r"""Layers that stay on the client: the one mechanism of FedBN, FedPer, FedRep and LG-FedAvg (and FedBABU's frozen
head).

The net's uploaded tensors :math:`w = (w_S, w_L)` (``fed.local_state``: parameters, then float buffers) split into a
shared part :math:`w_S`, averaged as in FedAvg, and a local part :math:`w_L` that never leaves client :math:`i`:

.. math::
    (w_{S,i}^{t}, w_{L,i}^{t}) = \mathrm{LocalSGD}_i\big(w_S^t, w_{L,i}^{t-1}\big), \qquad
    w_S^{t+1} = \frac{\sum_{i \in P_t} p_i w_{S,i}^{t}}{\sum_{i \in P_t} p_i}, \qquad w_L^{t+1} = w_L^{t} = w_L^0.

Client :math:`i` starts from the shared global part and its own local part :math:`w_{L,i}^{t-1}` (kept in
``client.state``, the CPU state store; at its first visit the server's :math:`w_L^0`, the initial values), trains all
of it, keeps :math:`w_{L,i}^t` and uploads :math:`w_L^t` (the server's own value) in place of it, so the local tensors
neither leave the client nor move the server's copy: the server step sets the local entries of the mean back to
:math:`w_L^t` (``on_server_step``), which every server optimizer then leaves as it is (a zero pseudo-gradient), and
the server's :math:`w_L` stays the initial one bit for bit. Client :math:`i`'s personalised model (``personalize``) is
:math:`(w_S^{t}, w_{L,i})`; a client never sampled is evaluated with the global model.

Which tensors are local (``algo.local``): a list of patterns, each a name of the net's parameters or buffers
(``fnmatch``: ``net.4.*``), a module reached by attribute (``head``: the native nets' last ``Linear``, a property of
the MLP and the CNN, so ``head`` and ``head.*`` name its weight and bias), ``batch_norm`` (every BatchNorm layer's
affine parameters and running statistics), or any of these after ``!`` (taken out again: ``["*", "!head"]`` is
everything but the head). Integer buffers (BatchNorm's ``num_batches_tracked``, read only when ``momentum=None``) are
not uploaded and keep the global value, as for every algorithm.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from flx.errors import bad_value, check_fields
from flx.hooks import PERSONAL_HEADLINE, Build, FederatedCallback
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView

BATCH_NORM = "batch_norm"  # the pattern naming every BatchNorm layer (its affine parameters and running statistics)
_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_KEY = "local/"  # client.state keys: _KEY + index into fed.local_state


def _tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _module_at(net: nn.Module, path: Sequence[str]) -> nn.Module | None:
    """The submodule reached from ``net`` by the attributes ``path`` (properties too: ``MLP.head``), or None."""
    mod: Any = net
    for name in path:
        mod = getattr(mod, name, None)
        if not isinstance(mod, nn.Module):
            return None
    return mod


def matching(net: nn.Module, pattern: str) -> list[Tensor]:
    """The parameters and buffers of ``net`` that ``pattern`` names (see the module docstring), without ``!``."""
    if pattern == BATCH_NORM:
        return [t for m in net.modules() if isinstance(m, _BN) for _, t in _tensors(m)]
    parts = pattern.split(".")
    for cut in range(len(parts), 0, -1):  # the longest attribute path to a module, then a name pattern inside it
        mod = _module_at(net, parts[:cut])
        if mod is not None:
            rest = ".".join(parts[cut:]) or "*"
            return [t for name, t in _tensors(mod) if fnmatchcase(name, rest)]
    return [t for name, t in _tensors(net) if fnmatchcase(name, pattern)]


def select(net: nn.Module, uploaded: Sequence[Tensor], patterns: Sequence[str], key: str) -> tuple[int, ...]:
    """The positions in ``uploaded`` (``fed.local_state``) of the tensors ``patterns`` name: named by a pattern and
    by no ``!`` pattern. A pattern that names no tensor of the net (but ``batch_norm``) is a one-line error under
    ``key``."""
    chosen: set[int] = set()
    for pattern in patterns:
        found = {id(t) for t in matching(net, pattern.removeprefix("!"))}
        if not found and pattern != BATCH_NORM:  # a net without BatchNorm has none: FedBN is then FedAvg
            raise bad_value(key, list(patterns), f"{pattern!r} names no parameter or buffer of the net")
        chosen = chosen - found if pattern.startswith("!") else chosen | found
    return tuple(k for k, t in enumerate(uploaded) if id(t) in chosen)


def as_patterns(key: str, patterns: Any) -> tuple[str, ...]:
    """``patterns`` as a tuple of strings, or a one-line error under ``key``."""
    ok = isinstance(patterns, Sequence) and not isinstance(patterns, str)
    if not ok or not all(isinstance(p, str) and p.removeprefix("!") for p in patterns):
        raise bad_value(key, patterns, "a list of patterns: tensor names, module attributes or batch_norm (! removes)")
    return tuple(patterns)


def no_server_decay(build: Build, name: str) -> None:
    """The server's copy of the kept entries stays put under any server optimizer but one with weight decay."""
    wd = build.cfg.server.weight_decay
    if wd:
        why = f"must be 0 with {name}: it would decay the server's copy of the layers its clients keep"
        raise bad_value("algo.server.weight_decay", wd, why)


@torch.no_grad()
def keep_server(fed: FederationView, mean: list[Tensor], kept: Sequence[int]) -> None:
    """The entries ``kept`` of the reduced mean set back to the round's global values (a zero pseudo-gradient)."""
    for k in kept:
        mean[k].copy_(fed.global_state[k])


def freeze(fed: FederationView, frozen: Sequence[int]) -> None:
    """This step leaves the parameters ``frozen`` (positions in ``fed.params``) as they are: no gradient, so neither
    the step, nor momentum, nor weight decay moves them (``torch.optim.SGD`` and flx's plain step skip them)."""
    for k in frozen:
        fed.params[k].grad = None


@contextmanager
def installed(fed: FederationView, tensors: dict[int, Tensor]) -> Iterator[None]:
    """The net's entries ``k`` of ``fed.local_state`` set to ``tensors[k]`` for a ``with`` block (the federation's
    ``personalize`` restores the global model on exit)."""
    with torch.no_grad():
        for k, t in tensors.items():
            fed.local_state[k].copy_(t)
    yield


@dataclass(frozen=True)
class LocalLayersParams:
    """``local``: the patterns of the tensors that stay on the client."""

    local: tuple[str, ...] = ("head",)


class LocalLayers(FederatedCallback):
    """Keeps the tensors ``local`` names on each client (``client.state``) and the server's copy of them unchanged;
    ``personalize`` installs a client's own. Symbols: :math:`w_S` (shared), :math:`w_{L,i}` (client :math:`i`'s)."""

    traits = PartTraits(
        uploads={},  # the local tensors never leave the client
        steps="data_free",  # on_client_start loads the client's stored tensors: no rows read
        headline=PERSONAL_HEADLINE,
    )

    def __init__(self, local: Sequence[str] = ("head",)) -> None:
        self.params = LocalLayersParams(as_patterns("algo.local", local))
        check_fields(self.params, "algo.")
        self.local: tuple[int, ...] = ()  # positions in fed.local_state, set at attach

    @override
    def check(self, build: Build) -> None:
        select(build.net, [], self.params.local, "algo.local")  # every pattern names a tensor of the net
        no_server_decay(build, type(self).__name__)

    @override
    def on_attach(self, fed: FederationView) -> None:
        self.local = select(fed.net, fed.local_state, self.params.local, "algo.local")

    @override
    @torch.no_grad()
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        for k in self.local:  # at the first visit the net holds the server's values
            if f"{_KEY}{k}" in client.state:
                fed.local_state[k].copy_(client.state[f"{_KEY}{k}"])

    @override
    @torch.no_grad()
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        for k in self.local:
            client.state[f"{_KEY}{k}"] = fed.local_state[k].detach().clone()
            fed.local_state[k].copy_(fed.global_state[k])  # the upload carries the server's own value

    @override
    def on_server_step(self, fed: FederationView, rnd: Any, mean: list[Tensor]) -> None:
        keep_server(fed, mean, self.local)

    @override
    def personalize(self, fed: FederationView, cid: int) -> Any:
        if not self.local or cid not in fed.store:
            return None  # never sampled: the global model
        state = fed.store.get(cid, fed.params[0].device)
        if f"{_KEY}{self.local[0]}" not in state:
            return None
        return installed(fed, {k: state[f"{_KEY}{k}"] for k in self.local})
