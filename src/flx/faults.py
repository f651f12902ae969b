"""Faulty clients and divergence: what a round does with non-finite losses, updates and models.

Policy (``fault.policy``, docs/round_protocol.md "Faulty clients and tiny data"): a client whose mean local loss or
local model is not finite is left out of the round's aggregate (``drop``, the default: one warning line per round,
``fl/dropped_clients``) or stops the run (``stop``: :class:`ClientFault`). A round in which every client was dropped,
and a global model that is not finite after the server step, stop the run as :class:`Diverged`. ``train.py``
reports a :class:`RunFailure` as one line and exit status 3: a faulty run never ends "successfully".
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from flx.federation import FederationConfig


class RunFailure(RuntimeError):
    """A run that cannot go on: reported as one line and a non-zero exit (``train.py``), never as a result."""


class Diverged(RunFailure):
    """The global model, its loss, or every update of a round is not finite."""


class ClientFault(RunFailure):
    """A client's loss or update is not finite and ``fault.policy=stop``."""


@dataclass(frozen=True)
class RoundFaults:
    """What the round left out, identical on every rank: ``dropped`` (non-finite loss or update) and ``skipped``
    (no usable rows) client ids."""

    dropped: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()


_SUM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # others sum in their own dtype


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every entry of every tensor is finite: one sum per tensor (at least fp32), then one host sync.

    A sum is NaN or infinite exactly when an entry is (NaN propagates, ``inf - inf`` is NaN), or when the finite
    entries overflow the sum's dtype (fp32: beyond ~3e38), which only a model that has already blown up reaches. On
    the CPU this is ~40x cheaper than a max-abs reduction (``torch._foreach_norm(..., inf)``: 5.7 ms for a
    2.2M-parameter CNN against 0.14 ms).
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


def judge(faults: RoundFaults, aggregated: int, cohort: int, r: int, cfg: FederationConfig, warn: bool) -> RoundFaults:
    """Applies the fault policy to round ``r`` (1-based) after its reduce; identical on every rank.

    Args:
        faults: the round's dropped and skipped clients (all ranks').
        aggregated: how many client runs were aggregated (all ranks').
        cohort: the cohort's number of distinct clients.
        r: the round, counted from 1.
        cfg: the round protocol (``fault_policy``, ``lr`` for the hint).
        warn: print the warning line (one rank only).

    Raises:
        ClientFault: a client was dropped and ``fault_policy="stop"``.
        Diverged: every client run of the round was dropped.
    """
    if not faults.dropped:
        return faults
    if cfg.fault_policy == "stop":
        raise ClientFault(
            f"round {r}: client {faults.dropped[0]} has a non-finite loss or update (fault.policy=stop); "
            f"lower algo.lr (now {cfg.lr:g}) or use fault.policy=drop"
        )
    if aggregated == 0:
        raise Diverged(
            f"diverged in round {r}: every client's loss or update is not finite "
            f"({len(faults.dropped)} of {len(faults.dropped) + len(faults.skipped)} dropped); "
            f"lower algo.lr (now {cfg.lr:g})"
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


def check_global_model(tensors: Sequence[Tensor], r: int, cfg: FederationConfig) -> None:
    """Raises :class:`Diverged` if the global model after round ``r``'s server step is not finite."""
    if not all_finite(tensors):
        raise Diverged(
            f"diverged in round {r}: the global model is not finite after the server step; "
            f"lower algo.lr (now {cfg.lr:g}) or algo.server.lr (now {cfg.server.lr:g})"
        )
