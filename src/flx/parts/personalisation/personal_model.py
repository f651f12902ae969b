r"""The personalised model of a non-personalised algorithm, and the store of per-client personal models.

The pFedFBE paper evaluates algorithms without personalisation
with the global model as the personalised one (``model=global``: FedAvg's personalised evaluation, so its
``val/personal_*`` sit next to the personalised algorithms'). Its "pFedprox" baseline (Sec. 4.2) is not defined
there; here (``model=local``) FedProx's personalised model is the client's local model from the last round it took
part in, the approximate minimiser of

.. math::
    f_i(\theta) + \frac{\mu}{2} \lVert \theta - w^t \rVert^2

that FedProx's local steps compute (Li et al., MLSys 2020, Eq. 2): pFedMe's personal model (Dinh et al. 2020) with
:math:`\lambda = \mu`, kept rather than recomputed. A client never sampled is evaluated with the global model.

Personal models live in ``client.state`` (the CPU state store, never one copy per client on the accelerator) under
``<prefix><k>``, ``k`` the index into ``fed.params``: :func:`keep` writes them, :func:`from_state` and :func:`stored`
read them back (from ``client.state``, from the store) and :func:`install` puts them in the net for a ``personalize``
block (pFedMe and Ditto use the same helpers). Only trainable parameters are personal; buffers (BatchNorm statistics)
stay global. Under N processes the core's client-state all-gather sends every stored model to every rank in the rounds
that store some.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from flx.errors import bad_value
from flx.hooks import PERSONAL_HEADLINE, FederatedCallback
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationView

MODELS = ("global", "local")
_LOCAL = "personal/w/"


def keep(client: ClientContext, prefix: str, tensors: Sequence[Tensor]) -> None:
    """Puts a personal model (one tensor per ``fed.params`` entry) in ``client.state`` under ``prefix + k``."""
    client.state.update({f"{prefix}{k}": t.detach().clone() for k, t in enumerate(tensors)})


def from_state(state: dict[str, Tensor], prefix: str, n: int) -> list[Tensor] | None:
    """The ``n`` tensors of the personal model kept in ``state`` under ``prefix``, or None when there is none."""
    return [state[f"{prefix}{k}"] for k in range(n)] if f"{prefix}0" in state else None


def stored(fed: FederationView, cid: int, prefix: str) -> list[Tensor] | None:
    """Client ``cid``'s personal model kept under ``prefix`` in the state store, on the net's device, or None."""
    state = fed.store.get(cid, fed.params[0].device) if cid in fed.store else {}
    return from_state(state, prefix, len(fed.params))


@contextmanager
def install(fed: FederationView, tensors: Sequence[Tensor]) -> Iterator[None]:
    """The net's parameters set to ``tensors`` for a ``with`` block; the federation's
    :meth:`~flx.federation.Federation.personalize` restores the global model on exit."""
    with torch.no_grad():
        torch._foreach_copy_(fed.params, [t.to(q.dtype) for t, q in zip(tensors, fed.params)])
    yield


@dataclass(frozen=True)
class PersonalModelParams:
    """``model``: ``global`` (the global model) or ``local`` (the client's last local model)."""

    model: str = "global"


class PersonalModel(FederatedCallback):
    """The personalised model of an algorithm without one: the global model or the client's last local model."""

    traits = PartTraits(uploads={}, headline=PERSONAL_HEADLINE)  # the personal model stays on the client

    def __init__(self, model: str = "global") -> None:
        if model not in MODELS:
            raise bad_value("algo.personal_model", model, f"allowed: {', '.join(MODELS)}")
        self.params = PersonalModelParams(model)

    @override
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        if self.params.model == "local":
            keep(client, _LOCAL, fed.params)

    @override
    def personalize(self, fed: FederationView, cid: int) -> Any:
        if self.params.model == "global":
            return None  # the global model: evaluated with the other global-model clients, rows batched
        local = stored(fed, cid, _LOCAL)
        return install(fed, local) if local is not None else None
