"""Which parts run together: every cross-part rule, as one table over the parts' declarations (:mod:`flx.traits`).

:func:`check` is the one build-time path: the run's build (:func:`flx.run.check_parts`, before anything is written)
and a federation built directly (the :class:`~flx.federation.Federation` constructor, when the run's build did not
check its parts) both call it. It applies :data:`RULES`, links the parts that provide a service to those that use it
(:func:`link`), then asks every part's own ``check``. A rule reads only traits, the hooks a part overrides, and the
protocol's settings; a new cross-cutting feature is one trait and one row here (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flx.context import FederationConfig
from flx.errors import ConfigError, bad_value
from flx.hooks import CLIENT_HOOKS, COHORT_FORM, STEP_HOOKS, Build, FederatedCallback, overrides
from flx.traits import Channel

# every hook that shapes a local step, and those of them that replace the step's own gradient of the client's rows;
# on_client_start sets the model the steps start from (FedALA learns it on the rows): named when no step hook is
_SHAPES_STEPS = ("local_update", *STEP_HOOKS, *COHORT_FORM.values())
_STARTS = ("on_client_start",)
_REPLACES_STEPS = ("local_update", "sample_batch", "local_grad", "local_loss", "cohort_grad")


def covers(protector: FederatedCallback) -> frozenset[str]:
    """The channel kinds (:data:`flx.traits.CHANNEL_KINDS`) a part that protects the uploads lets other parts send:
    counts always; copies of the local model when it also shapes the local steps (they are its iterates); losses at a
    server model when it provides their release (``loss_release``)."""
    t = protector.traits
    iterates = {"iterate"} if "steps" in t.protects else set()
    return frozenset({"count"} | iterates | ({"loss"} if "loss_release" in t.provides else set()))


def uncovered(part: FederatedCallback, protector: FederatedCallback) -> Channel | None:
    """The first channel ``part`` declares that ``protector`` does not cover, or None."""
    kinds = covers(protector)
    return next((c for c in part.traits.channels().values() if c.kind not in kinds), None)


@dataclass(frozen=True)
class Pair:
    """What a rule over two parts sees: ``guard`` protects something (``traits.protects``), ``part`` is another."""

    guard: FederatedCallback
    part: FederatedCallback

    @property
    def names(self) -> tuple[str, str]:
        return type(self.guard).__name__, type(self.part).__name__


def _sends(p: Pair) -> str | None:
    channel = uncovered(p.part, p.guard)
    if channel is None:
        return None
    guard, other = p.names
    return (
        f"{guard}: {other} sends {channel.what}, which the privacy guarantee does not cover (only the clipped, noised "
        "model update is); run it without privacy"
    )


def _draws(p: Pair) -> str | None:
    if not overrides(p.part, "sample_clients"):
        return None
    guard, other = p.names
    return (
        f"{guard}: {other} draws the cohort, but the privacy accountant assumes the cohort privacy.sampling draws; run "
        "it without privacy"
    )


def _edits_aggregate(p: Pair) -> str | None:
    if not overrides(p.part, "on_server_step"):
        return None
    guard, other = p.names
    return (
        f"{guard}: {other} changes the aggregate on the server (on_server_step) before the noise is added to it; run "
        "it without privacy"
    )


def _reads_rows(p: Pair) -> str | None:
    hooks = [h for h in _SHAPES_STEPS if overrides(p.part, h)] or [h for h in _STARTS if overrides(p.part, h)]
    if not hooks or (p.part.traits.steps == "data_free" and not set(hooks) & set(_REPLACES_STEPS)):
        return None
    guard, other = p.names
    return (
        f"{guard}: {other} hooks the local steps ({', '.join(hooks)}) with terms the per-example clipping does not "
        "cover; run it without privacy or with privacy=central"
    )


def _undeclared(p: Pair) -> str | None:
    hooks = [h for h in CLIENT_HOOKS if overrides(p.part, h)]
    if not hooks or p.part.traits.declared:
        return None
    guard, other = p.names
    return (
        f"{guard}: {other} hooks the client side ({', '.join(hooks)}) without declaring what its clients send "
        "(PartTraits.uploads: {} for nothing beyond the model update); declare it, or run it without privacy"
    )


# (what the guard protects, the rule, what the rule refuses in a few words): asked for every other part, in part
# order, the rules in this order (a channel the guarantee does not cover is the reason to name first)
PAIR_RULES: tuple[tuple[str, Callable[[Pair], str | None], str], ...] = (
    ("uploads", _sends, "sends a channel it does not cover"),
    ("cohort", _draws, "draws the cohort"),
    ("cohort", _edits_aggregate, "changes the aggregate"),
    ("steps", _reads_rows, "hooks the local steps with the rows"),
    ("uploads", _undeclared, "does not declare its uploads"),
)


def check_pairs(parts: Sequence[FederatedCallback]) -> None:
    """The rules between a part that protects something and every other part (:data:`PAIR_RULES`): one line for the
    first that breaks it."""
    guard = next((p for p in parts if p.traits.protects), None)
    if guard is None:
        return
    for part in parts:
        if part is guard:
            continue
        for what, rule, _ in PAIR_RULES:
            line = rule(Pair(guard, part)) if what in guard.traits.protects else None
            if line is not None:
                raise ConfigError(line)


def refusal(parts: Sequence[FederatedCallback], guard: FederatedCallback) -> tuple[FederatedCallback, str] | None:
    """The first part of ``parts`` that ``guard`` refuses by :data:`PAIR_RULES`, and the rule's few words."""
    for part in parts:
        for what, rule, words in PAIR_RULES:
            if what in guard.traits.protects and rule(Pair(guard, part)) is not None:
                return part, words
    return None


def check_aggregator(parts: Sequence[FederatedCallback], cfg: FederationConfig) -> None:
    """The aggregator a part's server step needs (``traits.aggregator``)."""
    for part in parts:
        need = part.traits.aggregator
        if need is not None and cfg.aggregator != need[0]:
            raise bad_value("algo.aggregator", cfg.aggregator, need[1])


def check_settings(parts: Sequence[FederatedCallback], cfg: FederationConfig) -> None:
    """The rules between the parts and the other protocol settings: the local steps (0 only with a part that
    replaces them) and ``algo.vectorize`` (:func:`check_vectorizable`)."""
    if cfg.local_steps == 0 and not any(overrides(p, "local_update") for p in parts):
        raise bad_value("algo.local_steps", 0, "must be >= 1 (0 only with a part that replaces the local steps)")
    if cfg.vectorize:
        check_vectorizable(parts)


def check_vectorizable(parts: Sequence[FederatedCallback]) -> None:
    """``algo.vectorize=true``: every part that hooks the client path declares ``vectorizable`` and gives each
    per-step hook its cohort form; ``local_update`` has none."""
    for part in parts:
        hooked = [h for h in CLIENT_HOOKS if h not in COHORT_FORM.values() and overrides(part, h)]
        fixed = [h for h in hooked if h == "local_update"]
        missing = [h for h in hooked if h in COHORT_FORM and not overrides(part, COHORT_FORM[h])]
        if fixed or missing or (hooked and not part.traits.vectorizable):
            why = ", ".join(fixed or missing or hooked)
            raise ConfigError(
                f"algo.vectorize=true: part {type(part).__name__} has no vectorised form of its client hooks ({why});"
                " use algo.vectorize=false"
            )


def link(parts: Sequence[FederatedCallback]) -> None:
    """Sets every part's ``links``: for a service it uses (``traits.uses``), the parts that provide it; for a
    service it provides, the parts that use it (a loss release, the clients' input noise)."""
    for part in parts:
        used = {s: tuple(q for q in parts if q is not part and s in q.traits.provides) for s in part.traits.uses}
        given = {s: tuple(q for q in parts if q is not part and s in q.traits.uses) for s in part.traits.provides}
        part.links = {s: q for s, q in {**used, **given}.items() if q}


def check(build: Build) -> None:
    """The build-time checks of a run's parts, in one pass: :func:`check_pairs`, :func:`check_aggregator`,
    :func:`link`, every part's own ``check``, then :func:`check_settings`."""
    parts = list(build.parts)
    check_pairs(parts)
    check_aggregator(parts, build.cfg)
    link(parts)
    for part in parts:
        part.check(build)
    check_settings(parts, build.cfg)


def sends(parts: Sequence[FederatedCallback]) -> str:
    """What the clients of ``parts`` send beyond their model update, from the declarations (docs/privacy.md)."""
    if any(not p.traits.declared for p in parts if any(overrides(p, h) for h in CLIENT_HOOKS)):
        return "undeclared"
    return "; ".join(c.what for p in parts for c in p.traits.channels().values() if c.kind != "own") or "nothing"


def verdict(parts: Sequence[FederatedCallback], guard: FederatedCallback) -> str:
    """Whether ``guard`` (a part that protects something) runs beside ``parts``: ``yes``, or ``no: <part> <why>``
    (docs/privacy.md's coverage table)."""
    refused = refusal(parts, guard)
    return "yes" if refused is None else f"no: {type(refused[0]).__name__} {refused[1]}"
