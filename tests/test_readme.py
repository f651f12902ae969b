"""The README's commands as a new user types them: its set-up line, then every ``python train.py`` example, in a fresh
shell with a clean environment (no venv on the PATH, an empty home), each shortened only (``algo.rounds``, a
temporary run folder)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runs import flx_lines

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLE = re.compile(r"^(?:[A-Z_]+=\S+\s+)*python train\.py\b")  # env assignments, then the entry point
RUN = "logs/train/runs/<run>"  # the README's placeholder for a run folder: the test's base run stands in
SHORT = "algo.rounds=1"
RESUMED = "algo.rounds=2"  # the lines that resume the base run (1 round) go on to round 2
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"


def bash_lines() -> list[str]:
    """The non-empty lines of README.md's ```bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def command(line: str) -> str:
    """The line without its trailing comment."""
    return re.sub(r"\s+#\s.*$", "", line)


def needs_files(line: str) -> bool:
    """An example whose comment says it needs a dataset this machine cannot have (``# needs CIFAR-10``)."""
    return "# needs " in line


def test_readme_set_up_and_examples() -> None:
    """The README sets up with one line that activates make's venv, and its examples are ``python train.py`` lines
    (the slow test below runs each of them; a line of another shape would have to be added there)."""
    lines = bash_lines()
    assert [line for line in lines if line.startswith("source ")] == [
        "source .venv/bin/activate   # in every new shell: the `python train.py ...` lines below run in that venv"
    ]
    examples = [line for line in lines if EXAMPLE.match(line)]
    others = [line for line in lines if not EXAMPLE.match(line) and not line.startswith(("source ", "make "))]
    assert len(examples) == 8 and others == [], others
    assert sum(needs_files(line) for line in examples) == 1 and sum(RUN in line for line in examples) == 2


def _venv() -> Path:
    """The venv running the tests (``make test``: the checkout's ``.venv``); the README's ``.venv`` stands for it."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests do not run in a venv: the README's set-up (source .venv/bin/activate) cannot be run")
    return Path(sys.prefix)


def _set_up(venv: Path) -> str:
    """The README's set-up line, as written when the checkout's ``.venv`` is the venv running the tests, else with
    ``.venv`` replaced by that venv's path (a git worktree sharing its main checkout's venv)."""
    (line,) = [command(line) for line in bash_lines() if line.startswith("source ")]
    mine = ROOT / ".venv"
    return line if mine.exists() and mine.samefile(venv) else line.replace(".venv/", f"{venv}/")


def _shortened(line: str, i: int, out: Path) -> str:
    """Example ``i`` with its own run folder and fewer rounds; ``<run>`` is the base run's folder."""
    cmd = command(line).replace(RUN, str(out / "base"))
    extra = [RESUMED if str(out / "base") in cmd else SHORT]
    if "hydra.run.dir=" not in cmd:
        extra.append(f"hydra.run.dir={out / str(i)}")
    if needs_files(line):
        extra.append(f"paths.data_dir={out / 'no_data'}")  # the checkout's ./data may hold the files: not here
    return f"{cmd} {' '.join(extra)} > {out}/{i}.out 2> {out}/{i}.err; echo $? > {out}/{i}.rc"


def _script(out: Path, examples: list[str], venv: Path) -> str:
    """One fresh shell: what `python` is before and after the set-up, the base run (`make train`'s, 1 round) that
    ``<run>`` names, then every example, each with its output and exit status in files."""
    lines = [f"cd {ROOT}", f"command -v python > {out}/before", _set_up(venv), f"command -v python > {out}/after"]
    lines.append(f"python train.py {SHORT} hydra.run.dir={out / 'base'} > {out}/base.out 2>&1")
    lines += [_shortened(line, i, out) for i, line in enumerate(examples)]
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
    examples = [line for line in bash_lines() if EXAMPLE.match(line)]
    env = {"PATH": CLEAN_PATH, "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8"}
    if os.environ.get("PYTHONPATH"):  # the sources under test (a worktree), not the venv's editable install's
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    assert str(venv / "bin") not in env["PATH"].split(os.pathsep)
    script = _script(tmp_path, examples, venv)
    subprocess.run(["bash", "-c", script], env=env, cwd=tmp_path, check=True, timeout=900)
    assert (tmp_path / "before").read_text().strip() != (tmp_path / "after").read_text().strip()
    assert Path((tmp_path / "after").read_text().strip()).samefile(venv / "bin" / "python")
    for i, line in enumerate(examples):
        status, err = int((tmp_path / f"{i}.rc").read_text()), (tmp_path / f"{i}.err").read_text()
        if needs_files(line):
            assert status == 2 and len(flx_lines(err)) == 1, err[-2000:]
            assert "data=cifar10: CIFAR-10 not found at " + str(tmp_path / "no_data") in flx_lines(err)[0]
            assert not (tmp_path / str(i)).exists()
            continue
        assert status == 0 and flx_lines(err) == [], f"{line}\n{err[-3000:]}"
        assert "final test_acc=" in (tmp_path / f"{i}.out").read_text(), line
    folders = {i: tmp_path / ("base" if "hydra.run.dir=" in line else str(i)) for i, line in enumerate(examples)}
    resumed = [_last_round(folders[i]) for i, line in enumerate(examples) if RUN in line]
    assert [r for r, _ in resumed] == [2, 2]
    assert all(torch.equal(resumed[0][1][k], resumed[1][1][k]) for k in resumed[0][1])
    assert any((folders[i] / "wandb").is_dir() for i, line in enumerate(examples) if "logger=wandb" in line)
