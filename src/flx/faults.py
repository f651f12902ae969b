"""Faulty clients and divergence: what a round does with non-finite losses, updates and models, and with a finite
blow-up.

Policy (``fault.policy``, docs/round_protocol.md "Faulty clients and tiny data"): a client whose mean local loss or
local model is not finite is left out of the round's aggregate (``drop``, the default: one warning line per round,
``fl/dropped_clients``) or stops the run (``stop``: :class:`ClientFault`). A round in which every client was dropped,
a global model that is not finite after the server step, and a finite blow-up of the training loss
(:class:`DivergenceWatch`: ``fault.diverge_factor``, ``fault.diverge_rounds``) stop the run as :class:`Diverged`.
``train.py`` reports a :class:`RunFailure` as one line and exit status 3: a faulty run never ends "successfully".

Each divergence message ends with its cause and the keys to change (:meth:`flx.federation.Federation.
divergence_cause`): the clients' ``algo.lr`` for a blow-up in the first round's local training (the server had not
stepped yet); else a part's answer (``FederatedCallback.divergence_cause``: the DP parts name their noise when it
dominates the update); else the server optimizer's key when its step moved the global model farther than the clients'
mean update did (:func:`optimizer_cause`), else ``algo.lr``.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from flx.choices import ADAPTIVE_SERVER_OPTIMIZERS
from flx.context import FederationConfig, RoundFaults  # RoundFaults: fed.faults's type, the door's (flx.context)


class RunFailure(RuntimeError):
    """A run that cannot go on: reported as one line and a non-zero exit (``train.py``), never as a result."""


class Diverged(RunFailure):
    """The global model, its loss, or every update of a round is not finite."""


class ClientFault(RunFailure):
    """A client's loss or update is not finite and ``fault.policy=stop``."""


_SUM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # others sum in their own dtype


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every entry of every tensor is finite: one sum per tensor (at least fp32), then one host sync.

    A sum is NaN or infinite exactly when an entry is (NaN propagates, ``inf - inf`` is NaN), or when the finite
    entries overflow the sum's dtype (fp32: beyond ~3e38), which only a model that has already blown up reaches. On
    the CPU this is much cheaper than a max-abs reduction (``torch._foreach_norm(..., inf)``;
    docs/performance.md#costs-behind-the-codes-choices).
    """
    if not tensors:
        return True
    sums = [t.detach().sum(dtype=_SUM_DTYPE.get(t.dtype)) for t in tensors]  # half precision summed in fp32
    dtype = sums[0].dtype
    for x in sums[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    if any(x.dtype != dtype for x in sums):
        sums = [x.to(dtype) for x in sums]
    return math.isfinite(torch.stack(sums).sum().item())


def optimizer_cause(cfg: FederationConfig, amplification: float, denominator: float = math.nan) -> str:
    """The optimizer keys a divergence message names, with their values and the measurement that names them.

    A mean of finite client models is a blend of what the clients did; only a server step with its own step size can
    move the model beyond it. So with ``amplification`` (:attr:`flx.server.StepMoves.amplification`:
    ``||w_{t+1} - w_t|| / ||Delta_t||``; plain averaging is exactly 1) at most 1, the clients' ``algo.lr``; above 1
    (or not a number), the server's keys: SGD's ``algo.server.lr`` when above 1 and ``algo.server.momentum`` when its
    buffer outgrew the update (``amplification / lr`` > 1: ``||v_t|| > ||Delta_t||``); an adaptive step's (FedAdam,
    FedAdagrad, FedYogi) ``algo.server.lr``,
    and ``algo.server.eps`` when the ``denominator`` (:attr:`flx.server.StepMoves.denominator`) is within
    twice ``eps``: the second moment is ~0 against it, so the step is ~ ``lr / eps`` times the first moment.
    """
    moved = f"the server step moved the global model {amplification:.3g} x the clients' mean update"
    if amplification <= 1.0:
        return f"lower algo.lr (now {cfg.lr:g}): {moved}, no farther"
    s = cfg.server
    if s.name in ADAPTIVE_SERVER_OPTIMIZERS:
        if denominator <= 2 * s.eps:
            return (
                f"lower algo.server.lr (now {s.lr:g}) or raise algo.server.eps (now {s.eps:g}): {moved}, its "
                f"adaptive denominator {denominator:.3g} at eps (second moment ~0: steps ~ lr / eps)"
            )
        return f"lower algo.server.lr (now {s.lr:g}): {moved}"
    keys = [f"algo.server.lr (now {s.lr:g})"] if not s.lr <= 1.0 else []
    if s.momentum and s.lr > 0 and not amplification / s.lr <= 1.0:  # ||v_t|| > ||Delta_t||: the buffer moved it
        keys.insert(0, f"algo.server.momentum (now {s.momentum:g})")
    return f"lower {' or '.join(keys or [f'algo.server.lr (now {s.lr:g})'])}: {moved}"


def distance(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    """``||a - b||`` over two aligned lists of tensors, as one 0-dim tensor of at least fp32 (no host sync); one
    tensor's difference alive at a time. What :meth:`flx.federation.Federation.update_norm` measures."""
    if not a:
        return torch.zeros(())
    norms = [
        torch.linalg.vector_norm(x - y.to(x.dtype), dtype=torch.promote_types(x.dtype, torch.float32))
        for x, y in zip(a, b)
    ]
    dtype = functools.reduce(torch.promote_types, [n.dtype for n in norms])
    return torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]))


def judge(
    faults: RoundFaults, aggregated: int, cohort: int, r: int, cfg: FederationConfig, warn: bool, cause: str = ""
) -> RoundFaults:
    """Applies the fault policy to round ``r`` (1-based) after its reduce; identical on every rank.

    Args:
        faults: the round's dropped and skipped clients (all ranks').
        aggregated: how many client runs were aggregated (all ranks').
        cohort: the cohort's number of distinct clients.
        r: the round, counted from 1.
        cfg: the round protocol (``fault_policy``, ``lr`` for the hint).
        warn: print the warning line (one rank only).
        cause: what the message ends with, the keys to change (:meth:`flx.federation.Federation.divergence_cause`);
            default ``lower algo.lr``.

    Raises:
        ClientFault: a client was dropped and ``fault_policy="stop"``.
        Diverged: every client run of the round was dropped.
    """
    if not faults.dropped:
        return faults
    cause = cause or optimizer_cause(cfg, 1.0)
    if cfg.fault_policy == "stop":
        raise ClientFault(
            f"round {r}: client {faults.dropped[0]} has a non-finite loss or update (fault.policy=stop); "
            f"use fault.policy=drop, or {cause}"
        )
    if aggregated == 0:
        raise Diverged(
            f"diverged in round {r}: every client's loss or update is not finite "
            f"({len(faults.dropped)} of {len(faults.dropped) + len(faults.skipped)} dropped); {cause}"
        )
    if warn:
        ids = ", ".join(str(c) for c in faults.dropped)
        print(
            f"flx: warning: round {r}: dropped {len(faults.dropped)} of {cohort} clients ({ids}): "
            "non-finite loss or update (fault.policy=drop)",
            file=sys.stderr,
            flush=True,
        )
    return faults


def check_global_model(tensors: Sequence[Tensor], r: int, cause: Callable[[], str]) -> None:
    """Raises :class:`Diverged` if the global model after round ``r``'s server step is not finite (``cause()``: what
    the message ends with, :meth:`flx.federation.Federation.divergence_cause`; asked only then)."""
    if not all_finite(tensors):
        raise Diverged(f"diverged in round {r}: the global model is not finite after the server step; {cause()}")


class DivergenceWatch:
    """The finite-divergence rule: stops a run whose training loss has blown up although it is still finite.

    With ``c`` = ``factor`` (``fault.diverge_factor``), ``r`` = ``rounds`` (``fault.diverge_rounds``), ``L_t`` the
    round's mean local training loss (``train/loss``, the same on every rank) and ``L_0`` the initial model's loss
    (the task loss of the global model before round 1 on the first cohort's rows, summed over the ranks in the
    round's all-reduce: :meth:`flx.federation.Federation.begin_round`, :meth:`set_reference`):

    .. math::
        \\text{stop at round } t \\iff L_s > c\\, L_0 \\quad\\text{for } s = t-r+1, \\dots, t

    Relative to ``L_0``, so the one default fits every task's loss scale (cross-entropy, MSE of raw targets, X-risk
    surrogates). A blow-up inside the first round (``L_1`` already huge: ``algo.lr=3`` on digits gives ``L_1`` ~ 4e7
    against ``L_0`` ~ 2.3) is caught, which a reference taken after round 1 would miss. Rounds with no aggregated
    client leave the count as it is; ``L_0 <= 0`` (a loss that starts at its floor) switches the rule off.
    ``factor`` None: off. The state (``L_0``, the count) is checkpointed, so a resumed run decides alike.
    """

    def __init__(self, factor: float | None = 100.0, rounds: int = 2) -> None:
        self.factor, self.rounds = factor, rounds
        self.reference: float | None = None
        self.streak = 0

    def needs_reference(self) -> bool:
        """Whether the rule is on and ``L_0`` is still to be measured (before the first round)."""
        return self.factor is not None and self.reference is None

    def set_reference(self, loss: float) -> None:
        """Sets ``L_0``; one that is not a finite number > 0 switches the rule off for the run."""
        self.reference = loss if math.isfinite(loss) and loss > 0 else 0.0

    def observe(self, r: int, loss: float | None, cause: Callable[[int], str]) -> None:
        """Counts round ``r``'s training loss ``loss`` (None: no client aggregated) against the rule.

        Raises:
            Diverged: the loss was above ``factor * L_0`` in ``rounds`` consecutive rounds; the message names the
                round, the loss, the rule and ends with ``cause(s)``, ``s`` the first round above
                (:meth:`flx.federation.Federation.divergence_cause`).
        """
        if self.factor is None or not self.reference or loss is None:
            return
        self.streak = self.streak + 1 if loss > self.factor * self.reference else 0
        if self.streak >= self.rounds:
            raise Diverged(
                f"diverged in round {r}: train/loss {loss:.4g} above {self.factor:g} x the initial loss "
                f"{self.reference:.4g} for {self.rounds} round(s) in a row (fault.diverge_factor, "
                f"fault.diverge_rounds; null switches the rule off); {cause(r - self.streak + 1)}"
            )

    def judge(self, counted: dict[str, float], r: int, loss: float | None, cause: Callable[[int], str]) -> None:
        """After round ``r``'s reduce: sets ``L_0`` from the reduced ``initial_*`` counters of the first round (a
        cohort without rows leaves it to the next round), then :meth:`observe`-s the round's loss."""
        if self.factor is None:
            return
        if self.needs_reference() and counted["initial_rows"] > 0:
            self.set_reference(counted["initial_loss_sum"] / counted["initial_rows"])
        self.observe(r, loss, cause)

    def state_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reference, self.streak = state.get("reference"), int(state.get("streak", 0))


REFERENCE_ROWS = 512
"""Rows of the first cohort on which the divergence rule's ``L_0`` is measured: its standard error is a few percent of
the loss, against a threshold of ``fault.diverge_factor`` (100) times it. 4096 rows cost the default CNN's 2-round
bench a fifth of its time (one forward of 4096 3x32x32 rows on one thread, ~1.4 s)."""


def reference_rows(
    indices: Sequence[Tensor], cohort: Sequence[int], rank: int, world_size: int, limit: int = REFERENCE_ROWS
) -> Tensor | None:
    """This rank's share of the rows on which :class:`DivergenceWatch` measures ``L_0``: rows ``rank, rank +
    world_size, ...`` of the first ``limit`` rows of ``cohort``'s clients (in cohort order; ``indices``: each client's
    rows), or None. Each rank adds its share's loss to the round's counters; the round's one all-reduce sums them, so
    every rank gets the same ``L_0`` (:meth:`DivergenceWatch.judge`) without a collective of its own."""
    rows, count = [], 0
    for cid in cohort:
        if count >= limit:
            break
        rows.append(indices[cid])
        count += len(rows[-1])
    mine = torch.cat(rows)[:limit][rank::world_size] if rows else None
    return mine if mine is not None and len(mine) else None


def gather_faults(
    left_out: dict[str, list[int]], counted: dict[str, float], gather: Callable[[Any], list[Any]] | None
) -> RoundFaults:
    """The round's dropped / skipped client ids of every rank: this rank's ``left_out`` (:attr:`flx.context.Round.
    left_out`), all-gathered (``gather``, None on one process) only when the reduced counters say some rank left a
    client out, so a round without faults costs no collective."""
    mine = left_out
    if (counted["dropped"] or counted["skipped"]) and gather is not None:
        everyone = gather(mine)
        mine = {k: [c for part in everyone for c in part[k]] for k in mine}
    return RoundFaults(tuple(sorted(mine["dropped"])), tuple(sorted(mine["skipped"])))
