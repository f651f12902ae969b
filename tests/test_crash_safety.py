"""Crash-safe runs through the real entry point, with the default settings (`make train`'s configuration).

* a run SIGKILLed in the middle of a round resumes from what is on disk (``ckpt_path=auto``) and ends with the
  same model, bitwise, as the uninterrupted run; earlier metrics and configs are kept;
* a SLURM requeue signal finishes the round, checkpoints, requeues (``scontrol``, a stub here) and resumes the same
  (tests/test_slurm.py does it on a real local cluster);
* a client with a NaN update is dropped with a warning; a round of NaN updates, or ``algo.lr=1e8``, stops the run
  with one line and exit status 3, keeping the last finite checkpoint; so does a finite blow-up (``algo.lr=3``),
  naming the knob that drove it;
* a full disk and a read-only output folder give one line and exit status 2, keeping what was written.

All runs are subprocesses (marked slow). The uninterrupted default run (`default_run`, tests/conftest.py) is shared
with the SLURM tests. The suite writes a checkpoint at every round (``FLX_CHECKPOINT_MIN_SECONDS=0``, conftest.py) so
that these tests can name the round each kill finds on disk; the shipped wall-time floor (``checkpoint.min_seconds``,
5 s) has its own kill-and-resume test below, with nothing pinned.
"""

from __future__ import annotations

import csv
import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from runs import assert_same_model, ckpt, flx_lines, run

from flx.state import ClientStateStore

pytestmark = pytest.mark.slow
KILL = ["+callbacks.kill._target_=helpers.KillMidRound", "+callbacks.kill.round=4"]


def metric_rows(out: Path) -> list[dict[str, str]]:
    """The rows of ``csv/metrics.csv`` without their empty cells."""
    with open(out / "csv" / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if v} for row in csv.DictReader(f)]


def test_default_run_reaches_090_and_keeps_the_last_two_round_checkpoints(default_run) -> None:
    """`make train`'s configuration (FedAvg, digits, MLP, 20 clients, Dirichlet(0.5), 10 per round, 30 rounds)."""
    out, proc = default_run
    assert float(proc.stdout.split("final test_acc=")[1].split()[0]) >= 0.90
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["last.ckpt", "round_00029.ckpt", "round_00030.ckpt"]
    assert os.path.samefile(out / "checkpoints" / "last.ckpt", out / "checkpoints" / "round_00030.ckpt")
    assert ckpt(out / "checkpoints" / "last.ckpt")["flx"]["round"] == 30


def test_sigkill_mid_round_then_resume_equals_uninterrupted(default_run, tmp_path: Path) -> None:
    """Killed (SIGKILL) after the 2nd client of round 5, once round 4's checkpoint is on disk (the next test kills
    while it is in flight): resuming in the same folder with ckpt_path=auto ends bitwise equal to the uninterrupted
    run; metrics and configs of the first try are kept."""
    out = tmp_path / "run"
    killed = run(out, *KILL)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert ckpt(out / "checkpoints" / "last.ckpt")["flx"]["round"] == 4
    assert not list((out / "checkpoints").glob(".*tmp*")), "a temporary checkpoint file was left behind"
    rows_before = metric_rows(out)
    config_before = (out / ".hydra" / "config.yaml").read_bytes()
    assert len(rows_before) >= 4

    resumed = run(out, "ckpt_path=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_model(ckpt(default_run[0] / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))
    assert resumed.stdout.split("final test_acc=")[1] == default_run[1].stdout.split("final test_acc=")[1]
    rows_after = metric_rows(out)
    assert rows_after[: len(rows_before)] == rows_before  # kept, in order (the header may have widened)
    rounds = {int(float(r["fl/round"])) for r in csv.DictReader(open(out / "csv" / "metrics.csv")) if r["fl/round"]}
    assert rounds == set(range(1, 31))
    assert (out / ".hydra" / "config.yaml").read_bytes() == config_before and (
        out / ".hydra" / "config.1.yaml"
    ).exists()


def test_sigkill_under_the_shipped_wall_time_floor_resumes_equal(
    default_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped defaults, the checkpoint floor unpinned (``checkpoint.min_seconds=5``): rounds 1 and 2 take 3 s
    each, so round 1 ends ~3 s after training started (not written: under 5 s) and round 2 ~6 s (written); rounds 3
    and 4 take milliseconds (not written: under 5 s after round 2's). Killed mid round 5, the resumed run redoes
    rounds 3-5 from round 2's file and ends bitwise equal to the uninterrupted run."""
    monkeypatch.delenv("FLX_CHECKPOINT_MIN_SECONDS", raising=False)
    out = tmp_path / "run"
    slow = ["+callbacks.slow._target_=helpers.SleepPerRound", "+callbacks.slow.seconds=3", "+callbacks.slow.until=2"]
    killed = run(out, *KILL, *slow)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["last.ckpt", "round_00002.ckpt"]
    assert ckpt(out / "checkpoints" / "last.ckpt")["flx"]["round"] == 2
    resumed = run(out, "ckpt_path=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_model(ckpt(default_run[0] / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))


def test_sigkill_while_a_checkpoint_is_in_flight_resumes_from_the_one_before(default_run, tmp_path: Path) -> None:
    """Checkpoints are written in the background: a kill while round 4's file is still queued (the writer held for
    30 s) loses that file only; round 3's is intact and the run resumes from it to the same final model. A write
    cut short half way (its temporary file, planted here: a kill cannot be timed into the write) is removed at the
    resume, with a warning."""
    out = tmp_path / "run"
    killed = run(out, *KILL, "+callbacks.kill.stall_write=30")
    assert killed.returncode == -9, killed.stderr[-3000:]
    folder = out / "checkpoints"
    assert ckpt(folder / "last.ckpt")["flx"]["round"] == 3 and not (folder / "round_00004.ckpt").exists()
    (folder / ".round_00004.ckpt.tmp-4242").write_bytes(b"half a checkpoint")
    resumed = run(out, "ckpt_path=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "removed 1 partly written checkpoint file(s)" in resumed.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "round_00029.ckpt", "round_00030.ckpt"]
    assert_same_model(ckpt(default_run[0] / "checkpoints" / "last.ckpt"), ckpt(folder / "last.ckpt"))


def test_slurm_requeue_signal_checkpoints_at_the_round_boundary(default_run, tmp_path: Path) -> None:
    """SIGUSR1 in the middle of round 5 (SLURM's --signal): the round finishes, round_00005 is written, `scontrol
    requeue <job>` is called, the run stops (exit status 138 = 128 + SIGUSR1, one line on stderr, no test); the
    requeued job resumes to the same final model."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(stat.S_IRWXU)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "flx", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    slurm |= {"SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}
    slurm["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    out = tmp_path / "run"
    first = run(out, *KILL, "+callbacks.kill.signal=SIGUSR1", "ckpt_path=auto", env=slurm)
    assert first.returncode == 138, first.stderr[-3000:]
    assert flx_lines(first.stderr) == [
        "flx: requeued after round 5 (SIGUSR1); the job resumes from checkpoints/last.ckpt; exit status 138"
    ]
    assert "final test_acc" not in first.stdout
    assert calls.read_text().split() == ["requeue", "4242"]
    assert ckpt(out / "checkpoints" / "last.ckpt")["flx"]["round"] == 5
    second = run(out, "ckpt_path=auto", env=slurm)
    assert second.returncode == 0, second.stderr[-3000:]
    assert_same_model(ckpt(default_run[0] / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt"))


def test_nan_clients_are_dropped_then_divergence_stops_with_one_line(tmp_path: Path) -> None:
    """Round 2: one NaN client is dropped (a warning line, fl/dropped_clients=1). Round 3: every update is NaN: exit
    status 3 with one 'diverged' line; last.ckpt is round 2's, finite."""
    poison = [
        "+algo.parts.poison._target_=helpers.PoisonFrom",
        "+algo.parts.poison.one=1",
        "+algo.parts.poison.every=2",
    ]
    out = tmp_path / "run"
    proc = run(out, *poison)
    lines = flx_lines(proc.stderr)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert lines[0].startswith("flx: warning: round 2: dropped 1 of 10 clients") and "fault.policy=drop" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("flx: error: diverged in round 3: every client")
    assert "lower algo.lr" in lines[1] and "final test_acc" not in proc.stdout
    last = ckpt(out / "checkpoints" / "last.ckpt")
    assert last["flx"]["round"] == 2 and all(torch.isfinite(t).all() for t in last["state_dict"].values())
    dropped = [
        float(r["fl/dropped_clients"])
        for r in csv.DictReader(open(out / "csv" / "metrics.csv"))
        if r.get("fl/dropped_clients")
    ]
    assert dropped == [0.0, 1.0]

    stop = run(tmp_path / "stop", *poison, "fault.policy=stop")
    assert (
        stop.returncode == 3
        and flx_lines(stop.stderr) == [flx_lines(stop.stderr)[0]]
        and "round 2: client" in stop.stderr
        and "fault.policy=stop" in stop.stderr
    )


def test_huge_learning_rate_stops_as_diverged(tmp_path: Path) -> None:
    """`algo.lr=1e8` used to exit 0 with test_acc=0.1 and a NaN checkpoint: now one line, exit 3, no NaN saved."""
    out = tmp_path / "run"
    proc = run(out, "algo.lr=1e8")
    lines = flx_lines(proc.stderr)
    assert proc.returncode == 3 and lines[-1].startswith("flx: error: diverged in round")
    assert "lower algo.lr (now 1e+08)" in lines[-1] and sum("error" in line for line in lines) == 1
    for path in (out / "checkpoints").glob("*.ckpt"):
        assert all(torch.isfinite(t).all() for t in ckpt(path)["state_dict"].values()), path


def test_finite_blow_up_stops_naming_the_knob_and_can_be_switched_off(tmp_path: Path) -> None:
    """`algo.lr=3` used to exit 0 with train losses ~4e7 and chance accuracy: the finite-divergence rule stops it in
    round 2 (train/loss above 100 x the initial loss in rounds 1 and 2), one line naming algo.lr, exit 3, no
    checkpoint of a diverged round reported as a result. FedAdam with algo.server.lr=1e8 names the server's lr.
    `fault.diverge_factor=null` lets `algo.lr=3` run on."""
    out = tmp_path / "client"
    proc = run(out, "algo.lr=3")
    lines = flx_lines(proc.stderr)
    assert proc.returncode == 3 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("flx: error: diverged in round 2: train/loss ") and "above 100 x the initial" in lines[0]
    assert lines[0].endswith("lower algo.lr (now 3): the blow-up began in round 1, before any server step")
    assert "final test_acc" not in proc.stdout
    assert ckpt(out / "checkpoints" / "last.ckpt")["flx"]["round"] == 1  # round 2 is never saved

    server = run(tmp_path / "server", "algo=fedadam", "algo.server.lr=1e8")
    lines = flx_lines(server.stderr)
    assert server.returncode == 3 and len(lines) == 1, server.stderr[-3000:]
    assert lines[0].startswith("flx: error: diverged in round 2") and "lower algo.server.lr (now 1e+08)" in lines[0]

    off = run(tmp_path / "off", "algo.lr=3", "fault.diverge_factor=null", "algo.rounds=3")
    assert off.returncode == 0 and not flx_lines(off.stderr), off.stderr[-3000:]
    assert "final test_acc" in off.stdout


RULE = "above 100 x the initial loss {} for 2 round(s) in a row (fault.diverge_factor, fault.diverge_rounds; null "


def test_divergence_under_dp_noise_says_the_noise_dominates_and_names_its_levers(tmp_path: Path) -> None:
    """Central DP calibrated to epsilon 0.05 over 5 rounds with 5 of 100 clients (sigma 32.8): the noise on the global
    model, std 32.8 x 0.1 / 5 = 0.656 per coordinate, norm 0.656 sqrt(55210) = 154 per round, buries the mean clipped
    update (norm <= clip 0.1), and the loss blows up from round 2. The line says so and names the levers (it said
    'lower algo.lr')."""
    proc = run(
        tmp_path / "run", "privacy=central", "privacy.target_epsilon=0.05", "algo.clients_per_round=5", "algo.rounds=5"
    )
    assert proc.returncode == 3 and flx_lines(proc.stderr) == [
        "flx: error: diverged in round 3: train/loss 1147 " + RULE.format("2.309") + "switches the rule off); the DP "
        "noise dominates the update: noise of std 0.656 per coordinate on the global model per round (sigma 32.8 x "
        "clip 0.1 / m 5), norm 154 over d = 55210, against the round's mean clipped update of norm 0.0602 (clip 0.1); "
        "raise privacy.target_epsilon (now 0.05), lower privacy.clip (now 0.1) or raise algo.clients_per_round (now 5)"
    ], proc.stderr[-3000:]


def test_fedadam_blow_up_names_the_server_keys_of_the_step_it_began_from(tmp_path: Path) -> None:
    """FedAdam with eta_s = 100: round 1's server step moved the model 7.6e3 x the clients' mean update, its
    denominator at eps (steps ~ eta_s m / tau); the loss blows up from round 2 and the line names algo.server.lr and
    algo.server.eps. It named algo.lr: the last step, taken on round 2's blown-up updates, is shorter than them."""
    proc = run(tmp_path / "run", "algo=fedadam", "algo.server.lr=100", "algo.rounds=5")
    assert proc.returncode == 3 and flx_lines(proc.stderr) == [
        "flx: error: diverged in round 3: train/loss 1.995e+04 " + RULE.format("2.301") + "switches the rule off); "
        "lower algo.server.lr (now 100) or raise algo.server.eps (now 0.001): the server step moved the global model "
        "7.59e+03 x the clients' mean update, its adaptive denominator 0.00132 at eps (second moment ~0: steps ~ lr / "
        "eps)"
    ], proc.stderr[-3000:]


def test_client_lr_blow_up_under_dp_still_names_algo_lr(tmp_path: Path) -> None:
    """Central DP with algo.lr=50: round 1's clients blow up from the initial model, before any noise or server
    step, so the line names algo.lr, not the noise (whose norm is larger than the clipped update's all the same)."""
    proc = run(tmp_path / "run", "privacy=central", "privacy.noise_multiplier=0.5", "algo.lr=50", "algo.rounds=5")
    lines = flx_lines(proc.stderr)
    assert proc.returncode == 3 and lines[-1] == (
        "flx: error: diverged in round 2: train/loss 2.913e+32 " + RULE.format("2.323") + "switches the rule off); "
        "lower algo.lr (now 50): the blow-up began in round 1, before any server step"
    ), proc.stderr[-3000:]


def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir(parents=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.strip()}")


def test_full_disk_and_read_only_folder_give_one_line(tmp_path: Path) -> None:
    """A disk that fills up during the run: exit 2, one line; last.ckpt is a complete earlier checkpoint and no
    temporary file is left. A read-only output folder: exit 2, one line, before anything runs."""
    full, ro = tmp_path / "full", tmp_path / "ro"
    _mount_tmpfs(full, "size=600k")
    try:
        proc = run(full / "run")
        lines = flx_lines(proc.stderr)
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith("flx: error: cannot write") and "No space left on device" in lines[0]
        last = ckpt(full / "run" / "checkpoints" / "last.ckpt")
        assert last["flx"]["round"] >= 1 and not list((full / "run" / "checkpoints").glob(".*tmp*"))
    finally:
        subprocess.run(["umount", str(full)], check=False)
    _mount_tmpfs(ro, "size=64k,ro")
    try:
        proc = run(ro / "run")
        lines = flx_lines(proc.stderr)
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith(f"flx: error: hydra.run.dir='{ro / 'run'}'") and "not writable" in lines[0]
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_sigkill_with_client_state_on_disk_resumes_to_the_same_state(tmp_path: Path) -> None:
    """Ditto (a personal model per client) with ``state_store.backend=disk``: killed in round 5 once round 4's
    checkpoint is on disk and a client of round 5 has written its file, resumed with ckpt_path=auto. The global model
    and every client's personal model equal the uninterrupted run's, bitwise; the state folder ends holding exactly
    the files the kept checkpoints refer to (the killed round's file is gone)."""
    args = ["algo=ditto", "algo.rounds=8", "state_store.backend=disk"]
    full = run(tmp_path / "full", *args)
    assert full.returncode == 0, full.stderr[-3000:]
    out = tmp_path / "run"
    killed = run(out, *args, *KILL)
    assert killed.returncode == -9, killed.stderr[-3000:]
    last = ckpt(out / "checkpoints" / "last.ckpt")
    assert last["flx"]["round"] == 4 and "clients" not in last["flx"]["store"]
    written = {p.name for p in (out / "client_state").iterdir()}
    assert written - {os.path.basename(f) for f in ClientStateStore.files_of(last["flx"]["store"])}, "no orphan"

    resumed = run(out, *args, "ckpt_path=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = ckpt(tmp_path / "full" / "checkpoints" / "last.ckpt"), ckpt(out / "checkpoints" / "last.ckpt")
    assert_same_model(a, b)
    sa, sb = (ClientStateStore.from_state_dict(c["flx"]["store"]) for c in (a, b))
    assert sa.client_ids() == sb.client_ids() and len(sa) > 0
    for cid in sa.client_ids():
        x, y = sa.get(cid), sb.get(cid)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), cid
    kept = [ckpt(out / "checkpoints" / f"round_0000{r}.ckpt")["flx"]["store"] for r in (7, 8)]
    referenced = {os.path.basename(f) for state in kept for f in ClientStateStore.files_of(state)}
    assert {p.name for p in (out / "client_state").iterdir()} == referenced
