"""Every command of the docs pages' shell blocks as a user types it (the README's have tests/test_readme.py).

- ``python train.py`` lines: their config is composed and checked in-process (:func:`flx.config.precheck`), then each
  distinct line runs as printed in a shell with a clean environment, shortened only by ``algo.rounds`` (not where
  a privacy budget is calibrated over the printed rounds) and its own run folder (``doc_commands.shortened``). A
  line marked ``# needs <dataset>`` must stop with the one-line "not found" error; a ```console example must print
  the lines shown under it.
- Lines marked ``# needs SLURM`` / ``a GPU`` / ``several machines`` / ``a network`` (:data:`doc_commands.NOT_HERE`)
  cannot run here: their ``train.py`` (or ``sbatch`` script) overrides are checked, the line is not run, and
  :data:`NOT_RUN` counts them so that none is added silently.
- ``make`` lines name targets of the Makefile; ``python scripts/...`` lines name scripts that exist, whose ``--help``
  works and which accept the printed options.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from doc_commands import EXAMPLE, ROOT, SCRIPT, Command, commands, shortened
from runs import flx_lines

PAGES = sorted((ROOT / "docs").glob("*.md"))
# the not-runnable lines by what they need, counted: a new one must be added here on purpose
NOT_RUN = {"SLURM": 3, "several machines": 2, "a network": 1, "a GPU": 1}
# the values a launcher gives a template's variables ("$SLURM_NTASKS_PER_NODE": train.sbatch's 1 node x 4 tasks)
LAUNCHER = {"SLURM_NTASKS_PER_NODE": "4", "SLURM_NNODES": "1", "SLURM_JOB_ID": "1"}
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"
WORKERS = 2  # runs at once: the CI machine has 2 cores


def _all() -> list[Command]:
    return [c for page in PAGES for c in commands(page)]


def _train(cmd: Command) -> bool:
    return bool(EXAMPLE.match(cmd.text)) and not cmd.not_here


def _readme() -> set[str]:
    """The README's lines: tests/test_readme.py runs them."""
    return {c.text for c in commands(ROOT / "README.md")}


def test_every_command_is_of_a_known_kind() -> None:
    """Each command is a ``python train.py`` line, a ``make`` target, a ``python scripts/...`` line, or marked with
    what it needs that no test machine has (counted); and no unlabelled code block holds a command (it would go
    untested: label it ```bash, or ```console with ``$ `` before the command)."""
    lines = _all()
    unknown = [str(c) for c in lines if not (EXAMPLE.match(c.text) or SCRIPT.match(c.text) or _make(c) or c.not_here)]
    assert unknown == []
    assert Counter(n for c in lines for n in c.not_here) == Counter(NOT_RUN), [str(c) for c in lines if c.not_here]
    hidden = [
        f"{page.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
        for page in PAGES
        for text in [page.read_text()]
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)
        if m.group(1) not in ("bash", "sh", "console")
        and re.search(r"^(?:\$ |(?:[A-Z_]+=\S+\s+)*(?:\S*python3? |make |sbatch |srun |torchrun ))", m.group(2), re.M)
    ]
    assert hidden == []


# ---------------------------------------------------------------------------------------------------------------
# the config check, in-process: every train.py line, the not-runnable ones included


def _template(words: list[str]) -> list[str]:
    """A not-runnable line's arguments as its launcher passes them: ``...`` and ``"$@"`` (the user's other
    overrides) dropped, ``$VAR`` from :data:`LAUNCHER`, ``<name>`` placeholders as plain words."""
    words = [w for w in words if w not in ("...", "$@")]
    words = [re.sub(r"\$(\w+)", lambda m: LAUNCHER[m.group(1)], w) for w in words]
    return [re.sub(r"<([^>]*)>", lambda m: re.sub(r"\W", "", m.group(1)), w) for w in words]


def _overrides(cmd: Command) -> tuple[list[str], dict[str, str]] | None:
    """The overrides ``train.py`` gets from ``cmd`` and the environment it sets; None for a line without any."""
    words = shlex.split(cmd.text)
    env = {}
    while re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if "train.py" in words:
        args = words[words.index("train.py") + 1 :]
    elif words[0] == "sbatch":
        (script,) = [w for w in words if w.endswith(".sbatch")]
        assert (ROOT / script).is_file(), f"{cmd}: no {script}"
        args = words[words.index(script) + 1 :]
    else:
        return None
    if not cmd.not_here:
        return args, env
    launched = {}  # the launcher's environment, not this machine's; torchrun's rendezvous id names the run folder
    if words[0] == "torchrun":
        flags = dict(re.findall(r"--([\w-]+)=(\S+)", cmd.text))
        nproc = int(flags["nnodes"]) * int(flags["nproc-per-node"])
        launched = {"TORCHELASTIC_RUN_ID": _template([flags["rdzv-id"]])[0], "WORLD_SIZE": str(nproc)}
    return _template(args), launched


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The earlier run a resuming line names (``<output_dir>``): one round of ``make train``'s config."""
    from runs import run

    out = tmp_path_factory.mktemp("docs") / "base"
    proc = run(out, "algo.rounds=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _expected_error(cmd: Command, no_data: Path) -> str | None:
    """The error ``cmd`` must stop with (one ``flx: error:`` line, without that prefix), as a regular expression."""
    if cmd.printed and cmd.printed[0].startswith("flx: error: "):
        return re.escape(cmd.printed[0].removeprefix("flx: error: ")) + "$"
    if cmd.file:
        return re.escape(f"='{cmd.file}': no such file")
    if cmd.dataset:
        return rf"^data=\w+: {re.escape(cmd.dataset)}\b.* not found at {re.escape(str(no_data))}\b"
    return None


def _checked() -> list[Command]:
    return [c for c in _all() if "train.py" in c.text or c.text.startswith("sbatch ")]


@pytest.mark.parametrize("cmd", _checked(), ids=str)
def test_config_check(
    cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The line's config composes and passes every check, or stops with the one line it must (a missing dataset, a
    file an earlier line writes, the error a ```console example prints)."""
    from flx.config import precheck
    from flx.errors import ConfigError

    overrides, env = _overrides(cmd)
    if cmd.resumes:  # the previous run's folder (a checkpoint is read by the check)
        base = request.getfixturevalue("base_run")
        overrides = [o.replace("<output_dir>", str(base)) for o in overrides]
    if cmd.dataset:
        overrides.append(f"paths.data_dir={tmp_path / 'no_data'}")
    for key in ("WANDB_MODE", "WANDB_API_KEY"):  # set by the test session (conftest.py), not by a user
        monkeypatch.delenv(key, raising=False)
    for key, value in {"HOME": str(tmp_path / "home"), **env}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    expected = _expected_error(cmd, tmp_path / "no_data")
    if expected is None:
        try:
            precheck(overrides)
        except ConfigError as err:
            pytest.fail(f"{cmd}\nflx: error: {err}")
        return
    with pytest.raises(ConfigError) as err:
        precheck(overrides)
    assert re.search(expected, str(err.value)), f"{cmd}\nflx: error: {err.value}"


# ---------------------------------------------------------------------------------------------------------------
# make targets and scripts


def _make(cmd: Command) -> bool:
    return cmd.text.startswith("make ")


def _targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def test_make_targets_exist() -> None:
    """Every ``make X`` of the pages names a target of the Makefile."""
    wanted = {shlex.split(c.text)[1] for c in _all() if _make(c)}
    assert wanted and wanted <= _targets(), wanted - _targets()


# runs a script once per command line given (a JSON list of argument lists) in one process, each only up to its
# argument parser: ``--help`` exits 0, the printed options parse or exit 2; prints the exit statuses, nothing runs
PARSE_ONLY = """import argparse, json, runpy, sys
def stop(parse):
    def parsed(self, *args, **kwargs):
        parse(self, *args, **kwargs)
        sys.exit(0)
    return parsed
for name in ("parse_args", "parse_intermixed_args"):
    setattr(argparse.ArgumentParser, name, stop(getattr(argparse.ArgumentParser, name)))
statuses = []
for sys.argv in json.loads(sys.argv[1]):
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        statuses.append("ran past its parser")
    except SystemExit as stopped:
        statuses.append(stopped.code or 0)
print(json.dumps(statuses))
"""


def _script_args(cmd: Command) -> list[str]:
    """The script's path and the printed arguments (without the page's ``python``)."""
    return shlex.split(SCRIPT.sub(r"\1", cmd.text))


def _env(tmp_path: Path) -> dict[str, str]:
    """A fresh shell's environment with the venv running the tests on the PATH (``source .venv/bin/activate``)."""
    env = {"PATH": f"{Path(sys.executable).parent}:{CLEAN_PATH}", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}
    if os.environ.get("PYTHONPATH"):  # the sources under test (a worktree), not the venv's editable install's
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


@pytest.mark.slow
def test_scripts_exist_and_take_the_printed_options(tmp_path: Path) -> None:
    """Each ``python scripts/...`` line (of the docs pages and the README) names a script that exists, whose ``--help``
    exits 0 and whose parser accepts the printed options (the scripts train for minutes to hours: they are not run
    here). One process a script."""
    by_script: dict[str, list[list[str]]] = {}
    for c in [*_all(), *commands(ROOT / "README.md")]:
        if SCRIPT.match(c.text):
            args = _script_args(c)
            by_script.setdefault(args[0], [[args[0], "--help"]]).append(args)
    assert [s for s in by_script if not (ROOT / s).is_file()] == []
    env = {**_env(tmp_path), "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), "src"]))}

    def statuses(runs: list[list[str]]) -> list[int | str]:
        proc = subprocess.run(
            [sys.executable, "-c", PARSE_ONLY, json.dumps(runs)], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    with ThreadPoolExecutor(WORKERS) as pool:
        done = dict(zip(by_script, pool.map(statuses, by_script.values())))
    assert {s: [0] * len(runs) for s, runs in by_script.items()} == done, by_script


# ---------------------------------------------------------------------------------------------------------------
# the runs


def _runnable() -> list[Command]:
    """The distinct ``train.py`` lines this machine can run, less the README's (tests/test_readme.py runs those)."""
    seen = _readme()
    found = []
    for c in _all():
        if _train(c) and c.text not in seen:
            seen.add(c.text)
            found.append(c)
    return found


def _run(cmd: Command, i: int, out: Path, env: dict[str, str], base: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """``cmd`` shortened, in a shell, in the repository root; a resuming line gets its own copy of the base run."""
    if cmd.resumes:
        shutil.copytree(base, out / f"{i}.base")
        base = out / f"{i}.base"
    line = shortened(cmd, out / str(i), base, out / "no_data")
    proc = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, base if "hydra.run.dir=<output_dir>" in cmd.text else out / str(i)


def _problem(cmd: Command, proc: subprocess.CompletedProcess, folder: Path, no_data: Path) -> str | None:
    """What is wrong with the run of ``cmd`` (None: nothing)."""
    said = f"{cmd}\nexit {proc.returncode}\n{proc.stderr[-2500:]}"
    expected = _expected_error(cmd, no_data)
    if expected is not None:
        lines = flx_lines(proc.stderr)
        ok = proc.returncode == 2 and len(lines) == 1 and re.search(expected, lines[0].removeprefix("flx: error: "))
        return None if ok and not folder.exists() else said
    if proc.returncode != 0 or flx_lines(proc.stderr) or not re.search(r"^final \w+=", proc.stdout, re.M):
        return said
    if cmd.printed and not set(cmd.printed) <= set((proc.stdout + proc.stderr).splitlines()):
        return f"{said}\nprinted lines not in the output: {cmd.printed}"
    ckpt = folder / "checkpoints" / "last.ckpt"
    if cmd.resumes and torch.load(ckpt, map_location="cpu", weights_only=True)["epoch"] + 1 != 2:
        return f"{said}\nthe resumed run did not end at round 2"
    return None


@pytest.mark.slow
def test_train_lines_run_as_printed(tmp_path: Path, base_run: Path) -> None:
    """Every runnable ``python train.py`` line of the pages exits 0 with its final line (a resumed one at round 2), or
    with the one line it must; two at a time. Every failing line is reported, not only the first."""
    lines = _runnable()
    env = _env(tmp_path)
    with ThreadPoolExecutor(WORKERS) as pool:
        runs = list(pool.map(lambda ic: _run(ic[1], ic[0], tmp_path, env, base_run), enumerate(lines)))
    problems = [_problem(c, proc, folder, tmp_path / "no_data") for c, (proc, folder) in zip(lines, runs)]
    failed = [p for p in problems if p]
    assert failed == [], f"{len(failed)} of {len(lines)} lines failed:\n\n" + "\n\n".join(failed)
