"""``FederatedCallback``: a Lightning ``Callback`` with the federated hooks. The hook set lives here only.

A part owns one mechanism and its state (``state_dict``/``load_state_dict`` as any Lightning callback,
so it is saved with the checkpoint). Parts are listed in the algorithm config; hook order is list order.
Every hook is optional; the federation calls a hook only on the parts that override it.

Build time: ``check_setup(datamodule, cfg)`` runs once the data is loaded and partitioned, before the Trainer
starts, so a part that cannot use the data or the protocol settings (an AUC part on a 10-class task, a step-counting
part with ``local_epochs``) stops the run with one line.

Server side (run identically on every rank):

=====================  ==========================================================================
``sample_clients``     choose the round's cohort; the first part returning non-None wins
``on_round_start``     after sampling, before any client trains (broadcast buffers, draw t', ...)
``on_server_step``     after the one collective reduce, before the server optimizer (edit the mean)
``on_round_end``       after the server step; the net holds the new global model
=====================  ==========================================================================

Client side (per client, on the rank that trains it):

=====================  ==========================================================================
``on_client_start``    global weights copied in; load client state, set masks / weight
``sample_batch``       the step's minibatch (row indices into the store); first non-None wins
``local_loss``         add (or replace) terms of the local objective; returns the loss
``on_local_grad``      after backward, before the optimizer step (gradient transforms)
``on_local_step_end``  after the optimizer step (prox operators, snapshots, recording)
``on_client_end``      after local training, before the contribution is added; save client state
=====================  ==========================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from lightning.pytorch import Callback
from torch import Tensor

if TYPE_CHECKING:
    from flx.federation import ClientContext, Federation, FederationConfig, RoundContext

HOOKS = (
    "sample_clients",
    "on_round_start",
    "on_server_step",
    "on_round_end",
    "on_client_start",
    "sample_batch",
    "local_loss",
    "on_local_grad",
    "on_local_step_end",
    "on_client_end",
)


class FederatedCallback(Callback):
    """Base class of algorithm parts. Override only the hooks the mechanism needs."""

    def check_setup(self, datamodule: Any, cfg: FederationConfig) -> None:
        """Before the Trainer starts: raise a ConfigError for data or protocol settings the part cannot use.

        ``datamodule`` is the set-up :class:`~flx.datamodules.datamodule.FederatedDataModule` (data loaded and
        partitioned), ``cfg`` the round protocol's settings; a check here fails with one line before Lightning
        prints anything.
        """

    def sample_clients(self, fed: Federation, round_idx: int, rng: np.random.Generator) -> Sequence[int] | None:
        """Returns the cohort (client ids; repeats allowed and count as multiplicity), or None to defer."""
        return None

    def on_round_start(self, fed: Federation, rnd: RoundContext) -> None:
        """Server, every rank: the cohort is known, no client has trained yet."""

    def on_client_start(self, fed: Federation, client: ClientContext) -> None:
        """Client: the net holds the global weights; ``client.state`` holds the stored client state."""

    def sample_batch(self, fed: Federation, client: ClientContext) -> Tensor | None:
        """Client, every local step: row indices of the step's minibatch in the tensor store, or None to defer.

        The default is reshuffled epochs of the client's rows (:func:`flx.federation.local_batches`); draw from
        ``client.generator`` to stay a function of ``(seed, round, client)``.
        """
        return None

    def local_loss(self, fed: Federation, client: ClientContext, loss: Tensor) -> Tensor:
        """Client, every local step: returns the local objective (``client.outputs`` / ``client.batch`` given)."""
        return loss

    def on_local_grad(self, fed: Federation, client: ClientContext) -> None:
        """Client, every local step: gradients are in ``p.grad``; transform them in place."""

    def on_local_step_end(self, fed: Federation, client: ClientContext) -> None:
        """Client, every local step: after the optimizer step."""

    def on_client_end(self, fed: Federation, client: ClientContext) -> None:
        """Client: local training done; the net holds the local model; ``client.weight`` is the weight."""

    def on_server_step(self, fed: Federation, rnd: RoundContext, mean: list[Tensor]) -> None:
        """Server, every rank: ``mean`` is the reduced aggregate (params then float buffers); edit in place."""

    def on_round_end(self, fed: Federation, rnd: RoundContext) -> None:
        """Server, every rank: the net holds the new global model."""


def overrides(part: FederatedCallback, hook: str) -> bool:
    """Whether ``part`` overrides ``hook`` (so the hot loops skip no-op calls)."""
    return getattr(type(part), hook) is not getattr(FederatedCallback, hook)
