"""The run folder is never clobbered (flx.run_folder) and every check the config decides runs before anything is
written: the guard of a fresh run against each kind of output, the lock, ``run.overwrite``, a continuing run, every
part's ``check_setup`` / ``check_federation``, ``checkpoint.monitor`` and a cached PM's fingerprint.

Refused runs go through ``train.run`` in this process (they stop before torch work starts); the tests that run a
real ``train.py`` are marked slow and share the session's default run (conftest.default_run)."""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from runs import ENV, ROOT, flx_lines, run, start, wait_for

import flx.parts
from flx.config import precheck
from flx.errors import ConfigError
from flx.hooks import FederatedCallback
from flx.run_folder import LOCK, RunLock, check_continued, check_fresh, claim, move_aside, new_folder, outputs

sys.path.insert(0, str(ROOT))
import train  # noqa: E402  (the entry point's run(): the folder claim, the one-line errors, exit 2)


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256) and every folder (-> "dir")."""
    out: dict[str, str] = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def refused(capfd: pytest.CaptureFixture, folder: Path, *overrides: str) -> str:
    """``train.run`` of ``overrides`` into ``folder`` (in this process): exit status 2 and exactly one stderr line,
    ``flx: error: ...``, before Lightning prints anything; returns that line."""
    cfg = precheck(["logger=csv", *overrides, f"paths.output_dir={folder}"])
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.run(cfg)
    out, err = capfd.readouterr()
    assert exit_.value.code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flx: error: "), err
    assert "GPU available" not in out + err
    return lines[0]


# ---------------------------------------------------------------------------------------------- the guard, unit
def test_outputs_are_files_not_the_lock_moved_aside_outputs_or_empty_folders(tmp_path: Path) -> None:
    (tmp_path / "client_state").mkdir()
    (tmp_path / LOCK).write_text("1\n")
    (tmp_path / "previous-1").mkdir()
    (tmp_path / "previous-1" / "x").write_text("x")
    assert outputs(tmp_path) == [] and outputs(tmp_path / "missing") == []
    check_fresh(str(tmp_path), allow_overwrite=False)
    (tmp_path / "client_state" / "0.pt").write_bytes(b"0")
    (tmp_path / "previous-x").write_text("not a numbered folder: the user's")
    assert outputs(tmp_path) == ["client_state", "previous-x"]


def test_a_fresh_run_into_a_folder_with_files_names_the_folder_and_the_ways_on(tmp_path: Path) -> None:
    for name in ("a", "b", "c", "d", "e"):
        (tmp_path / name).write_text(name)
    with pytest.raises(ConfigError) as info:
        check_fresh(str(tmp_path), allow_overwrite=False)
    assert str(info.value) == (
        f"hydra.run.dir={tmp_path}: already holds a run's outputs (a, b, c, d and 1 more); continue that run with "
        "ckpt_path=auto, start this one in a new folder, or set run.overwrite=true to move the old outputs aside "
        "(never deleted)"
    )
    with pytest.raises(ConfigError, match="is not a flx run folder"):  # run.overwrite=true: files flx did not write
        check_fresh(str(tmp_path), allow_overwrite=True)


def test_move_aside_renames_into_the_first_free_numbered_folder_and_keeps_every_byte(tmp_path: Path) -> None:
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "pm.pt").write_bytes(b"\x00\x01")
    (tmp_path / "empty").mkdir()
    before = tree(tmp_path)
    assert move_aside(str(tmp_path)) == str(tmp_path / "previous-1")
    assert {f"previous-1/{k}": v for k, v in before.items() if k != "empty"} == {
        k: v for k, v in tree(tmp_path).items() if k.startswith("previous-1/")
    }
    assert (tmp_path / "empty").is_dir() and move_aside(str(tmp_path)) is None  # nothing left to move
    (tmp_path / "pm.pt").write_bytes(b"\x02")
    assert move_aside(str(tmp_path)) == str(tmp_path / "previous-2")
    assert (tmp_path / "previous-1" / "pm.pt").read_bytes() == b"\x00\x01"


def checkout(folder: Path) -> Path:
    """A fake git checkout (what ``hydra.run.dir=`` names when train.py runs from one): ``.git/``, ``src/``, files."""
    for name in (".git/HEAD", "src/flx/__init__.py", "README.md"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"{name}\n")
    return folder


def test_run_overwrite_moves_only_a_flx_run_folder_holding_only_what_flx_writes(tmp_path: Path) -> None:
    """A folder with ``.hydra/config.yaml`` and only flx's entries may be moved aside; a checkout (no saved config) or
    a run folder that also holds other files is refused with one line, naming what flx did not write."""
    run_dir = tmp_path / "run"
    for name in (".hydra/config.yaml", "checkpoints/last.ckpt", "csv/metrics.csv", "curves.json", "lambda.json"):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(name)
    check_fresh(str(run_dir), allow_overwrite=True)
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as info:
        check_fresh(str(run_dir), allow_overwrite=True)
    assert str(info.value) == (
        f"hydra.run.dir={run_dir}: also holds files flx did not write (notes.txt); run.overwrite=true moves only a flx "
        "run's own outputs: start this run in a new folder"
    )
    repo = checkout(tmp_path / "repo")
    with pytest.raises(ConfigError) as info:
        check_fresh(str(repo), allow_overwrite=True)
    assert str(info.value) == (
        f"hydra.run.dir={repo}: is not a flx run folder (no .hydra/config.yaml); run.overwrite=true moves only a flx "
        "run's own outputs: start this run in a new folder"
    )


def test_run_overwrite_never_moves_a_checkout(tmp_path: Path) -> None:
    """``train.py hydra.run.dir=<checkout> run.overwrite=true``, the checkout holding a flx run's ``.hydra`` and
    ``checkpoints`` too: one line naming ``.git`` and ``src``, exit 2, every file where it was, byte for byte."""
    repo = checkout(tmp_path / "repo")
    (repo / ".hydra").mkdir()
    (repo / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (repo / "checkpoints").mkdir()
    (repo / "checkpoints" / "last.ckpt").write_bytes(b"a checkpoint")
    before = tree(repo)
    proc = run(repo, "run.overwrite=true", "algo.rounds=1")
    assert proc.returncode == 2 and proc.stdout == ""
    assert flx_lines(proc.stderr) == [
        f"flx: error: hydra.run.dir={repo}: also holds files flx did not write (.git, README.md, src); "
        "run.overwrite=true moves only a flx run's own outputs: start this run in a new folder"
    ]
    assert tree(repo) == before


def test_an_empty_run_dir_is_refused_and_moves_nothing(tmp_path: Path) -> None:
    """``hydra.run.dir=`` (empty: the current folder, here a checkout train.py runs in) with ``run.overwrite=true``:
    one line, exit 2, the checkout byte for byte as it was (it once moved the checkout into ``previous-1/``)."""
    repo = checkout(tmp_path / "repo")
    before = tree(repo)
    cmd = [sys.executable, str(ROOT / "train.py"), "hydra.run.dir=", "run.overwrite=true", "algo.rounds=1"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=300, env={**os.environ, **ENV})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"flx: error: hydra.run.dir='': empty is the current folder ({repo}), not a run folder; name a folder of its "
        "own, or leave hydra.run.dir out for a new one"
    ]
    assert tree(repo) == before


def test_a_fresh_runs_checkpoint_folder_elsewhere_must_be_empty(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    shared = tmp_path / "shared_ckpts"
    shared.mkdir()
    (shared / "round_00001.ckpt").write_bytes(b"another run's")
    before = tree(tmp_path)
    line = refused(capfd, tmp_path / "run", f"checkpoint.dirpath={shared}")
    assert line == (
        f"flx: error: checkpoint.dirpath='{shared}': already holds another run's files (round_00001.ckpt); a fresh run "
        "needs an empty folder there, or continue that run with ckpt_path=auto"
    )
    assert tree(tmp_path) == {**before, "run": "dir"}


def test_time_stamped_folders_of_runs_started_in_the_same_second_are_distinct(tmp_path: Path) -> None:
    """``flx.run_folder.new_folder`` (train.py, for the default folder named by the start time): the name, else the
    first free ``_<k>``; never an existing folder."""
    stamp = str(tmp_path / "runs" / "2026-11-27_15-00-00")
    assert [new_folder(stamp) for _ in range(3)] == [stamp, f"{stamp}_1", f"{stamp}_2"]
    assert sorted(os.listdir(tmp_path / "runs")) == [
        "2026-11-27_15-00-00",
        "2026-11-27_15-00-00_1",
        "2026-11-27_15-00-00_2",
    ]


def test_run_overwrite_must_be_a_boolean_and_is_for_fresh_runs(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    line = refused(capfd, tmp_path, "run.overwrite=yes")
    assert line == "flx: error: run.overwrite='yes': must be true or false"
    line = refused(capfd, tmp_path, "run.overwrite=true", "ckpt_path=auto")
    assert line == "flx: error: run.overwrite=True: is for a fresh run: not with ckpt_path=auto"
    assert tree(tmp_path) == {}


def test_a_continuing_run_refuses_a_folder_whose_saved_config_is_another_runs(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    cfg = precheck(["ckpt_path=auto", f"paths.output_dir={tmp_path}"])
    check_continued(str(tmp_path), cfg)  # no saved config: a run killed before it wrote one
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
    check_continued(str(tmp_path), cfg)  # the same run, killed before its first checkpoint
    other = precheck(["ckpt_path=auto", "seed=3", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"holds another run \(seed is 0 there, 3 here\)"):
        check_continued(str(tmp_path), other)


# ---------------------------------------------------------------------------------------------- the lock, unit
HOLD = (
    "import sys, time; from flx.run_folder import RunLock; RunLock(sys.argv[1]).acquire(); print('held', flush=True); "
    "time.sleep(60)"
)


def test_the_lock_stops_a_second_run_and_dies_with_its_holder(tmp_path: Path) -> None:
    """Held by another process: one line naming the folder and its pid. After ``kill -9`` of the holder the kernel
    has released it (the stale file is no obstacle); a clean release removes the file."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV}
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError) as info:
            RunLock(str(tmp_path)).acquire()
        assert str(info.value) == (
            f"hydra.run.dir={tmp_path}: another run (pid {holder.pid}) is running in this folder; wait for it to end, "
            "or start this run in a new folder"
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / LOCK).exists()
    lock = RunLock(str(tmp_path))
    lock.acquire()
    assert (tmp_path / LOCK).read_text() == f"{os.getpid()}\n"
    lock.release()
    assert not (tmp_path / LOCK).exists()


def test_a_forked_child_does_not_release_its_parents_lock(tmp_path: Path) -> None:
    """DDP's forked ranks (flx.launch.fork_ranks) share the open lock file and leave ``claim`` too."""
    lock = RunLock(str(tmp_path))
    lock.acquire()
    pid = os.fork()
    if pid == 0:
        lock.release()
        os._exit(0)
    os.waitpid(pid, 0)
    with pytest.raises(ConfigError, match="another run"):
        RunLock(str(tmp_path)).acquire()
    lock.release()


def test_a_locked_folder_stops_a_run_before_it_writes(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    lock = RunLock(str(tmp_path))
    lock.acquire()
    try:
        before = tree(tmp_path)
        line = refused(capfd, tmp_path)
        assert line.startswith(f"flx: error: hydra.run.dir={tmp_path}: another run (pid {os.getpid()})")
        assert tree(tmp_path) == before
    finally:
        lock.release()


def test_other_ranks_neither_guard_nor_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "metrics.csv").write_text("written by rank 0\n")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with claim(str(tmp_path), precheck([f"paths.output_dir={tmp_path}"])):
        assert not (tmp_path / LOCK).exists()


# ---------------------------------------------------------------------------------------------- each output kind
KINDS = [
    ".hydra/config.yaml",
    ".hydra/overrides.yaml",
    ".hydra/data_split.json",
    ".hydra/partition.json",
    "checkpoints/last.ckpt",
    "checkpoints/round_00002.ckpt",
    "csv/metrics.csv",
    "curves.json",
    "pm.pt",
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_run_never_touches_a_folder_holding_any_output(
    kind: str, tmp_path: Path, capfd: pytest.CaptureFixture, default_run
) -> None:
    """A folder holding only that output (copied from a finished run; ``pm.pt``: any file there) stops a fresh run
    with one line, exit 2, every file byte-identical and nothing added (the lock file is gone again)."""
    source = default_run[0] / kind
    target = tmp_path / "run" / kind
    target.parent.mkdir(parents=True)
    shutil.copyfile(source, target) if source.exists() else target.write_bytes(b"a cached PM")
    before = tree(tmp_path / "run")
    line = refused(capfd, tmp_path / "run", "model=cnn")
    assert line.startswith(f"flx: error: hydra.run.dir={tmp_path / 'run'}: already holds a run's outputs")
    assert "ckpt_path=auto" in line and "run.overwrite=true" in line
    assert tree(tmp_path / "run") == before


@pytest.mark.slow
def test_train_py_into_a_finished_run_exits_2_and_keeps_every_file(tmp_path: Path, default_run) -> None:
    out = tmp_path / "finished"
    shutil.copytree(default_run[0], out)
    before = tree(out)
    proc = run(out, "model=cnn")
    assert proc.returncode == 2 and proc.stdout == ""
    assert flx_lines(proc.stderr) == [
        f"flx: error: hydra.run.dir={out}: already holds a run's outputs (.hydra, checkpoints, csv, curves.json and 1 "
        "more); continue that run with ckpt_path=auto, start this one in a new folder, or set run.overwrite=true to "
        "move the old outputs aside (never deleted)"
    ]
    assert tree(out) == before


@pytest.mark.slow
def test_run_overwrite_moves_the_old_outputs_aside_then_runs(tmp_path: Path, default_run) -> None:
    out = tmp_path / "finished"
    shutil.copytree(default_run[0], out)
    before = tree(out)
    proc = run(out, "run.overwrite=true", "algo.rounds=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert flx_lines(proc.stderr) == [
        f"flx: run.overwrite=true: moved the earlier outputs of {out} to {out / 'previous-1'}"
    ]
    moved = {k.removeprefix("previous-1/"): v for k, v in tree(out).items() if k.startswith("previous-1/")}
    assert moved == before
    assert (out / "checkpoints" / "round_00001.ckpt").exists() and not (out / LOCK).exists()


@pytest.mark.slow
def test_two_runs_at_once_in_one_folder_one_stops(tmp_path: Path) -> None:
    """The first holds the lock while it runs (slowed by a sleeping part); the second stops with one line and
    writes nothing; the first ends normally and removes the lock file."""
    out = tmp_path / "run"
    slow = ["algo.rounds=3", "+algo.parts.sleep._target_=helpers.SleepPerRound", "+algo.parts.sleep.seconds=2"]
    first = start(out, *slow, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: (out / LOCK).exists(), 60, "the first run's lock")
        second = run(out, "ckpt_path=auto")
        assert second.returncode == 2
        assert flx_lines(second.stderr) == [
            f"flx: error: hydra.run.dir={out}: another run (pid {first.pid}) is running in this folder; wait for it "
            "to end, or start this run in a new folder"
        ]
        assert first.wait(timeout=300) == 0, first.stderr.read()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert not (out / LOCK).exists() and (out / "checkpoints" / "round_00003.ckpt").exists()


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_continues_with_ckpt_path_auto(tmp_path: Path, default_run) -> None:
    """SIGKILL after the run wrote its config, split and partition but before round 1's checkpoint (a sleeping part
    holds round 1 back): ``ckpt_path=auto`` is the same run continuing (a fresh start in its own folder), not a
    clobber. It ends with the default run's model, bitwise, and leaves the files of the first start as they were."""
    from runs import assert_same_model, ckpt

    out = tmp_path / "run"
    sleep = ["+algo.parts.sleep._target_=helpers.SleepPerRound", "+algo.parts.sleep.seconds=5"]
    first = start(out, *sleep)
    try:
        wait_for(lambda: (out / ".hydra" / "partition.json").exists(), 120, "the first start's partition.json")
    finally:
        first.kill()
        first.wait()
    assert not (out / "checkpoints" / "last.ckpt").exists()
    started = {k: v for k, v in tree(out).items() if k.startswith(".hydra/")}
    proc = run(out, "ckpt_path=auto", "+algo.parts.sleep._target_=helpers.SleepPerRound", "+algo.parts.sleep.seconds=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {k: v for k, v in tree(out).items() if k in started} == started
    assert_same_model(ckpt(out / "checkpoints" / "last.ckpt"), ckpt(default_run[0] / "checkpoints" / "last.ckpt"))


# ---------------------------------------------------------------------------------------------- config-only checks
# a failing command line for every part whose build check can fail (its own ``check``, or a rule over its traits:
# the aggregator it needs), and the message it gives
FAILING = {
    "Codasca": (["algo=codasca", "data=digits_binary", "algo.local_epochs=1"], "CODASCA counts stages in steps"),
    "PassiveBuffer": (
        ["algo=fedxl1", "data=digits_binary", "partition=shards", "partition.classes_per_client=1"],
        "FeDXL needs positives and negatives on every client",
    ),
    "PFedMe": (["algo=pfedme", "algo.momentum=0.9"], "pFedMe's local update is plain"),
    "LambdaSampling": (["algo=drfa", "algo.lambda_floor=0.5"], "algo.lambda_floor=0.5: below 1/N"),
    "DualAveraging": (["algo=feddualavg", "algo.momentum=0.9"], "FedDualAvg takes plain gradient steps"),
    "MetaUpdate": (["algo=augfl", "algo.aggregator=mean"], "AugFL's server step (Eq. 13) needs admm_sum"),
    "PMRegularizer": (["algo=augfl", "algo.server_fraction=0"], "needs server rows"),
    "PerFedAvg": (["algo=per_fedavg", "partition=dirichlet"], "Per-FedAvg needs support and query sets"),
    "Subnetwork": (["algo=whale", "system=none"], "system=none: sub-network scheduling needs simulated devices"),
    "LocalLayers": (["algo=fedper", "algo.local=[tail]"], "'tail' names no parameter or buffer of the net"),
    "FedRep": (["algo=fedrep", "algo.rep_epochs=11"], "algo.rep_epochs=11: must be an integer >= 1 and <= 10"),
    "FedBABU": (["algo=fedbabu", "algo.server.weight_decay=0.1"], "must be 0 with FedBABU"),
    "FedDyn": (["algo=feddyn", "algo.aggregator=count_mean"], "FedDyn corrects the weighted mean"),
    "FedALA": (["algo=fedala", "algo.layer_idx=9"], "algo.layer_idx=9: at most the net's 3 layers"),
    "Moon": (["algo=moon", "model=linear"], "has no penultimate features"),
    "FedNova": (
        ["algo=fednova", "+algo.parts.late._target_=flx.parts.systems.random_work.RandomWork"],
        "list the RandomWork part (random local work) before FedNova's",
    ),
    "CentralDP": (
        ["privacy=central", "privacy.noise_multiplier=1.0", "algo.aggregator=count_mean"],
        "privacy=central noises the weighted mean",
    ),
    "LocalDP": (
        ["privacy=local", "privacy.noise_multiplier=1.0", "model=resnet8x4"],
        "privacy=local: the net has BatchNorm",
    ),
}
# Structure's check computes the clients' ground truth, Objective's reads which splits hold per-client rows
NEVER_FAILS = {"Structure", "Objective"}


def _checking_parts() -> set[str]:
    """Every part class in flx.parts that overrides ``check`` or declares the aggregator it needs."""
    import importlib
    import pkgutil

    found = set()
    for info in pkgutil.walk_packages(flx.parts.__path__, "flx.parts."):  # the families' subpackages too
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, FederatedCallback) and cls.__module__ == module.__name__:
                if "check" in vars(cls) or cls.traits.aggregator is not None:
                    found.add(cls.__name__)
    return found


def test_every_build_check_of_a_part_is_walked() -> None:
    assert _checking_parts() == set(FAILING) | NEVER_FAILS


@pytest.mark.parametrize("part", sorted(FAILING))
def test_a_failing_build_check_leaves_the_folder_byte_identical(
    part: str, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    """Run by ``ckpt_path=auto`` into a folder holding a file of an earlier start (allowed: the same run continuing,
    with no saved config yet): the part's check stops it with one line before Lightning prints, and the folder is
    byte-identical (no config, split, partition, metrics or lock file added)."""
    overrides, message = FAILING[part]
    (tmp_path / "notes.txt").write_text("kept\n")
    before = tree(tmp_path)
    line = refused(capfd, tmp_path, *overrides, "algo.rounds=1", "ckpt_path=auto")
    assert message in line
    assert tree(tmp_path) == before


def test_a_monitor_the_run_never_logs_stops_before_anything_is_written(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    line = refused(capfd, tmp_path, "checkpoint.monitor=val/accuracy")
    assert line == (
        "flx: error: checkpoint.monitor='val/accuracy': not logged by this run (val/* needs data.val_fraction > 0, "
        "test/* eval_test=true); it logs train/loss, val/acc, val/loss, val/client_acc_mean, val/client_acc_worst, "
        "val/client_acc_std"
    )
    assert "val/auroc" in refused(capfd, tmp_path, "checkpoint.monitor=test/auroc", "data=digits_binary")
    assert tree(tmp_path) == {}


def test_metric_names_cover_what_a_run_logs(tmp_path: Path, default_run) -> None:
    """The default run's logged val/ and train/ columns are exactly what metric_names announced at build time."""
    import csv

    from flx.module import metric_names
    from flx.run import build

    dm, module, trainer = build(precheck([f"paths.output_dir={tmp_path}"]))
    parts = [cb for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
    names = metric_names(module.task, parts, dm, simulated=False)
    with open(default_run[0] / "csv" / "metrics.csv") as f:
        logged = {k for k in next(csv.reader(f)) if k.startswith(("val/", "train/"))}
    assert logged == {n for n in names if n.startswith(("val/", "train/"))}


def test_a_continuing_run_leaves_the_split_files_as_they_are(tmp_path: Path) -> None:
    """``flx.run.save_split``: written once, whole (renamed into place), never over the files already there."""
    from flx.run import build, save_split

    dm, _, _ = build(precheck([f"paths.output_dir={tmp_path}"]))
    save_split(str(tmp_path), dm)
    written = tree(tmp_path)
    assert {"data_split.json", "partition.json"} <= set(written)
    (tmp_path / "partition.json").write_text("an earlier start's\n")
    save_split(str(tmp_path), dm)
    assert tree(tmp_path) == {**written, "partition.json": hashlib.sha256(b"an earlier start's\n").hexdigest()}


def test_every_part_that_logs_says_what_it_logs() -> None:
    """A part whose code logs metrics (``.log(`` / ``log_dict(`` / ``log_personal_metrics(``) declares them
    (``traits.metrics``: what ``checkpoint.monitor`` is checked against)."""
    import importlib
    import pkgutil

    silent = []
    for info in pkgutil.walk_packages(flx.parts.__path__, "flx.parts."):  # the families' subpackages too
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if not issubclass(cls, FederatedCallback) or cls.__module__ != module.__name__:
                continue
            source = inspect.getsource(cls)
            logs = any(call in source for call in (".log(", "log_dict(", "log_personal_metrics("))
            if logs and not (cls.traits.metrics or "metrics=" in source):  # set in __init__ / check when it depends
                silent.append(cls.__name__)
    assert silent == []


# ---------------------------------------------------------------------------------------------- AugFL's cached PM
def test_a_cached_pm_is_checked_against_what_made_it(tmp_path: Path) -> None:
    import torch

    from flx.models.frozen import cache_fingerprint, check_cache, fingerprint_file

    x, y = torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 0, 1])
    mine = cache_fingerprint({"_target_": "flx.models.nets.MLP"}, x, y, {"epochs": 3}, 7, 2)
    cache = tmp_path / "pm.pt"
    check_cache(cache, mine, "algo.pm_cache")  # no file yet
    cache.write_bytes(b"weights")
    with pytest.raises(ConfigError, match="without a readable fingerprint"):
        check_cache(cache, mine, "algo.pm_cache")
    fingerprint_file(cache).write_text(__import__("json").dumps(mine))
    check_cache(cache, mine, "algo.pm_cache")
    other_rows = cache_fingerprint({"_target_": "flx.models.nets.MLP"}, x.flip(0), y, {"epochs": 3}, 7, 2)
    other_recipe = cache_fingerprint({"_target_": "flx.models.nets.MLP"}, x, y, {"epochs": 4}, 7, 2)
    for other, what in ((other_rows, "training rows"), (other_recipe, "recipe")):
        with pytest.raises(ConfigError) as info:
            check_cache(cache, other, "algo.pm_cache")
        assert str(info.value) == (
            f"algo.pm_cache='{cache}': was made from other {what}{' (data, split)' if what == 'training rows' else ''}"
            " than this run's; move it away or set algo.pm_cache to another file"
        )


def test_a_pm_cached_for_other_data_stops_augfl_before_it_writes(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """``algo=augfl`` with a PM cache made from other server rows (another split seed): one line, nothing written."""
    import json

    cache = tmp_path / "shared" / "pm.pt"
    cache.parent.mkdir()
    cache.write_bytes(b"a PM of another split")
    (tmp_path / "shared" / "pm.pt.json").write_text(json.dumps({"data": "0" * 64}))
    before = tree(tmp_path)
    line = refused(capfd, tmp_path / "run", "algo=augfl", f"algo.pm_cache={cache}", "data.split_seed=4")
    assert line.startswith(f"flx: error: algo.pm_cache='{cache}': was made from other ")
    assert "training rows (data, split)" in line
    assert tree(tmp_path) == {**before, "run": "dir"}
