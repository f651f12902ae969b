"""``FederatedCallback``: a Lightning ``Callback`` with the federated hooks. The hook set lives here only.

A part owns one mechanism and its state (``state_dict``/``load_state_dict`` as any Lightning callback,
so it is saved with the checkpoint). Parts are listed in the algorithm config; hook order is list order.
Every hook is optional; the federation calls a hook only on the parts that override it.

Build time: ``check(build)`` runs once the data is loaded and partitioned and the net is built (:class:`Build`),
before anything is written into the run folder and before the Trainer exists, so a part that cannot use the data,
the protocol settings, the system or the net (an AUC part on a 10-class task, a step-counting part with
``local_epochs``, WHALE without simulated devices) stops the run with one line. What a part declares about itself
(what its clients send, what its step hooks read, the services it provides or uses, its metrics) is its
:class:`~flx.traits.PartTraits` value, ``traits``; which parts run together is decided from those declarations
alone, in one table (:mod:`flx.composition`).

``on_attach(fed)`` runs when the federation is bound to the net and the data (fit start): a part declares its
per-round statistics there (``fed.register_stat``), which ride in the round's one all-reduce, and creates its
per-round state. What exists when: ``check`` runs first (at the build), then ``on_attach`` (the part
makes its fresh state), then, on resume, ``load_state_dict`` (the checkpoint's state replaces the fresh one: the
module loads the parts' states once the federation is built; ``tests/test_composition.py``).

Server side (run identically on every rank):

=====================  ==========================================================================
``sample_clients``     choose the round's cohort; the first part returning non-None wins
``refuse_round``       the cohort is drawn, nothing trained: why the round must not run (a budget it would pass),
                       one line; the first answer stops the run before the round (:class:`RoundRefused`)
``on_round_start``     after sampling, before any client trains (broadcast buffers, draw t', ...)
``on_server_step``     after the one collective reduce, before the server optimizer (edit the mean)
``on_round_end``       after the server step; the net holds the new global model
``divergence_cause``   why the run diverged and the keys to change, when the part is the cause (the
                       noise it adds); first non-None wins, else the optimizer's keys
=====================  ==========================================================================

Client side (per client, on the rank that trains it):

=====================  ==========================================================================
``on_client_start``    global weights copied in; load client state, set masks / weight
``local_update``       replaces the K local SGD steps (closed forms, meta steps); first non-None wins
``sample_batch``       the step's minibatch (row indices into the store); first non-None wins
``local_grad``         replaces the step's forward, loss and backward (fills ``p.grad``); first non-None wins
``local_loss``         add (or replace) terms of the local objective; returns the loss
``on_local_grad``      after backward, before the optimizer step (gradient transforms)
``on_local_step_end``  after the optimizer step (prox operators, snapshots, recording)
``on_client_end``      after local training, before the contribution is added; save client state
=====================  ==========================================================================

Evaluation: ``personalize(fed, cid)`` returns a context manager that turns the net into client ``cid``'s personalised
model and undoes it on exit (:meth:`flx.federation.Federation.personalize`); the per-client evaluation uses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np
from lightning.pytorch import Callback
from torch import Tensor, nn

from flx.context import ClientContext, ClientData, Cohort, FederationConfig, FederationView, Part, Round
from flx.traits import PartTraits

if TYPE_CHECKING:
    from flx.resources import ServerResources
    from flx.systems.simulator import LatencySimulator

# the headline of a part that personalises (``personalize``): its clients' mean personalised metric, the task's
# accuracy or MSE (``{split}/personal_<acc|mse>_mean``)
PERSONAL_HEADLINE = ("personal_acc_mean", "personal_mse_mean")

HOOKS = (
    "on_attach",
    "sample_clients",
    "refuse_round",
    "on_round_start",
    "on_server_step",
    "on_round_end",
    "divergence_cause",
    "on_client_start",
    "local_update",
    "sample_batch",
    "local_grad",
    "local_loss",
    "on_local_grad",
    "on_local_step_end",
    "on_client_end",
    "cohort_grad",
    "on_cohort_grad",
    "on_cohort_step_end",
    "personalize",
)


class FederatedCallback(Callback):
    """Base class of algorithm parts. Override only the hooks the mechanism needs.

    ``traits`` holds every declaration (:class:`~flx.traits.PartTraits`: what its clients send, what its step
    hooks read, its services, headline and metrics); a part replaces the value, never edits it. ``links`` holds the
    parts :func:`flx.composition.link` linked to it, by service: its providers for a service it uses, its consumers
    for one it provides.
    """

    traits: PartTraits = PartTraits()
    links: Mapping[str, tuple[FederatedCallback, ...]] = MappingProxyType({})

    def final_values(self) -> dict[str, float | str]:
        """Values the run's final line ends with (``name=value``), after the test's headline metrics;
        W&B gets them as ``final/<key>`` in the run's last row (its summary)."""
        return {}

    def check(self, build: Build) -> None:
        """Before the Trainer starts and before anything is written: raise a one-line ConfigError for data, protocol
        settings, a system or a net the part cannot use, or settle what depends on them (a calibration). Called once
        per run, by :func:`flx.composition.check` (the run's build, or a federation built directly)."""

    def linked(self, service: str) -> tuple[FederatedCallback, ...]:
        """``links[service]``: the parts linked to this one for ``service`` (none when no part is)."""
        return self.links.get(service, ())

    def divergence_cause(self, fed: FederationView, step: int) -> str | None:
        """Server, every rank, when the run stops as diverged from the model of server step ``step`` (1-based): the
        end of the one-line message, the cause and the keys to change with their values (``the noise the part adds
        dominates ...; raise <key> (now <value>) ...``), or None when the part is not the cause (the first
        non-None wins; else the optimizer's keys, :func:`flx.faults.optimizer_cause`). ``fed.update_norm(step)`` is
        that step's mean client update as reduced, before ``on_server_step``. Claim only what a measurement shows."""
        return None

    def on_attach(self, fed: FederationView) -> None:
        """Fit start, every rank: the federation holds the net and the data. Declare per-round statistics here
        (:meth:`~flx.federation.Federation.register_stat`) and create per-round state (no ``hasattr`` later)."""

    def sample_clients(self, fed: FederationView, round_idx: int, rng: np.random.Generator) -> Sequence[int] | None:
        """Returns the cohort (client ids; repeats allowed, counted in ``rnd.draws``), or None to defer."""
        return None

    def refuse_round(self, fed: FederationView, rnd: Round) -> str | None:
        """Server, every rank, before ``on_round_start``: the round's draws are known (``rnd.draws``, ``rnd.cohort``)
        and nothing of it has run. Returns why the round must not run (one line, e.g. a budget it would pass),
        or None. The first answer stops the run before the round: :class:`RoundRefused`, exit status
        :data:`RoundRefused.status`."""
        return None

    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        """Server, every rank: the cohort is known, no client has trained yet."""

    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        """Client: the net holds the global weights; ``client.state`` holds the stored client state."""

    def local_update(self, fed: FederationView, client: ClientContext) -> Tensor | None:
        """Client: replaces the ``K`` local SGD steps, or None to defer (the first non-None wins).

        The net holds ``w^t`` (after ``on_client_start``); leave the client's local model in the net (what is
        uploaded) and return its mean training loss, a detached scalar. ``fed.grad_at`` / ``fed.hvp`` give gradients
        and Hessian-vector products at any parameters; ``fed.client_batches(client)`` the default minibatch stream.
        """
        return None

    def sample_batch(self, fed: FederationView, client: ClientContext) -> Tensor | None:
        """Client, every local step: row indices of the step's minibatch in the tensor store, or None to defer.

        The default is ``fed.client_batches(client)`` (``algo.minibatch``: reshuffled epochs of the client's rows, or a
        fresh draw of ``B`` rows per step); draw from ``client.generator`` to stay a function of
        ``(seed, round, client)``.
        """
        return None

    def local_grad(self, fed: FederationView, client: ClientContext) -> Tensor | None:
        """Client, every local step: replaces the step's forward, ``local_loss`` and backward, or None to defer (the
        first non-None wins). ``client.batch`` holds the step's rows; set ``p.grad`` of every ``fed.params`` and
        return the step's loss, a detached scalar (per-row gradients, e.g.)."""
        return None

    def local_loss(self, fed: FederationView, client: ClientContext, loss: Tensor) -> Tensor:
        """Client, every local step: returns the local objective (``client.outputs`` / ``client.batch`` given)."""
        return loss

    def on_local_grad(self, fed: FederationView, client: ClientContext) -> None:
        """Client, every local step: gradients are in ``p.grad``; transform them in place."""

    def on_local_step_end(self, fed: FederationView, client: ClientContext) -> None:
        """Client, every local step: after the optimizer step."""

    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        """Client: local training done; the net holds the local model; ``client.weight`` is the weight."""

    def cohort_grad(self, fed: FederationView, cohort: Cohort) -> tuple[Tensor, list[Tensor]] | None:
        """Vectorised clients, every local step: the cohort form of ``local_grad``. ``cohort.rows`` and
        ``cohort.sizes`` hold the step's rows; returns the clients' losses ``(m,)`` and gradients shaped like
        ``cohort.params``, or None to defer."""
        return None

    def on_cohort_grad(self, fed: FederationView, cohort: Cohort) -> None:
        """Vectorised clients (``algo.vectorize``), every local step: ``cohort.grads`` hold the stacked gradients of
        ``cohort.params``; transform them in place (the cohort form of ``on_local_grad``; :mod:`flx.vectorized`)."""

    def on_cohort_step_end(self, fed: FederationView, cohort: Cohort) -> None:
        """Vectorised clients, every local step: after the stacked optimizer step (the cohort form of
        ``on_local_step_end``)."""

    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        """Server, every rank: ``mean`` is the reduced aggregate (params then float buffers); edit in place."""

    def on_round_end(self, fed: FederationView, rnd: Round) -> None:
        """Server, every rank: the net holds the new global model."""

    def personalize(self, fed: FederationView, cid: int) -> AbstractContextManager | None:
        """Evaluation: a context manager that makes the net client ``cid``'s personalised model and restores it on
        exit, or None (the client is evaluated with the global model)."""
        return None


class RoundRefused(Exception):
    """A part refused the next round (:meth:`FederatedCallback.refuse_round`): the run ends before it, with the
    rounds already run tested as usual, its one line and exit status :attr:`status` (distinct from bad input, 2, and
    a failed run, 3; a requeued job that meets it is not requeued again)."""

    status = 4


def first_answer(parts: Iterable[Part], hook: str, *args: Any) -> Any:
    """The first non-None answer of ``parts`` (in part order) to ``hook(*args)``, or None if none answers; the later
    parts are not asked. The rule of the hooks one part answers for all (``sample_clients``, ``local_update``,
    ``sample_batch``, ``local_grad``, ``cohort_grad``)."""
    for part in parts:
        answer = getattr(part, hook)(*args)
        if answer is not None:
            return answer
    return None


def overrides(part: FederatedCallback, hook: str) -> bool:
    """Whether ``part`` overrides ``hook`` (so the hot loops skip no-op calls)."""
    return getattr(type(part), hook) is not getattr(FederatedCallback, hook)


# the per-step client hooks of the sequential runner, their cohort forms (algo.vectorize), and every client hook
STEP_HOOKS = ("sample_batch", "local_grad", "local_loss", "on_local_grad", "on_local_step_end")
COHORT_FORM = {
    "local_grad": "cohort_grad", "on_local_grad": "on_cohort_grad", "on_local_step_end": "on_cohort_step_end"
}  # fmt: skip
CLIENT_HOOKS = ("on_client_start", "local_update", *STEP_HOOKS, *COHORT_FORM.values(), "on_client_end")


@dataclass(frozen=True)
class Build:
    """What a part's :meth:`FederatedCallback.check` sees: the run as built, nothing trained or written yet.

    Attributes:
        cfg: the round protocol's settings.
        net: the run's model.
        parts: every part, in ``algo.parts`` order (then the ``privacy=`` group's).
        clients: the client store: ``num_train_clients``, ``client_indices``, ``client_support``.
        system: the device / latency simulator, or None.
        resources: the server's own rows and frozen models (:class:`flx.resources.ServerResources`), or None.
        datamodule: the run's set-up :class:`~flx.datamodules.datamodule.FederatedDataModule` (splits, labels,
            server rows), or None for a federation built directly from a client store (tests, scripts).
    """

    cfg: FederationConfig
    net: nn.Module
    parts: tuple[FederatedCallback, ...]
    clients: ClientData
    system: LatencySimulator | None = None
    resources: ServerResources | None = None
    datamodule: Any = None

    def sizes(self) -> dict[int, int]:
        """The rows of each client that trains."""
        c = self.clients
        return {i: len(c.client_indices[i]) for i in range(c.num_train_clients)}
