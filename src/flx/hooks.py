"""``FederatedCallback``: a Lightning ``Callback`` with the federated hooks. The hook set lives here only.

A part owns one mechanism and its state (``state_dict``/``load_state_dict`` as any Lightning callback,
so it is saved with the checkpoint). Parts are listed in the algorithm config; hook order is list order.
Every hook is optional; the federation calls a hook only on the parts that override it.

Build time: ``check_setup(datamodule, cfg)`` runs once the data is loaded and partitioned, then
``check_federation(datamodule, fed, net)`` once what the federation is built from (its settings, its simulated
system) and the net are, both before anything is written into the run folder and before the Trainer exists, so a
part that cannot use the data, the protocol settings, the system or the net (an AUC part on a 10-class task, a
step-counting part with ``local_epochs``, WHALE without simulated devices) stops the run with one line.
``metric_names()`` says which metric keys the part logs (what ``checkpoint.monitor`` may name; checked at build
time too).

``on_attach(fed)`` runs when the federation is bound to the net and the data (fit start): a part declares its
per-round statistics there (``fed.register_stat``), which ride in the round's one all-reduce, and creates its
per-round state.

Server side (run identically on every rank):

=====================  ==========================================================================
``sample_clients``     choose the round's cohort; the first part returning non-None wins
``refuse_round``       the cohort is drawn, nothing trained: why the round must not run (a privacy budget),
                       one line; the first answer stops the run before the round (:class:`RoundRefused`)
``on_round_start``     after sampling, before any client trains (broadcast buffers, draw t', ...)
``on_server_step``     after the one collective reduce, before the server optimizer (edit the mean)
``on_round_end``       after the server step; the net holds the new global model
``release_loss``       a client's loss at a model, as it releases it (a privacy part noises it)
``divergence_cause``   why the run diverged and the keys to change, when the part is the cause (DP
                       noise); first non-None wins, else the optimizer's keys
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

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
from lightning.pytorch import Callback
from torch import Tensor, nn

from flx.context import ClientContext, Cohort, FederationConfig, FederationSpec, FederationView, Part, Round
from flx.errors import ConfigError

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
    "release_loss",
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

    ``headline`` names the metrics the part logs that a person reads first (without the split: ``auroc`` for
    ``val/auroc`` and ``test/auroc``); the progress bar and the final line show them after the task's own
    (:mod:`flx.console`). Names a run did not log are left out.
    """

    headline: tuple[str, ...] = ()
    # algo.vectorize=true: a part that hooks the client path says True and gives its per-step hooks a cohort form
    # (on_cohort_grad, on_cohort_step_end); flx.vectorized
    vectorizable: bool = False
    # what the part makes clients send besides their model update for the training to use (a statistic in the
    # round's reduce, a value the server computes on their rows): each channel named for a person; a privacy
    # guarantee on the model update does not cover them (check_uploads). Metrics logged for the researcher only
    # (diagnostics) are not uploads
    uploads: tuple[str, ...] = ()
    # uploads that are client losses at a model the server holds, computed through release_loss: a privacy part that
    # implements release_loss noises them (and accounts for them); any other guard refuses them as uploads
    loss_uploads: tuple[str, ...] = ()
    # what a privacy part's guarantee rests on, checked against the other parts at start (check_uploads):
    # "uploads": clients send their model update only; "cohort": the part draws the cohort and reads the aggregate
    # as the mean of the clipped updates; "steps": the part privatises the local steps, so the other parts' step
    # hooks must not read the client's rows (they say data_free_steps)
    guards: tuple[str, ...] = ()
    # True for a part whose step hooks (on_local_grad, on_local_step_end and their cohort forms) read only the models
    # (the local one, the round's global one), never the client's rows: FedProx's proximal term, a prox operator
    data_free_steps: bool = False

    def final_values(self) -> dict[str, float | str]:
        """Values the run's final line ends with (``epsilon=7.9800 private=all``), after the test's headline metrics;
        W&B gets them as ``final/<key>`` in the run's last row (its summary)."""
        return {}

    def check_setup(self, datamodule: Any, cfg: FederationConfig) -> None:
        """Before the Trainer starts: raise a ConfigError for data or protocol settings the part cannot use.

        ``datamodule`` is the set-up :class:`~flx.datamodules.datamodule.FederatedDataModule` (data loaded and
        partitioned), ``cfg`` the round protocol's settings; a check here fails with one line before Lightning
        prints anything.
        """

    def check_federation(self, datamodule: Any, fed: FederationSpec, net: nn.Module) -> None:
        """After :meth:`check_setup`, before anything is written and before the Trainer starts: raise a ConfigError
        for a federation or net the part cannot run on.

        ``fed`` is what the federation will be built from (:class:`flx.context.FederationSpec`: ``fed.cfg``,
        ``fed.store``, ``fed.system``; no data or net bound yet), ``net`` the run's model, ``datamodule`` as in
        :meth:`check_setup`.
        """

    def check_parts(self, parts: Sequence[FederatedCallback]) -> None:
        """After every part's :meth:`check_federation`, before anything is written: raise a ConfigError for other
        parts (``parts``: all of the run's, this one included) the part cannot run beside, or settle what depends on
        them (a privacy part's noise, calibrated for every release the other parts make)."""

    def release_loss(self, fed: FederationView, cid: int, state: dict[str, Tensor], round_idx: int) -> float | None:
        """Server, every rank: client ``cid``'s loss at the model ``state`` (``{name: tensor}`` for
        ``torch.func.functional_call``) as the client releases it, or None to defer (the first non-None wins; the
        caller then computes it itself). A privacy part returns a noised estimate and accounts for it; parts that
        upload losses (``loss_uploads``) ask here first. Same on every rank: draw from ``(seed, round, client)``
        streams."""
        return None

    def divergence_cause(self, fed: FederationView, step: int) -> str | None:
        """Server, every rank, when the run stops as diverged from the model of server step ``step`` (1-based): the
        end of the one-line message, the cause and the keys to change with their values (``the DP noise dominates
        ...; raise privacy.target_epsilon (now 0.5) ...``), or None when the part is not the cause (the first
        non-None wins; else the optimizer's keys, :func:`flx.faults.optimizer_cause`). ``fed.update_norm(step)`` is
        that step's mean client update as reduced, before ``on_server_step``. Claim only what a measurement shows."""
        return None

    def metric_names(self) -> tuple[str, ...]:
        """The keys the part logs into Lightning's metrics (``trainer.callback_metrics``: what ``checkpoint.monitor``
        may name), with their split: ``train/h``; ``{split}/x`` for a metric logged at every evaluation (``val``,
        and ``test`` with ``eval_test``); a ``*`` pattern where the set depends on the run (``lambda/*``). Called at
        build time, after :meth:`check_setup`. None by default: a part that logs nothing."""
        return ()

    def on_attach(self, fed: FederationView) -> None:
        """Fit start, every rank: the federation holds the net and the data. Declare per-round statistics here
        (:meth:`~flx.federation.Federation.register_stat`) and create per-round state (no ``hasattr`` later)."""

    def sample_clients(self, fed: FederationView, round_idx: int, rng: np.random.Generator) -> Sequence[int] | None:
        """Returns the cohort (client ids; repeats allowed and count as multiplicity), or None to defer."""
        return None

    def refuse_round(self, fed: FederationView, rnd: Round) -> str | None:
        """Server, every rank, before ``on_round_start``: the round's draws are known (``rnd.draws``, ``rnd.cohort``)
        and nothing of it has run. Returns why the round must not run (one line, e.g. a privacy budget it would pass),
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
        return the step's loss, a detached scalar (local DP-SGD's per-example clipping and noise)."""
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
    ``sample_batch``, ``local_grad``, ``cohort_grad``, ``release_loss``)."""
    for part in parts:
        answer = getattr(part, hook)(*args)
        if answer is not None:
            return answer
    return None


def overrides(part: FederatedCallback, hook: str) -> bool:
    """Whether ``part`` overrides ``hook`` (so the hot loops skip no-op calls)."""
    return getattr(type(part), hook) is not getattr(FederatedCallback, hook)


def check_uploads(parts: Sequence[FederatedCallback]) -> None:
    """With a privacy part (``guards``), raises a one-line :class:`ConfigError` for another part that breaks what its
    guarantee rests on: makes clients send more than their model update (``uploads``); with ``"cohort"``, draws the
    cohort (the guard's accountant assumes its own sampling) or changes the aggregate in ``on_server_step`` (the guard
    reads it as the mean of the clipped updates, and noises it there); with ``"steps"``, replaces the local steps, or
    hooks them without saying ``data_free_steps`` (its terms would reach the update unclipped)."""
    guard = next((p for p in parts if p.guards), None)
    if guard is None:
        return
    name = type(guard).__name__
    covered = overrides(guard, "release_loss")  # losses through release_loss come out noised and accounted
    for part in parts:
        if part is guard:
            continue
        other = type(part).__name__
        sent = [*part.uploads, *(() if covered else part.loss_uploads)]
        if "uploads" in guard.guards and sent:
            raise ConfigError(
                f"{name}: {other} sends {sent[0]}, which the privacy guarantee does not cover "
                "(only the clipped, noised model update is); run it without privacy"
            )
        if "cohort" in guard.guards and overrides(part, "sample_clients"):
            raise ConfigError(
                f"{name}: {other} draws the cohort, but the privacy accountant assumes the cohort "
                "privacy.sampling draws; run it without privacy"
            )
        if "cohort" in guard.guards and overrides(part, "on_server_step"):
            raise ConfigError(
                f"{name}: {other} changes the aggregate on the server (on_server_step) before the noise "
                "is added to it; run it without privacy"
            )
        if "steps" in guard.guards:
            hooks = [h for h in STEP_HOOKS if overrides(part, h)]
            if hooks and (not part.data_free_steps or set(hooks) & set(STEP_REPLACEMENTS)):
                raise ConfigError(
                    f"{name}: {other} hooks the local steps ({', '.join(hooks)}) with terms the per-example clipping "
                    "does not cover; run it without privacy or with privacy=central"
                )


# the client hooks that shape a local step, and those of them that replace the clipped gradient (check_uploads)
STEP_HOOKS = (
    "local_update", "sample_batch", "local_grad", "local_loss", "on_local_grad", "on_local_step_end", "cohort_grad",
    "on_cohort_grad", "on_cohort_step_end",
)  # fmt: skip
STEP_REPLACEMENTS = ("local_update", "sample_batch", "local_grad", "local_loss", "cohort_grad")
