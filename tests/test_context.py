"""The narrow door (flx.context): parts see the federation only through ``FederationView``, the client runners through
``Core``; the round is one object (``Round``), planned then frozen, and the federation keeps no per-round attribute.

The door is checked on the source: every ``fed.<name>`` (and ``self.fed.<name>``) that a part, the hooks or the
evaluation helpers write must be a member of ``FederationView``, and every one the runners write a member of
``Core``; and no module behind the door imports ``flx.federation``, not even for annotations.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from helpers import linear, make_fed, run_rounds, toy_data

from flx.context import Core, FederationView, Round
from flx.hooks import FederatedCallback
from flx.sampling import number_copies
from flx.traits import PartTraits

SRC = Path(__file__).resolve().parents[1] / "src" / "flx"
PARTS = sorted((SRC / "parts").rglob("*.py"))  # the families' subpackages too
BEHIND_THE_DOOR = [SRC / f"{name}.py" for name in ("hooks", "evaluation")]
RUNNERS = [SRC / "clients.py", SRC / "vectorized.py"]


def _id(path: Path) -> str:
    """``parts/robustness/qffl`` for a part of a family, ``hooks`` for a core module."""
    return path.relative_to(SRC).with_suffix("").as_posix()


def members(protocol: type) -> set[str]:
    """The names a Protocol declares: annotated attributes, methods and properties, its bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls.__module__ != "flx.context":
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {n for n in vars(cls) if not n.startswith("_")}
    return names


def used(path: Path) -> dict[str, int]:
    """``name -> line`` for every ``fed.name``, ``self.fed.name`` and ``federation.name`` in the file."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id in ("fed", "federation")) or (
            isinstance(owner, ast.Attribute) and owner.attr in ("fed", "federation")
        ):
            found.setdefault(node.attr, node.lineno)
    return found


@pytest.mark.parametrize("path", PARTS + BEHIND_THE_DOOR, ids=_id)
def test_parts_use_only_the_door(path: Path) -> None:
    allowed = members(FederationView)
    outside = {name: line for name, line in used(path).items() if name not in allowed}
    assert not outside, f"{path.name} uses fed members outside flx.context.FederationView: {outside}"


@pytest.mark.parametrize("path", RUNNERS, ids=lambda p: p.stem)
def test_client_runners_use_only_core(path: Path) -> None:
    allowed = members(Core)
    outside = {name: line for name, line in used(path).items() if name not in allowed}
    assert not outside, f"{path.name} uses fed members outside flx.context.Core: {outside}"


def test_the_scan_sees_what_parts_use() -> None:
    """A guard against a door test that passes by seeing nothing: known uses are found, a made-up one is refused."""
    assert {"register_stat", "stat", "global_params"} <= set(used(SRC / "parts" / "robustness" / "qffl.py"))
    assert {"buffer", "min_rows", "load_global"} <= set(used(SRC / "clients.py"))
    assert "server_opt" not in members(FederationView) and "buffer" not in members(FederationView)
    assert "buffer" in members(Core)


@pytest.mark.parametrize("path", PARTS + BEHIND_THE_DOOR + RUNNERS + [SRC / "context.py"], ids=_id)
def test_nothing_behind_the_door_imports_the_federation(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.module != "flx.federation", f"{path.name}:{node.lineno} imports flx.federation"
        if isinstance(node, ast.Import):
            assert all(a.name != "flx.federation" for a in node.names), f"{path.name}:{node.lineno}"


def test_the_federation_has_every_member_of_the_door() -> None:
    """The door does not promise what the federation lacks: an attached federation has every member of ``Core``."""
    fed = make_fed(linear(), toy_data([5, 6]), clients_per_round=2, local_steps=1)
    run_rounds(fed, 1)
    missing = sorted(name for name in members(Core) if not hasattr(fed, name))
    assert not missing, missing


class _Planner(FederatedCallback):
    """Records what the round lets it do while planned, and tries to change the plan from a client hook."""

    def __init__(self) -> None:
        self.errors: list[type] = []

    def on_round_start(self, fed, rnd) -> None:
        assert rnd.planning
        rnd.set_width(rnd.cohort[0], 0.5)

    def on_client_start(self, fed, client) -> None:
        for change in (lambda: setattr(client.round, "cohort", ()), lambda: client.round.set_width(client.cid, 1.0)):
            try:
                change()
            except (AttributeError, RuntimeError) as err:
                self.errors.append(type(err))


def test_the_round_is_planned_then_frozen_and_the_federation_keeps_no_round_attribute() -> None:
    """``begin_round`` makes a new ``Round``; the plan is writable in ``on_round_start`` and frozen for the client
    hooks (an attribute raises AttributeError, a width RuntimeError); the rounds add no attribute to the federation."""
    part = _Planner()
    fed = make_fed(linear(), toy_data([5, 6, 7]), [part], clients_per_round=2, local_steps=1)
    attached = set(vars(fed))
    run_rounds(fed, 1)
    first = fed.rnd
    run_rounds(fed, 1, start=1)
    assert isinstance(first, Round) and fed.rnd is not first and fed.rnd.round == 1 and not fed.rnd.planning
    assert part.errors == [AttributeError, RuntimeError] * 4  # 2 clients a round, 2 rounds
    assert fed.rnd.width(fed.rnd.cohort[0]) == 0.5 and fed.rnd.width(fed.rnd.cohort[1]) == 1.0
    assert set(vars(fed)) == attached


def test_copies_are_numbered_over_the_ranks_in_rank_order() -> None:
    """``duplicates=repeat``: client 4's three copies on ranks 0, 0, 1 are copies 0, 1 on rank 0 and 2 on rank 1; a
    client with one copy is not among the repeated ones."""
    shards = [[1, 4, 4], [4, 7]]
    assert number_copies(shards, 0) == ({1: [0], 4: [0, 1]}, {4})
    assert number_copies(shards, 1) == ({4: [2], 7: [0]}, {4})
    rnd = Round(3)
    rnd.copies = {4: [0, 1]}
    assert [rnd.next_copy(4), rnd.next_copy(4), rnd.next_copy(4), rnd.next_copy(9)] == [0, 1, 0, 0]


def test_round_width_is_checked_by_the_simulator() -> None:
    seen: list[float] = []
    rnd = Round(0, check_width=seen.append)
    rnd.set_width(2, 0.25)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        rnd.set_width(2, 0.0)
    assert seen == [0.25] and rnd.width(2) == 0.25 and rnd.width(3) == 1.0
    rnd.freeze()
    with pytest.raises(RuntimeError, match="on_round_start"):
        rnd.set_width(2, 0.5)
    with pytest.raises(AttributeError, match="planned"):
        rnd.round = 4


class _Work(FederatedCallback):
    """Sets client ``i``'s local steps to ``i + 1`` while the round is planned; records what each client trains."""

    traits = PartTraits(uploads={}, steps="data_free", vectorizable=True)

    def __init__(self) -> None:
        self.trained: dict[int, int] = {}

    def on_round_start(self, fed, rnd) -> None:
        for cid in rnd.cohort:
            rnd.set_steps(cid, cid + 1)

    def on_client_start(self, fed, client) -> None:
        self.trained[client.cid] = client.num_steps


@pytest.mark.parametrize("vectorize", [False, True])
def test_round_steps_set_while_planned_are_what_clients_train(vectorize: bool) -> None:
    """``rnd.set_steps``: ``fed.client_steps`` reads it (the configured work for the others and outside a plan that
    set none), the client trains that many steps on either runner; refused once planned and for a non-integer or a
    negative count."""
    part = _Work()
    fed = make_fed(linear(), toy_data([5, 6, 7]), [part], clients_per_round=3, local_steps=4, vectorize=vectorize)
    assert fed.client_steps(2) == 4  # before any round
    run_rounds(fed, 1)
    assert part.trained == {0: 1, 1: 2, 2: 3} and fed.client_steps(2) == 3
    rnd = Round(0)
    with pytest.raises(ValueError, match="integer >= 0"):
        rnd.set_steps(1, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="integer >= 0"):
        rnd.set_steps(1, -1)
    rnd.freeze()
    with pytest.raises(RuntimeError, match="on_round_start"):
        rnd.set_steps(1, 2)


def test_no_part_reaches_the_federation_through_the_module() -> None:
    """A part gets the federation as the ``fed`` of its hooks (a part that needs it in a Lightning hook keeps the one
    of ``on_attach``), never as ``pl_module.federation``."""
    reaching = [
        path.name
        for path in PARTS
        if any(s in path.read_text() for s in ("pl_module.federation", 'getattr(pl_module, "federation"'))
    ]
    assert not reaching, reaching


def test_all_reduce_is_the_identity_on_one_process() -> None:
    """``fed.all_reduce_(t)`` sums ``t`` over the processes in place; on one process ``t`` comes back as it was, the
    same tensor, and the process group's reduce is never called."""
    calls: list[torch.Tensor] = []

    def reduce_sum(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return x

    fed = make_fed(linear(), toy_data([5, 6]), reduce_sum=reduce_sum, clients_per_round=2)
    t = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64)
    assert fed.all_reduce_(t) is t and t.tolist() == [1.5, -2.0, 3.25] and t.dtype == torch.float64 and not calls


def test_all_reduce_sums_in_place_with_the_process_groups_reduce() -> None:
    """With ``world_size > 1`` the process group's sum lands in ``t`` itself, in its dtype (two ranks mocked: the
    other rank holds the same values)."""
    fed = make_fed(linear(), toy_data([5, 6]), world_size=2, reduce_sum=lambda x: 2 * x, clients_per_round=2)
    t = torch.tensor([1.5, -2.0], dtype=torch.float64)
    assert fed.all_reduce_(t) is t and t.tolist() == [3.0, -4.0] and t.dtype == torch.float64
