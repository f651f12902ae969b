"""The command lines of a Markdown page's shell blocks (```bash, ```sh, ```console), read as a user types them, and
the one rule that shortens an example for a test run. Shared by the README's test and the docs pages' test.

A command is one logical line: a line ending in ``\\`` goes on in the next, a ``#`` after a space starts its comment,
comment-only lines are not commands. In a ```console block a command starts with ``$ `` and the lines up to the
next one are its printed output. A comment that starts ``# needs X, Y`` (``: ...`` may follow) names what the line
needs that a test machine lacks: a dataset (the test expects the one-line "not found" error), a file an earlier line
writes (a path: the one-line "no such file" error), or one of :data:`NOT_HERE` (the test checks the line's config
without running it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHELL_BLOCK = re.compile(r"^```(bash|sh|console)\n(.*?)^```", flags=re.S | re.M)
EXAMPLE = re.compile(r"^(?:[A-Z_]+=\S+\s+)*python train\.py\b")  # env assignments, then the entry point
SCRIPT = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(?:python3?|\.venv/bin/python) (scripts/\S+\.py)\b")  # a script's line
# what a line needs that no test machine has: such a line is checked (its config composed), never run
NOT_HERE = ("SLURM", "a GPU", "several machines", "a network")
# a previous run's folder, as the pages write it: the test's base run (one round of the default config) stands in
RUN_FOLDERS = ("logs/train/runs/<run>", "<output_dir>")
SHORT = "algo.rounds=1"
RESUMED = "algo.rounds=2"  # a line that continues the base run (1 round) goes on to round 2
# a line whose noise is calibrated for its rounds (a privacy budget spent over algo.rounds) runs them all: with fewer
# the calibration differs, and one that cannot be met as printed would pass shortened
PLANNED = "privacy.target_epsilon="


@dataclass(frozen=True)
class Command:
    """One command line of a page: ``text`` without its comment, as the shell gets it (continuations joined)."""

    page: str  # the page's path from the repository root
    line: int  # where the command starts (1-based)
    text: str
    comment: str = ""
    printed: tuple[str, ...] = ()  # a ```console block's output lines after the command

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"

    @property
    def needs(self) -> tuple[str, ...]:
        """What the ``# needs X, Y`` comment names (empty without one)."""
        found = re.match(r"needs ([^:;]+)", self.comment)
        return tuple(n.strip() for n in found.group(1).split(",")) if found else ()

    @property
    def dataset(self) -> str | None:
        """The dataset this line needs (``# needs CIFAR-10``: the name its "not found" line gives), if any."""
        return next((n for n in self.needs if n not in NOT_HERE and "/" not in n), None)

    @property
    def file(self) -> str | None:
        """The file this line needs that an earlier line writes (``# needs pm/net.pt``), if any."""
        return next((n for n in self.needs if "/" in n), None)

    @property
    def not_here(self) -> tuple[str, ...]:
        """What this line needs that a test machine cannot have (:data:`NOT_HERE`)."""
        return tuple(n for n in self.needs if n in NOT_HERE)

    @property
    def resumes(self) -> bool:
        """Whether the line continues a previous run (names a run folder placeholder)."""
        return any(p in self.text for p in RUN_FOLDERS)


def _split_comment(line: str) -> tuple[str, str]:
    found = re.search(r"(?:^|\s)#\s(.*)$", line)
    return (line[: found.start()].rstrip(), found.group(1).strip()) if found else (line.rstrip(), "")


def commands(page: Path) -> list[Command]:
    """Every command line of ``page``'s shell blocks, in order."""
    text = page.read_text()
    name = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)
    found: list[Command] = []
    for block in SHELL_BLOCK.finditer(text):
        first = text[: block.start(2)].count("\n") + 1
        found += _block_commands(name, first, block.group(1), block.group(2).splitlines())
    return found


def _block_commands(page: str, first: int, kind: str, lines: list[str]) -> list[Command]:
    found: list[Command] = []
    parts: list[str] = []
    start = 0
    for i, raw in enumerate(lines):
        if kind == "console" and not parts:
            if not raw.startswith("$ "):
                if found and raw.strip():
                    last = found[-1]
                    found[-1] = Command(last.page, last.line, last.text, last.comment, (*last.printed, raw))
                continue
            raw = raw[2:]
        text, comment = _split_comment(raw.strip())
        if not parts and not text:
            continue
        parts.append(text.removesuffix("\\").strip())
        start = start if len(parts) > 1 else first + i
        if not text.endswith("\\"):
            found.append(Command(page, start, " ".join(p for p in parts if p), comment))
            parts = []
    assert not parts, f"{page}:{start}: a line continues past the end of its block"
    return found


def shortened(cmd: Command, folder: Path, base: Path, no_data: Path) -> str:
    """``cmd`` as a test runs it: in its own run folder ``folder``, one round (two where it continues the run in
    ``base``, which stands for the page's run folder; all where :data:`PLANNED`), and where it needs a dataset, with
    ``no_data`` as the data folder (a checkout's ``./data`` may hold the files: not there)."""
    text = cmd.text
    for placeholder in RUN_FOLDERS:
        text = text.replace(placeholder, str(base))
    extra = [RESUMED if cmd.resumes else SHORT] if PLANNED not in text else []
    if "hydra.run.dir=" not in text:
        extra.append(f"hydra.run.dir={folder}")
    if cmd.dataset:
        extra.append(f"paths.data_dir={no_data}")
    return f"{text} {' '.join(extra)}"
