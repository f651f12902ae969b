"""Bad ``system.*`` values stop ``train.py`` in the pre-run check with one line naming the key, the value and what is
allowed (exit status 2; the contract of ``tests/test_config.py``, whose runner this reuses)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_config import assert_one_line_error, run_train

from flx.config import precheck

CASES = {
    "unknown-option": (("system=nope",), ("system=", "nope", "mobile20, mobile20_code, none")),
    "dynamics": (("system=mobile20", "system.dynamics=random"), ("system.dynamics='random'", "markov, static")),
    "switch-prob": (("system=mobile20", "system.switch_prob=1.5"), ("system.switch_prob=1.5", "[0, 1]")),
    "load-min": (("system=mobile20", "system.load_min=0"), ("system.load_min=0", "(0, 1]")),
    "type": (("system=mobile20", "system.types=[Xavier,Pixel]"), ("system.types=", "Pixel", "RaspberryPi")),
    "rates": (("system=mobile20", "system.link_rates_mbps=[80,0]"), ("system.link_rates_mbps=[80, 0]", "> 0")),
    "unknown-key": (("system=mobile20", "+system.speed=2"), ("system.speed=2", "unknown key", "switch_prob")),
    "key-without-system": (("+system.switch_prob=0.5",), ("system=", "system=mobile20")),
}


@pytest.mark.parametrize(("args", "expect"), list(CASES.values()), ids=list(CASES))
def test_bad_system_value_gives_one_line(args: tuple[str, ...], expect: tuple[str, ...], tmp_path: Path) -> None:
    rc, out, err = run_train(*args, run_dir=tmp_path / "run", data_dir=tmp_path)
    assert_one_line_error(rc, out, err, list(expect))


@pytest.mark.parametrize("option", ["none", "mobile20", "mobile20_code"])
def test_shipped_options_pass_the_check(option: str) -> None:
    cfg = precheck([f"system={option}"])
    assert (cfg.system.get("dynamics") == "static") == (option == "mobile20_code")
