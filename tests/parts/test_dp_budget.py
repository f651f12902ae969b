"""The privacy budget on every path a run can take (:class:`flx.parts.privacy.dp_budget.Budgeted`): checked before every
round, the first of a fresh run included; a run stopped on its budget relaunched (``ckpt_path=auto``, three times),
extended (a larger ``algo.rounds``) or requeued by SLURM trains no further round; repeated draws count each run; and
the privacy settings are part of what a checkpoint may continue. Real runs of ``train.py`` (the exit status is part
of the promise)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from runs import ckpt, flx_lines, run

from flx import privacy
from flx.config import precheck
from flx.errors import ConfigError
from flx.resume import check_ckpt

pytestmark = pytest.mark.slow
SMALL = ["model=logreg", "partition.num_clients=6", "algo.clients_per_round=3", "algo.local_steps=3"]
CENTRAL = [*SMALL, "privacy=central", "privacy.noise_multiplier=1.0"]
BUDGET_STATUS = 4


def _final_line(stdout: str) -> str:
    return [line for line in stdout.splitlines() if line.startswith("final ")][-1]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_first_round_over_the_budget_never_runs(tmp_path: Path, mode: str) -> None:
    """The issue's command: sigma 1 with a target of 0.01, which one round already passes (central: epsilon 3.53).
    The run stops before round 1 with one line and exit status 4; no round is trained, so no checkpoint exists, and
    the final line reports the untrained model at epsilon 0."""
    proc = run(
        tmp_path, f"privacy={mode}", "privacy.noise_multiplier=1.0", "privacy.target_epsilon=0.01", "algo.rounds=3"
    )
    assert proc.returncode == BUDGET_STATUS, proc.stderr[-2000:]
    (line,) = flx_lines(proc.stderr)
    assert line.startswith("flx: privacy budget: round 1 ") and "> privacy.target_epsilon=0.01 (delta=1e-05)" in line
    assert line.endswith("the run ends with the 0 round(s) it ran (epsilon=0.0000); exit status 4")
    assert not (tmp_path / "checkpoints").exists()
    assert _final_line(proc.stdout).endswith("epsilon=0.0000 private=all")


def test_a_spent_budget_stays_spent_on_every_way_a_run_continues(tmp_path: Path) -> None:
    """6 clients, 3 expected a round, sigma 1: epsilon 4.85 after 2 rounds, 5.84 after 3 (the accountant's numbers,
    checked here), so a budget of 5 ends the 6-round run after round 2, checkpointed. Relaunched with
    ``ckpt_path=auto`` three times, extended to 10 rounds, and requeued by SLURM (``SLURM_RESTART_COUNT=1``, which
    means ``ckpt_path=auto``): each stops before round 3 with the same line, status 4 and the same final line, and the
    checkpoint is left as it was (no round trained, nothing rewritten)."""
    mech = privacy.Mechanism("poisson", 1.0, 6, 3)
    eps2, eps3 = (privacy.epsilon(mech, t, 1e-5, "pld") for t in (2, 3))
    assert eps2 < 5 < eps3
    args = [*CENTRAL, "privacy.target_epsilon=5", "algo.rounds=6"]
    first = run(tmp_path, *args)
    assert first.returncode == BUDGET_STATUS, first.stderr[-2000:]
    line = f"flx: privacy budget: round 3 would spend epsilon={eps3:.4f} > privacy.target_epsilon=5 (delta=1e-05)"
    assert flx_lines(first.stderr) == [
        f"{line}: the budget is spent, the run ends with the 2 round(s) it ran (epsilon={eps2:.4f}); exit status 4"
    ]
    last = tmp_path / "checkpoints" / "last.ckpt"
    state = ckpt(last)
    assert state["flx"]["round"] == 2
    (ledger,) = [v for k, v in state["callbacks"].items() if "CentralDP" in k]
    assert (ledger["rounds"], ledger["rounds_run"]) == (2, 2) and ledger["epsilon"] == pytest.approx(eps2)
    digest, final = _digest(last), _final_line(first.stdout)
    assert final.endswith(f"epsilon={eps2:.4f} private=all")
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "flx", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}
    again = [(("ckpt_path=auto",), None)] * 3
    again += [(("ckpt_path=auto", "algo.rounds=10"), None), ((), {**slurm, "SLURM_RESTART_COUNT": "1"})]
    for extra, env in again:
        proc = run(tmp_path, *args, *extra, env=env)
        assert proc.returncode == BUDGET_STATUS, (extra, proc.stderr[-2000:])
        assert flx_lines(proc.stderr) == flx_lines(first.stderr), extra
        assert _final_line(proc.stdout) == final and _digest(last) == digest, extra
        assert "requeue" not in proc.stderr.lower(), extra


def test_repeated_draws_keep_local_dp_within_its_target(tmp_path: Path) -> None:
    """The issue's command: DRFA draws clients with replacement (lambda-weighted) and ``algo.duplicates=repeat`` trains
    a client once per draw. It ended at epsilon 8.1457 when the look-ahead assumed one run a round; every round's
    check now counts the real draws, so a round whose draws would take a client past 8 never runs: the run ends within
    8, and with status 4 and the budget's line where it stopped early. The ledger holds every run."""
    proc = run(tmp_path, "algo=drfa", "privacy=local", "privacy.target_epsilon=8", "algo.duplicates=repeat")
    assert proc.returncode in (0, BUDGET_STATUS), proc.stderr[-2000:]
    final = _final_line(proc.stdout)
    assert float(final.split("epsilon=")[1].split()[0]) <= 8.0 and final.endswith("private=all")
    state = ckpt(tmp_path / "checkpoints" / "last.ckpt")
    (ledger,) = [v for k, v in state["callbacks"].items() if "LocalDP" in k]
    assert ledger["epsilon"] <= 8.0 and ledger["rounds"] == ledger["rounds_run"] == state["flx"]["round"]
    if proc.returncode == BUDGET_STATUS:
        (line,) = flx_lines(proc.stderr)
        assert line.startswith(f"flx: privacy budget: round {state['flx']['round'] + 1} could spend epsilon=")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 1-round private run and a 1-round non-private one (their checkpoints)."""
    out = {}
    for name, extra in (("private", [*CENTRAL, "privacy.target_epsilon=6"]), ("plain", SMALL)):
        folder = tmp_path_factory.mktemp(name)
        proc = run(folder, *extra, "algo.rounds=1")
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[name] = folder / "checkpoints" / "last.ckpt"
    return out


@pytest.mark.parametrize(
    "source, change, message",
    [
        ("plain", CENTRAL[len(SMALL) :], "its rounds ran without privacy: a private run cannot continue them"),
        ("private", ["privacy=none"], "its rounds ran under privacy: continue it with the same privacy=... settings"),
        (
            "private",
            ["privacy=local"],
            "privacy._target_ is 'flx.parts.privacy.central_dp.CentralDP' in the checkpoint",
        ),
    ],
    ids=["add", "remove", "mode"],
)
def test_privacy_cannot_be_added_removed_or_switched_on_resume(
    tmp_path: Path, runs: dict[str, Path], source: str, change: list[str], message: str
) -> None:
    """A checkpoint continues only under the privacy it was written under: adding privacy to a non-private run (it
    would report an epsilon its first rounds never had), removing it, or switching the mode stops with one line,
    exit status 2, before anything is written in the new run folder."""
    base = SMALL if source == "plain" else [*CENTRAL, "privacy.target_epsilon=6"]
    args = [a for a in base if not a.startswith("privacy")] + change
    proc = run(tmp_path / "new", *args, "algo.rounds=2", f"ckpt_path={runs[source]}")
    assert proc.returncode == 2
    (line,) = flx_lines(proc.stderr)
    assert line.startswith(f"flx: error: ckpt_path='{runs[source]}': ") and message in line
    assert not (tmp_path / "new").exists() or not any((tmp_path / "new").iterdir())


@pytest.mark.parametrize(
    "override",
    [
        "privacy.target_epsilon=7",
        "privacy.delta=1e-6",
        "privacy.clip=0.2",
        "privacy.noise_multiplier=1.1",
        "privacy.accountant=rdp",
        "privacy.sampling=fixed",
        "privacy.clip_mode=per_layer",
        "privacy.adaptive=true",
    ],
)
def test_every_privacy_setting_is_part_of_the_ledger(tmp_path: Path, runs: dict[str, Path], override: str) -> None:
    """Each ``privacy.*`` setting the ledger was kept under must be the same on resume (the budget, delta, clip,
    noise, accountant, sampling, ...): another value is one line naming the key and both values; the same settings
    resume."""
    same = [*CENTRAL, "privacy.target_epsilon=6", f"paths.output_dir={tmp_path}"]
    check_ckpt(precheck(same), str(runs["private"]))
    key = override.split("=")[0]
    why = rf"its privacy ledger was kept under other settings: {key} is .* in the checkpoint, .* in the config; "
    with pytest.raises(ConfigError, match=why + "resume with the same privacy settings"):
        check_ckpt(precheck([*same, override]), str(runs["private"]))
