"""The parts' door is typed, and a type checker holds parts to it: mypy over the scope of ``[tool.mypy]`` in
pyproject.toml (the parts, :mod:`flx.context`, :mod:`flx.hooks`, the client runners) passes, and it is strict enough to
refuse a part that reads a member :class:`flx.context.FederationView` does not have. ``make lint`` runs the same mypy;
this test is how CI (``make test``) runs it.

The federation itself is outside that scope, so one more check asks mypy whether
:class:`flx.federation.Federation` is what the door promises (``FederationView`` and the runners' ``Core``), and
:class:`flx.hooks.FederatedCallback` what ``fed.parts`` hands out (:class:`flx.context.Part`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# each test runs mypy in a subprocess (about 30 s without its cache, .mypy_cache)
pytestmark = pytest.mark.slow


def mypy(*args: str) -> subprocess.CompletedProcess[str]:
    """mypy with the project's configuration, from the repository root (its cache in .mypy_cache, git-ignored)."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )


def test_the_door_and_its_parts_type_check() -> None:
    out = mypy()
    assert out.returncode == 0, out.stdout + out.stderr


def _check(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "probe_part.py"
    path.write_text(source)
    return mypy("--config-file", str(ROOT / "pyproject.toml"), str(path))


def test_mypy_refuses_a_part_that_reads_past_the_door(tmp_path: Path) -> None:
    """A part reading ``fed.not_a_member`` fails mypy: the configuration is strict enough to catch a wrong member (and
    the same part with a real member passes, so the failure is that member's)."""
    part = """
from flx.context import FederationView, Round
from flx.hooks import FederatedCallback


class Probe(FederatedCallback):
    def on_round_end(self, fed: FederationView, rnd: Round) -> None:
        print(fed.{member})
"""
    bad = _check(tmp_path, part.format(member="not_a_member"))
    assert bad.returncode == 1 and '"FederationView" has no attribute "not_a_member"' in bad.stdout, bad.stdout
    good = _check(tmp_path, part.format(member="world_size"))
    assert good.returncode == 0, good.stdout + good.stderr


def test_the_federation_is_what_the_door_promises(tmp_path: Path) -> None:
    conforms = """
from flx.context import Core, FederationView, Part
from flx.federation import Federation
from flx.hooks import FederatedCallback


def door(fed: Federation) -> FederationView:
    return fed


def core(fed: Federation) -> Core:
    return fed


def part(p: FederatedCallback) -> Part:
    return p
"""
    out = _check(tmp_path, conforms)
    assert out.returncode == 0, out.stdout + out.stderr
