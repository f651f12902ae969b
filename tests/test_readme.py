"""The README's commands as a new user types them: its set-up line, then every ``python train.py`` example, in a fresh
shell with a clean environment (no venv on the PATH, an empty home), each shortened only (``algo.rounds``, a
temporary run folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from doc_commands import EXAMPLE, ROOT, RUN_FOLDERS, SCRIPT, SHORT, Command, commands, shortened
from runs import flx_lines

README = ROOT / "README.md"
RUN = RUN_FOLDERS[0]  # the README's placeholder for a run folder: the test's base run stands in
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"


def test_readme_set_up_and_examples() -> None:
    """The README sets up with one line that activates make's venv, and its examples are ``python train.py`` lines
    (the slow test below runs each of them; a line of another shape would have to be added there) or
    ``python scripts/...`` lines (tests/test_docs_commands.py checks that each script takes its printed options)."""
    lines = commands(README)
    assert [(c.text, c.comment) for c in lines if c.text.startswith("source ")] == [
        ("source .venv/bin/activate", "in every new shell: the `python train.py ...` lines below run in that venv")
    ]
    examples = [c for c in lines if EXAMPLE.match(c.text)]
    known = (EXAMPLE.match, SCRIPT.match, lambda text: text.startswith(("source ", "make ")))
    others = [str(c) for c in lines if not any(kind(c.text) for kind in known)]
    assert len(examples) == 8 and others == [], others
    assert [c.needs for c in examples if c.needs] == [("CIFAR-10",)] and sum(RUN in c.text for c in examples) == 2


def _venv() -> Path:
    """The venv running the tests (``make test``: the checkout's ``.venv``); the README's ``.venv`` stands for it."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests do not run in a venv: the README's set-up (source .venv/bin/activate) cannot be run")
    return Path(sys.prefix)


def _set_up(venv: Path) -> str:
    """The README's set-up line, as written when the checkout's ``.venv`` is the venv running the tests, else with
    ``.venv`` replaced by that venv's path (a git worktree sharing its main checkout's venv)."""
    (line,) = [c.text for c in commands(README) if c.text.startswith("source ")]
    mine = ROOT / ".venv"
    return line if mine.exists() and mine.samefile(venv) else line.replace(".venv/", f"{venv}/")


def _shortened(cmd: Command, i: int, out: Path) -> str:
    """Example ``i`` shortened (``doc_commands.shortened``; ``<run>`` is the base run's folder), its output and exit
    status in files."""
    line = shortened(cmd, out / str(i), out / "base", out / "no_data")
    return f"{line} > {out}/{i}.out 2> {out}/{i}.err; echo $? > {out}/{i}.rc"


def _script(out: Path, examples: list[Command], venv: Path) -> str:
    """One fresh shell: what `python` is before and after the set-up, the base run (`make train`'s, 1 round) that
    ``<run>`` names, then every example, each with its output and exit status in files."""
    lines = [f"cd {ROOT}", f"command -v python > {out}/before", _set_up(venv), f"command -v python > {out}/after"]
    lines.append(f"python train.py {SHORT} hydra.run.dir={out / 'base'} > {out}/base.out 2>&1")
    lines += [_shortened(cmd, i, out) for i, cmd in enumerate(examples)]
    return "\n".join(lines)


def _last_round(folder: Path) -> tuple[int, dict[str, torch.Tensor]]:
    ckpt = torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return ckpt["epoch"] + 1, ckpt["state_dict"]


@pytest.mark.slow
def test_readme_examples_run_in_a_fresh_shell(tmp_path: Path) -> None:
    """Every example exits 0 with its final line, except the dataset one: exactly one ``flx: error:`` line saying
    where CIFAR-10's files must go, exit 2, no run folder. The two resume lines take the base run on to round 2 (one
    into a new folder, one in place) and end with the same model, bit for bit."""
    venv = _venv()
    examples = [c for c in commands(README) if EXAMPLE.match(c.text)]
    env = {"PATH": CLEAN_PATH, "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}
    if os.environ.get("PYTHONPATH"):  # the sources under test (a worktree), not the venv's editable install's
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    assert str(venv / "bin") not in env["PATH"].split(os.pathsep)
    script = _script(tmp_path, examples, venv)
    subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, check=True, timeout=900)
    assert (tmp_path / "before").read_text().strip() != (tmp_path / "after").read_text().strip()
    assert Path((tmp_path / "after").read_text().strip()).samefile(venv / "bin" / "python")
    for i, cmd in enumerate(examples):
        status, err = int((tmp_path / f"{i}.rc").read_text()), (tmp_path / f"{i}.err").read_text()
        if cmd.dataset:
            assert status == 2 and len(flx_lines(err)) == 1, err[-2000:]
            assert "data=cifar10: CIFAR-10 not found at " + str(tmp_path / "no_data") in flx_lines(err)[0]
            assert not (tmp_path / str(i)).exists()
            continue
        assert status == 0 and flx_lines(err) == [], f"{cmd}\n{err[-3000:]}"
        assert "final test_acc=" in (tmp_path / f"{i}.out").read_text(), cmd
    folders = {i: tmp_path / ("base" if "hydra.run.dir=" in c.text else str(i)) for i, c in enumerate(examples)}
    resumed = [_last_round(folders[i]) for i, c in enumerate(examples) if RUN in c.text]
    assert [r for r, _ in resumed] == [2, 2]
    assert all(torch.equal(resumed[0][1][k], resumed[1][1][k]) for k in resumed[0][1])
    assert any((folders[i] / "wandb").is_dir() for i, c in enumerate(examples) if "logger=wandb" in c.text)
