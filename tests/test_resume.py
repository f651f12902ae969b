"""``ckpt_path=auto`` in a folder whose ``last.ckpt`` is gone (flx.resume.newest_round_file): it resumes from the
newest intact round file, skipping newer files that are not intact, or stops with one line; it never restarts from
round 1 in silence.

The runs are ``train.py`` subprocesses of the default config (marked slow): the session's 2-round run
(conftest.two_rounds) is copied, damaged and continued to 3 rounds, and compared with an uninterrupted 3-round run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from runs import assert_same_model, ckpt, flx_lines, run, trained_rounds

from flx.config import precheck
from flx.errors import ConfigError
from flx.run import resume_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def three_rounds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted reference: the default config for 3 rounds."""
    out = tmp_path_factory.mktemp("three_rounds")
    proc = run(out, "algo.rounds=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def without_last(two_rounds: Path, where: Path) -> Path:
    """A copy of the 2-round run whose ``checkpoints/last.ckpt`` is gone (its round files kept)."""
    shutil.copytree(two_rounds, where)
    (where / "checkpoints" / "last.ckpt").unlink()
    assert sorted(p.name for p in (where / "checkpoints").iterdir()) == ["round_00001.ckpt", "round_00002.ckpt"]
    return where


def test_auto_without_last_ckpt_resumes_from_the_newest_round_file(
    two_rounds: Path, three_rounds: Path, tmp_path: Path
) -> None:
    """It says so in one line, continues with round 3 (rows of rounds 1, 2, 3: nothing replayed) and ends bitwise
    equal to the uninterrupted 3-round run."""
    out = without_last(two_rounds, tmp_path / "run")
    proc = run(out, "algo.rounds=3", "ckpt_path=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert flx_lines(proc.stderr) == [
        f"flx: ckpt_path=auto: {out / 'checkpoints'} has no last.ckpt; resuming from round_00002.ckpt"
    ]
    assert trained_rounds(out) == [1, 2, 3]
    assert ckpt(out / "checkpoints" / "last.ckpt")["flx"]["round"] == 3
    assert_same_model(ckpt(out / "checkpoints" / "last.ckpt"), ckpt(three_rounds / "checkpoints" / "last.ckpt"))


def test_a_newest_round_file_that_is_not_intact_falls_back_to_the_one_before(
    two_rounds: Path, three_rounds: Path, tmp_path: Path
) -> None:
    """``round_00002.ckpt`` cut in half: skipped (named in the line); the run resumes from round 1, redoes round 2
    (its row appears twice, the same round recomputed) and ends bitwise equal to the uninterrupted run."""
    out = without_last(two_rounds, tmp_path / "run")
    newest = out / "checkpoints" / "round_00002.ckpt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    proc = run(out, "algo.rounds=3", "ckpt_path=auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert flx_lines(proc.stderr) == [
        f"flx: ckpt_path=auto: {out / 'checkpoints'} has no last.ckpt; resuming from round_00001.ckpt (skipped "
        "round_00002.ckpt: not intact)"
    ]
    assert trained_rounds(out) == [1, 2, 2, 3]
    assert_same_model(ckpt(out / "checkpoints" / "last.ckpt"), ckpt(three_rounds / "checkpoints" / "last.ckpt"))


def test_round_files_none_of_them_intact_or_of_another_run_stop_with_one_line(two_rounds: Path, tmp_path: Path) -> None:
    """No intact round file: one line naming them (nothing to resume, and a silent fresh start would lose them); the
    newest intact one written for another run (another seed): the resume check's line. No round file: a fresh
    start (None)."""
    folder = tmp_path / "checkpoints"
    cfg = precheck(["ckpt_path=auto", f"paths.output_dir={tmp_path}"])
    folder.mkdir()
    assert resume_path(cfg) is None
    (folder / "round_00001.ckpt").write_bytes(b"not a checkpoint")
    (folder / "round_00002.ckpt").write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        resume_path(cfg)
    assert str(info.value) == (
        f"ckpt_path='auto': {folder} has no last.ckpt and none of its round files is an intact flx checkpoint "
        "(round_00002.ckpt, round_00001.ckpt); resume from another with ckpt_path=<file>"
    )
    shutil.copyfile(two_rounds / "checkpoints" / "round_00001.ckpt", folder / "round_00001.ckpt")
    other = precheck(["ckpt_path=auto", "seed=3", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        resume_path(other)
    assert str(info.value) == (
        f"ckpt_path='{folder / 'round_00001.ckpt'}': written for another run: seed is 0 in the checkpoint, 3 in the "
        "config; resume with the same settings"
    )
