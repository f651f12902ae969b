"""Every value of every key is checked before anything is written (issue 37): a value the checks refuse gives ONE line
naming the key (``flx.errors.ConfigError``, exit status 2 in ``train.py``); a value they accept is one the run takes.

The keys are the leaves of every option of the config groups whose values the pre-run check and the parts'
constructors judge (``algo``, ``privacy``, ``partition``, ``system``, ``trainer``, and the top level with
``checkpoint`` and ``fault``), each option composed once (:func:`flx.config.precheck`); a value is set in the composed
config and judged in process by the checks the run makes before its first write: :func:`flx.checks.validate`,
:func:`flx.checks.check_partition`, the parts' and the privacy part's constructors, the server optimizer's and the
simulator's params. Typed values first (strings, NaN, infinities, huge and negative integers, booleans where numbers
go and numbers where booleans go, lists), then hypothesis's random ones (derandomized: the same cases every run).
A few of the issue's cases run ``train.py`` itself: one line, status 2, a run folder without files.
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import DictConfig, OmegaConf, open_dict
from test_config import run_train

from flx.checks import check_partition, validate
from flx.config import group_options, precheck
from flx.errors import ConfigError, instantiate

GROUPS = ("algo", "privacy", "partition", "system", "trainer", "")  # "": the top level (checkpoint, fault, ...)
SUBGROUPS = {"algo", "privacy", "data", "partition", "system", "model", "trainer", "task", "logger", "callbacks"}
SKIP = {"paths", "hydra", "debug", "experiment", "state_store", "server", "ckpt_path"}  # folders, files: other tests
BASE = ["logger=none", "hydra.run.dir=/tmp/flx-inputs/run", "paths.output_dir=/tmp/flx-inputs/run"]
EXTRA = {  # what an option needs to compose at all
    ("algo", "codasca"): ["data=digits_binary"],
    ("algo", "fedxl1"): ["data=digits_binary"],
    ("algo", "fedxl2"): ["data=digits_binary"],
    ("algo", "fedxl_localpair"): ["data=digits_binary"],
    ("privacy", "central"): ["privacy.target_epsilon=8"],
    ("privacy", "local"): ["privacy.target_epsilon=8"],
}
NAN, INF = float("nan"), float("inf")
TYPED = ("no", NAN, INF, -(10**20), True, [1, 2], 0)
# keys whose number default also takes a word (num_threads=auto, trainer.devices=auto, ...): their words are checked
WORDS = {"num_threads", "trainer.devices", "algo.clients_per_round", "trainer.precision", "checkpoint.min_seconds"}
COUNTS_TOO = {"trainer.fast_dev_run"}  # a boolean default that also takes a count (Lightning's fast_dev_run=5)
NULL_OK = {"trainer.deterministic"}  # null: Lightning's default
REAL_FIX = {"trainer.devices": "trainer.strategy"}  # several devices with strategy=auto: the line names the fix


def _options() -> list[tuple[str, str]]:
    return [(g, o) for g in GROUPS for o in (group_options(g) if g else [""]) if (g, o) != ("partition", "from_file")]


@functools.cache
def _composed(group: str, option: str) -> DictConfig:
    return precheck([*([f"{group}={option}"] if group else []), *EXTRA.get((group, option), []), *BASE])


def _leaves(cfg: DictConfig, group: str) -> dict[str, Any]:
    """``key -> default`` of the group's values (interpolations and ``_target_`` left out: the key they name is)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif not (isinstance(node, str) and "${" in node) and not prefix.rsplit(".", 1)[-1].startswith("_"):
            out[prefix] = node

    node = OmegaConf.select(cfg, group) if group else cfg
    walk(OmegaConf.to_container(node, resolve=False), group)
    top = {k: v for k, v in out.items() if k.split(".")[0] not in SUBGROUPS | SKIP} if not group else out
    return top


def _keys() -> list[tuple[str, str, str]]:
    """``(group, option, key)`` of every leaf, each (key, default) pair once: the options of ``algo`` share
    FedAvg's keys."""
    seen, keys = set(), []
    for group, option in _options():
        for key, default in _leaves(_composed(group, option), group).items():
            if (key, repr(default)) not in seen:
                seen.add((key, repr(default)))
                keys.append((group, option, key))
    return keys


KEYS = _keys()


def _aliases(cfg: DictConfig, key: str) -> set[str]:
    """``key`` and the keys whose value interpolates it (``partition.num_clients: ${data.loader.num_clients}``)."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            flat[prefix] = node

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return {key} | {k for k, v in flat.items() if isinstance(v, str) and "${" in v and key in v}


def check_run(cfg: DictConfig) -> None:
    """What the run checks before its first write, without data: the config, ``run.overwrite``, the partitioner,
    every part."""
    from flx.run import federation_config
    from flx.run_folder import overwrite

    validate(cfg)
    overwrite(cfg)
    check_partition(cfg)
    for part in (cfg.algo.get("parts") or {}).values():
        if part is not None:
            instantiate(part)
    if cfg.get("privacy"):
        instantiate(cfg.privacy)
    federation_config(cfg, 10)
    if cfg.get("system"):
        instantiate(cfg.system, batch_size=32, local_steps=10, num_params=1000)


def verdict(group: str, option: str, key: str, value: Any) -> str | None:
    """The error line of ``key=value`` in ``group=option`` (None: accepted); fails the test on anything but
    :class:`ConfigError`."""
    cfg = _composed(group, option)
    default = OmegaConf.select(cfg, key)
    default = OmegaConf.to_container(default) if OmegaConf.is_config(default) else default
    with open_dict(cfg):
        OmegaConf.update(cfg, key, copy.deepcopy(value), merge=False)
    try:
        check_run(cfg)
        return None
    except ConfigError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any other exception is the traceback this test forbids
        pytest.fail(f"{group}={option} {key}={value!r}: {type(e).__name__}: {e}")
    finally:
        with open_dict(cfg):
            OmegaConf.update(cfg, key, default, merge=False)


def _judge(group: str, option: str, key: str, value: Any) -> None:
    default = OmegaConf.select(_composed(group, option), key)
    line = verdict(group, option, key, value)
    case = f"{group}={option} {key}={value!r} (default {default!r})"
    if line is None:
        refuse = _must_refuse(key, default, value)
        assert not refuse, f"{case}: accepted, but {refuse}"
        return
    assert "\n" not in line, f"{case}: not one line: {line!r}"
    named = _aliases(_composed(group, option), key) | ({REAL_FIX[key]} if key in REAL_FIX else set())
    assert any(k in line for k in named), f"{case}: the line names no key: {line}"
    if isinstance(value, float) and math.isnan(value) and _is_number(default):
        assert "not a number" in line, f"{case}: NaN must say 'not a number': {line}"


def _must_refuse(key: str, default: Any, value: Any) -> str | None:
    """Why ``value`` cannot be right for a key with ``default`` (None: it may be)."""
    if key in COUNTS_TOO or (value is None and key in NULL_OK):
        return None if isinstance(value, (bool, int)) or value is None else "takes true, false or a count"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "a boolean key takes true or false only"
    if isinstance(default, (int, float)) and key not in WORDS:
        if isinstance(value, float) and not math.isfinite(value):
            return "a number key takes finite numbers only"
        if isinstance(value, (str, list, bool)):
            return "a number key takes numbers only"
    return None


@pytest.mark.parametrize(("group", "option", "key"), KEYS, ids=[f"{g or 'top'}={o}:{k}" for g, o, k in KEYS])
def test_typed_values_are_refused_in_one_line_or_accepted(group: str, option: str, key: str) -> None:
    for value in TYPED:
        _judge(group, option, key, value)


VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.booleans(),
    st.text(max_size=6),
    st.lists(st.integers(min_value=-5, max_value=5), max_size=3),
    st.none(),
)


@settings(max_examples=300, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(KEYS), value=VALUES)
def test_random_values_are_refused_in_one_line_or_accepted(case: tuple[str, str, str], value: Any) -> None:
    _judge(*case, value)


# --- the named cases, through train.py: one line, status 2, a run folder without files --------------------

TRACEBACKS = [
    pytest.param(  # too large for the accountant: met at the least noise calibrated (0.1)
        ("privacy=central", "privacy.target_epsilon=1e6"),
        ("privacy.target_epsilon=1000000.0", "noise_multiplier=0.1", "lower privacy.target_epsilon"),
        id="central-huge",
    ),
    pytest.param(
        ("privacy=local", "privacy.target_epsilon=1e9"),
        ("privacy.target_epsilon=1000000000.0", "noise_multiplier=0.1", "lower privacy.target_epsilon"),
        id="local-huge",
    ),
    pytest.param(("privacy=central", "privacy.target_epsilon=inf"), ("privacy.target_epsilon=inf",), id="central-inf"),
    pytest.param(
        ("privacy=local", "privacy.noise_multiplier=1e-12"),
        ("privacy.noise_multiplier=1e-12", ">= 0.1"),
        id="tiny-noise",
    ),
    pytest.param(
        ("privacy=central", "privacy.target_epsilon=8", "privacy.adaptive=no"),
        ("privacy.adaptive='no'", "true, false"),
        id="adaptive-no",
    ),
    pytest.param(("privacy.target_epsilon=8",), ("privacy=central", "privacy.target_epsilon=8"), id="no-privacy-mode"),
    pytest.param(("algo=fedadam", "algo.server.betas=abc"), ("algo.server.betas='abc'", "[0, 1)"), id="betas-abc"),
    pytest.param(("algo=fedprox", "algo.mu=nan"), ("algo.mu=nan", "not a number"), id="mu-nan"),
    pytest.param(  # 20 clients, 10 a round: 15 unseen leave 5 to train
        ("partition.unseen_clients=15",),
        ("partition.unseen_clients=15", "fewer than algo.clients_per_round=10"),
        id="unseen-leaves-too-few",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "expect"), TRACEBACKS)
def test_named_cases_give_one_line_and_write_nothing(
    args: tuple[str, ...], expect: tuple[str, ...], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    rc, out, err = run_train(*args, run_dir=run, data_dir=tmp_path / "data")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("flx: error: "), f"rc={rc}\n{err[-3000:]}"
    assert all(e in lines[0] for e in expect), lines[0]
    assert not [p for p in run.rglob("*") if p.is_file()] if run.exists() else True, list(run.rglob("*"))


def test_a_run_folder_name_over_255_bytes_is_one_line(tmp_path: Path) -> None:
    rc, out, err = run_train(run_dir=tmp_path / ("a" * 300), data_dir=tmp_path / "data")
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert "hydra.run.dir=" in lines[0] and "at most 255" in lines[0]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- what the checks accept runs: edge values at the ends of their ranges, built and fitted for their rounds --------

ACCEPTED = [
    pytest.param(("algo=fedadam", "algo.server.betas=[0,0.5]", "algo.server.eps=1e-12"), id="fedadam-edges"),
    pytest.param(("algo=fedprox", "algo.mu=0", "algo.local_epochs=1"), id="fedprox-mu-0-one-epoch"),
    pytest.param(("algo.local_steps=1", "algo.server.momentum=0.99"), id="one-step"),
    pytest.param(("privacy=central", "privacy.noise_multiplier=0.1", "algo.rounds=2"), id="central-noise-floor"),
    pytest.param(("privacy=central", "privacy.target_epsilon=20", "algo.rounds=2"), id="central-target-20"),
    pytest.param(("privacy=local", "privacy.noise_multiplier=0.1"), id="local-noise-floor"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args", ACCEPTED)
def test_accepted_edge_values_run(args: tuple[str, ...], tmp_path: Path) -> None:
    """A value the checks accept must not fail later: the run is built and fitted (1 round unless given)."""
    from flx.run import build

    out = str(tmp_path / "run")
    quiet = ("logger=none", "checkpoint=null", "callbacks=none", "trainer.enable_progress_bar=false")
    rounds = () if any(a.startswith("algo.rounds=") for a in args) else ("algo.rounds=1",)
    cfg = precheck([*args, *rounds, *quiet, f"hydra.run.dir={out}", f"paths.output_dir={out}"])
    dm, module, trainer = build(cfg)
    trainer.fit(module, datamodule=dm)
    assert trainer.current_epoch == cfg.algo.rounds
    assert all(bool(p.isfinite().all()) for p in module.parameters())
