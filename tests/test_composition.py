"""The part contract: every part declares what its clients send (``PartTraits``), the one table of cross-part rules
(:mod:`flx.composition`) decides from the declarations alone, and what a part sends without declaring it fails.

- every part of ``flx.parts`` declares its uploads; a statistic a declared part registers is a declared channel (else
  the federation stops at attach); a server hook reads no attribute a client hook of the same part writes (what
  crosses from a client to the server rides in the round's reduce, never in the part's ``self``);
- the made-up "compression" channel of docs/architecture.md: one trait, refused under both privacy modes;
- services: the loss release (local DP, DRFA) and the clients' input noise (FeDXL) are linked by declaration;
- one check path: a federation built directly runs the same checks as a run's build, and a run's checked parts
  are not checked twice;
- docs/privacy.md's coverage table is the one the declarations generate.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import build_of, linear, make_fed, raises_one_line, toy_data

import flx.parts
from flx import composition
from flx.context import FederationConfig, FederationSpec
from flx.errors import ConfigError
from flx.federation import Federation
from flx.hooks import CLIENT_HOOKS, FederatedCallback
from flx.parts.privacy.central_dp import CentralDP
from flx.parts.privacy.local_dp import LocalDP
from flx.parts.proximal.prox import Prox
from flx.parts.robustness.lambda_sampling import LambdaSampling
from flx.parts.xrisk.client_noise import ClientNoise
from flx.parts.xrisk.passive_buffer import PassiveBuffer
from flx.traits import Channel, PartTraits

ROOT = Path(__file__).resolve().parents[1]
SERVER_HOOKS = ("sample_clients", "refuse_round", "on_round_start", "on_server_step", "on_round_end")


def _part_classes() -> list[type[FederatedCallback]]:
    found = []
    for info in pkgutil.walk_packages(flx.parts.__path__, "flx.parts."):  # the families' subpackages too
        module = importlib.import_module(info.name)
        found += [
            cls
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, FederatedCallback) and cls.__module__ == module.__name__
        ]
    return found


PARTS = _part_classes()


def test_every_part_declares_what_its_clients_send() -> None:
    assert len(PARTS) >= 20
    undeclared = [cls.__name__ for cls in PARTS if not cls.traits.declared]
    assert undeclared == []


class _Compression(FederatedCallback):
    """docs/architecture.md's made-up example: clients also send the norm of their compressed update."""

    traits = PartTraits(uploads={"compression/norms": Channel("the norm of its compressed update")})

    def on_attach(self, fed) -> None:
        fed.register_stat("compression/norms", torch.zeros(fed.num_clients))

    def on_client_end(self, fed, client) -> None:
        fed.stat("compression/norms")[client.cid] += 1.0


class _Sneaky(_Compression):
    """Sends a second statistic without declaring it."""

    def on_attach(self, fed) -> None:
        super().on_attach(fed)
        fed.register_stat("compression/residual", torch.zeros(1))


def test_a_part_that_sends_what_it_does_not_declare_fails() -> None:
    make_fed(linear(), toy_data([6, 6]), [_Compression()], clients_per_round=2)  # declared: runs
    with pytest.raises(
        ValueError, match="_Sneaky registers the statistic 'compression/residual', a channel its traits"
    ):
        make_fed(linear(), toy_data([6, 6]), [_Sneaky()], clients_per_round=2)


def test_a_new_channel_is_one_trait_and_privacy_refuses_it() -> None:
    dp = dict(noise_multiplier=1.0, sampling="fixed", accountant="rdp")
    for guard in (CentralDP(**dp), LocalDP(**dp)):
        line = raises_one_line(composition.check_pairs, [_Compression(), guard], match="the norm of its compressed")
        assert line.startswith(f"{type(guard).__name__}: _Compression sends the norm of its compressed update, which")


def test_a_client_part_that_does_not_declare_its_uploads_is_refused_under_privacy() -> None:
    class Quiet(FederatedCallback):
        def on_client_end(self, fed, client) -> None: ...

    class Declared(Quiet):
        traits = PartTraits(uploads={})

    composition.check_pairs([Quiet()])  # without privacy an undeclared part runs
    dp = CentralDP(noise_multiplier=1.0)
    raises_one_line(
        composition.check_pairs,
        [Quiet(), dp],
        match="CentralDP: Quiet hooks the client side (on_client_end) without declaring what its clients send",
    )
    composition.check_pairs([Declared(), dp])


def _written_and_read(cls: type) -> tuple[set[str], set[str]]:
    """``self`` attributes the client hooks write (assign, index-assign, augment, mutate) and the server hooks read,
    following the ``self._helper()`` calls of each."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    funcs = {f.name: f for f in tree.body[0].body if isinstance(f, ast.FunctionDef)}

    def reach(names: list[str]) -> set[str]:
        seen, todo = set(names), list(names)
        while todo:
            for node in ast.walk(funcs[todo.pop()]):
                if isinstance(node, ast.Attribute) and _on_self(node) and node.attr in funcs and node.attr not in seen:
                    seen.add(node.attr)
                    todo.append(node.attr)
        return seen

    written, read = set(), set()
    for name in reach([h for h in CLIENT_HOOKS if h in funcs]):
        for node in ast.walk(funcs[name]):
            target = (
                _root(node.func.value) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            )
            if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, ast.Store):
                target = _root(node)
            if target is not None and (target is not node or isinstance(node.ctx, ast.Store)):
                if isinstance(node, ast.Call) and node.func.attr not in {"append", "extend", "update", "add", "pop"}:
                    continue
                written.add(target.attr)
    for name in reach([h for h in SERVER_HOOKS if h in funcs]):
        read |= {n.attr for n in ast.walk(funcs[name]) if isinstance(n, ast.Attribute) and _on_self(n)}
    return written, read


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id == "self"


def _root(node: ast.AST) -> ast.Attribute | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)) and not (isinstance(node, ast.Attribute) and _on_self(node)):
        node = node.value
    return node if isinstance(node, ast.Attribute) and _on_self(node) else None


class _PassesBySelf(FederatedCallback):
    """What the contract forbids: the client hook leaves a value in ``self`` and the server hook reads it (on one
    process the same object; on two, the server ranks would each see only their own clients)."""

    def on_client_end(self, fed, client) -> None:
        self.losses.append(1.0)

    def on_round_end(self, fed, rnd) -> None:
        self.mean = sum(self.losses)


def test_server_hooks_read_what_crossed_not_what_the_client_hooks_left() -> None:
    written, read = _written_and_read(_PassesBySelf)
    assert written & read == {"losses"}  # the audit sees the breach
    breaches = {cls.__name__: sorted(w & r) for cls in PARTS for w, r in [_written_and_read(cls)] if w & r}
    assert breaches == {}


def test_services_are_linked_by_declaration() -> None:
    dp, lam, drfa_ga = LocalDP(noise_multiplier=1.0), LambdaSampling(), LambdaSampling(mode="ga")
    composition.link([lam, dp])
    assert lam.linked("loss_release") == (dp,) and dp.linked("loss_release") == (lam,)
    composition.link([Prox(), dp])
    assert dp.linked("loss_release") == ()
    noise, fedxl = ClientNoise(), PassiveBuffer()
    composition.link([noise, fedxl])
    assert fedxl.linked("client_noise") == (noise,)
    assert drfa_ga.traits.uses == ("loss_release",) and not any(
        c.kind == "loss" for c in drfa_ga.traits.channels().values()
    )  # DRFA-GA's full loss is a statistic: refused under local DP, never released through it
    # the calibration plans one release a round when a linked part sends a loss, none otherwise
    for consumer, releases in ((lam, 1), (Prox(), 0)):
        dp = LocalDP(noise_multiplier=1.0)
        composition.check(build_of([consumer, dp], FederationConfig(clients_per_round=2)))
        assert dp.releases == releases


class _Counted(FederatedCallback):
    traits = PartTraits(uploads={})

    def __init__(self) -> None:
        self.checks = 0

    def check(self, build) -> None:
        self.checks += 1


def test_one_check_path_for_runs_and_federations_built_directly() -> None:
    """A federation built directly runs the run's build checks (a privacy part's set-up, the aggregator a part
    needs); one whose spec says the run checked its parts does not check them again."""
    part, data = _Counted(), toy_data([6, 6, 6])
    make_fed(linear(), data, [part], clients_per_round=2)
    assert part.checks == 1
    spec = FederationSpec(FederationConfig(clients_per_round=2), checked=(part,))
    Federation(spec, linear(), data, torch.nn.functional.cross_entropy, [part])
    assert part.checks == 1
    with pytest.raises(ConfigError, match="privacy=central noises the weighted mean: use mean"):
        make_fed(linear(), data, [CentralDP(noise_multiplier=1.0)], clients_per_round=2, aggregator="count_mean")
    dp = CentralDP(target_epsilon=4.0)
    make_fed(linear(), data, [dp], clients_per_round=2, rounds=5)
    assert dp.sigma is not None and dp.mechanism.num_clients == 3  # calibrated by the check, not at attach


def test_docs_privacy_coverage_table_is_generated_from_the_declarations() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import privacy_coverage
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    block = privacy_coverage.block()
    assert block in (ROOT / "docs" / "privacy.md").read_text(), (
        f"run python scripts/privacy_coverage.py --write:\n{block}"
    )
    assert "| fedprox | nothing | yes | yes |" in block
    assert "| drfa_ga | its full local loss (DRFA-GA's lambda step) | no: LambdaSampling sends a channel" in block


def test_a_resumed_part_is_checked_attached_then_loaded(tmp_path: Path) -> None:
    """What exists when (docs/round_protocol.md, the hook table): ``check`` at the build, ``on_attach`` when the
    federation is built (the part makes its fresh state), then, on resume, ``load_state_dict`` replaces it."""
    from helpers import RecordOrder

    from flx.config import precheck
    from flx.run import train

    args = ["model=logreg", "partition.num_clients=4", "algo.clients_per_round=2", "algo.local_steps=1"]
    args += ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", f"paths.output_dir={tmp_path}"]
    args += ["+algo.parts.order._target_=helpers.RecordOrder", "eval_every=100"]
    RecordOrder.calls.clear()
    train(precheck([*args, "algo.rounds=1"]))
    assert RecordOrder.calls == ["check", "on_attach"]
    RecordOrder.calls.clear()
    train(precheck([*args, "algo.rounds=2", "ckpt_path=auto"]))
    assert RecordOrder.calls == ["check", "on_attach", "load_state_dict"]
