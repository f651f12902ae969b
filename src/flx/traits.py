"""What a part declares about itself: one frozen :class:`PartTraits` value per part (``FederatedCallback.traits``).

The core and :mod:`flx.composition` read only these declarations (and which hooks a part overrides) to decide which
parts run together; no rule reads a part's own attributes. A part whose declarations depend on its parameters sets
``self.traits = dataclasses.replace(type(self).traits, ...)`` in its constructor (or in its build ``check``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import Tensor

    from flx.context import FederationView

# Channel kinds: what a channel carries, which decides which guarantees of another part cover it
# (flx.composition.COVERS).
#   "rows":    a value computed from the client's rows (scores, losses, gradients, statistics); the default
#   "iterate": a copy of the client's model at one of its local steps (what its step-level mechanism already shaped)
#   "loss":    the client's loss at a model the server holds, sent through the run's "loss_release" provider when
#              there is one (the part computes it itself otherwise)
#   "count":   a number fixed by the configuration and the client's size, not by its rows' values (step counts)
#   "own":     a value the declaring part releases through its own mechanism (a clipped count it noises itself)
CHANNEL_KINDS = ("rows", "iterate", "loss", "count", "own")

# What a part's step hooks and its on_client_start read: "rows" (the client's rows or values computed from them) or
# "data_free" (only the models: the local one, the round's global one), e.g. a proximal term
STEP_READS = ("rows", "data_free")


@dataclass(frozen=True)
class Channel:
    """One thing a client sends beyond its model update.

    Attributes:
        what: what it is, for a person (the error lines and docs/privacy.md's coverage table quote it).
        kind: one of :data:`CHANNEL_KINDS`.
    """

    what: str
    kind: str = "rows"

    def __post_init__(self) -> None:
        if self.kind not in CHANNEL_KINDS:
            raise ValueError(f"Channel kind {self.kind!r}: one of {', '.join(CHANNEL_KINDS)}")


@dataclass(frozen=True)
class PartTraits:
    """Every declaration of a part.

    Attributes:
        uploads: what the part makes clients send besides their model update, by channel name (a registered
            statistic's name, ``fed.register_stat``, or a name of the value's own); ``{}`` for nothing; None (the
            default) for *undeclared*. A part that declares its uploads may register only those statistics; a part
            that hooks the client side and leaves them undeclared is refused beside a part that protects the uploads.
            Metrics logged for the researcher only are not uploads.
        steps: what its step hooks and its ``on_client_start`` (the model the steps start from) read
            (:data:`STEP_READS`).
        vectorizable: its client hooks have cohort forms (``on_cohort_grad``, ``on_cohort_step_end``:
            ``algo.vectorize``).
        aggregator: the ``algo.aggregator`` its server step needs, and why (one line), or None.
        provides: services it gives other parts (``"loss_release"``: clients' losses at a server model, released as
            its mechanism releases them; ``"client_noise"``: the clients' input noise); its consumers are linked to it.
        uses: services it uses when another part provides them (linked by :func:`flx.composition.link`).
        protects: what it guarantees and the other parts must not break: ``"uploads"`` (clients send their model
            update and covered channels only), ``"cohort"`` (it draws the cohort and reads the aggregate as it was
            reduced), ``"steps"`` (it shapes the local steps: other step hooks must be data free).
        headline: the metrics it logs that a person reads first, without the split (``auroc`` for ``val/auroc``).
        metrics: the keys it logs into Lightning's metrics, with their split (``train/h``, ``{split}/x``, a ``*``
            pattern where the set depends on the run): what ``checkpoint.monitor`` may name.
    """

    uploads: Mapping[str, Channel] | None = None
    steps: str = "rows"
    vectorizable: bool = False
    aggregator: tuple[str, str] | None = None
    provides: tuple[str, ...] = ()
    uses: tuple[str, ...] = ()
    protects: tuple[str, ...] = ()
    headline: tuple[str, ...] = ()
    metrics: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.steps not in STEP_READS:
            raise ValueError(f"PartTraits.steps {self.steps!r}: one of {', '.join(STEP_READS)}")

    @property
    def declared(self) -> bool:
        """Whether the part said what its clients send (``uploads`` is not None)."""
        return self.uploads is not None

    def channels(self) -> Mapping[str, Channel]:
        """The declared channels (none when undeclared)."""
        return self.uploads or {}


class ReleasesLoss(Protocol):
    """The ``loss_release`` service: what a part that provides it implements, and a part that uses it calls."""

    def release_loss(self, fed: FederationView, cid: int, state: dict[str, Tensor], round_idx: int) -> float:
        """Server, every rank: client ``cid``'s loss at the model ``state`` (``{name: tensor}`` for
        ``torch.func.functional_call``) as the client releases it, booked by the provider. Same on every rank: draw
        from ``(seed, round, client)`` streams."""
        ...
