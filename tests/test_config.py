"""The command-line contract of ``train.py``: every bad input gives one ``flx: error: ...`` line and exit status 2.

Each case runs ``python train.py <overrides>`` in a subprocess (output and data dirs under ``tmp_path``) and checks
that stderr holds exactly one non-empty line, starting with ``flx: error: `` and naming the key, the value and what
is allowed, with no traceback. Most cases fail in :func:`flx.config.precheck` before Hydra starts the run (well under
a second each); the cases marked ``slow`` fail inside the run (data loading, partitioning, model building) and pay
for importing torch and Lightning (~5-10 s each).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
PREFIX = "flx: error: "


def run_train(*args: str, run_dir: Path, data_dir: Path, timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
    """Runs ``train.py`` with ``args`` (plus output dir, data dir and ``logger=none`` unless a logger is given);
    returns (rc, stdout, stderr). W&B sees no account: no API key, no netrc, HOME in a fresh folder."""
    logger = [] if any(a.startswith("logger=") for a in args) else ["logger=none"]
    cmd = [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}", f"paths.data_dir={data_dir}", *logger]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HOME": str(run_dir.parent / "home")}
    for key in ("HYDRA_FULL_ERROR", "WANDB_MODE", "WANDB_API_KEY", "NETRC"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def assert_one_line_error(rc: int, stdout: str, stderr: str, fragments: list[str]) -> str:
    """Asserts the contract (exit 2, one ``flx: error:`` line on stderr holding every fragment); returns the line."""
    shown = f"exit status {rc}\n--- stderr (tail) ---\n{stderr[-4000:]}\n--- stdout (tail) ---\n{stdout[-1000:]}"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert rc == 2, f"expected exit status 2; {shown}"
    assert len(lines) == 1, f"expected exactly one non-empty stderr line, got {len(lines)}; {shown}"
    line = lines[0]
    assert line.startswith(PREFIX), f"stderr line does not start with {PREFIX!r}: {line!r}"
    missing = [f for f in fragments if f not in line]
    assert not missing, f"error line {line!r} lacks {missing}"
    return line


# --- files some cases need ---------------------------------------------------------------------------------------


def _corrupt_ckpt(tmp: Path) -> None:
    (tmp / "corrupt.ckpt").write_bytes(random.Random(0).randbytes(4096))


def _foreign_ckpt(tmp: Path) -> None:
    import torch

    torch.save({"a": 1}, tmp / "foreign.ckpt")


def _ckpt_of(*overrides: str) -> Callable[[Path], None]:
    """Writes ``{tmp}/other.ckpt``: a flx checkpoint (as far as the pre-run check reads) of a run with ``overrides``."""

    def setup(tmp: Path) -> None:
        import torch

        from flx.config import precheck
        from flx.resume import fingerprint

        flx = {"round": 3, "server_opt": {}, "store": {"clients": {}}, "fingerprint": fingerprint(precheck(overrides))}
        torch.save({"state_dict": {}, "flx": flx}, tmp / "other.ckpt")

    return setup


class Case(NamedTuple):
    """A bad command line: ``args`` and ``expect`` may use ``{tmp}`` (a scratch dir) and ``{data}`` (paths.data_dir)."""

    id: str
    args: tuple[str, ...]
    expect: tuple[str, ...]
    setup: Callable[[Path], None] | None = None
    slow: bool = False  # fails inside the run, after importing torch/Lightning


CASES = [
    # --- config groups and the override grammar (Hydra compose in the pre-run check) ---
    Case("unknown-algo", ("algo=nope",), ("algo=", "nope", "fedavg")),
    Case("unknown-data", ("data=nope",), ("data=", "nope", "cifar10")),
    Case("unknown-model", ("model=nope",), ("model=", "nope", "resnet18")),
    Case("unknown-partition", ("partition=nope",), ("partition=", "nope", "dirichlet")),
    Case("unknown-logger", ("logger=nope",), ("logger=", "nope", "tensorboard")),
    Case("unknown-trainer", ("trainer=nope",), ("trainer=", "nope", "ddp")),
    Case("unknown-key", ("algo.lrr=0.1",), ("algo.lrr", "0.1")),
    Case("unknown-top-level-key", ("notakey=1",), ("notakey", "1")),
    Case("unparsable-override", ("algo.lr=[1",), ("algo.lr", "[1")),
    Case("unparsable-hydra-override", ("hydra.job.chdir=[x",), ("hydra.job.chdir", "[x")),
    Case("dangling-interpolation", ("algo.lr=${nope}",), ("algo.lr", "nope")),
    # --- algorithm values ---
    Case("lr-negative", ("algo.lr=-1",), ("algo.lr=-1", "> 0")),
    Case("lr-not-a-number", ("algo.lr=abc",), ("algo.lr=", "abc", "number")),
    Case("lr-inf", ("algo.lr=inf", "debug=default"), ("algo.lr=", "inf")),
    Case("client-eval-unknown", ("client_eval=train",), ("client_eval", "train", "test_labels")),
    Case("rounds-zero", ("algo.rounds=0",), ("algo.rounds=0", ">= 1")),
    Case("local-steps-zero", ("algo.local_steps=0",), ("algo.local_steps=0", ">= 1")),
    Case("local-epochs-zero", ("algo.local_epochs=0",), ("algo.local_epochs=0", ">= 1")),
    Case("batch-size-zero", ("algo.batch_size=0",), ("algo.batch_size=0", ">= 1")),
    Case("momentum-too-big", ("algo.momentum=1.5",), ("algo.momentum=1.5", "[0, 1)")),
    Case("duplicates-unknown", ("algo.duplicates=twice",), ("algo.duplicates=", "twice", "multiplicity, repeat")),
    Case("vectorize-not-bool", ("algo.vectorize=maybe",), ("algo.vectorize=", "maybe", "true, false")),
    Case(
        "vectorize-dropout-net",
        ("algo.vectorize=true", "model.dropout=0.2"),
        ("algo.vectorize=true", "Dropout layers", "algo.vectorize=false"),
        slow=True,
    ),
    Case(
        "vectorize-pfedme",
        ("algo=pfedme", "algo.vectorize=true"),
        ("algo.vectorize=true", "PFedMe", "local_update"),
        slow=True,
    ),
    Case("minibatch-unknown", ("algo.minibatch=shuffle",), ("algo.minibatch=", "shuffle", "epochs, fresh")),
    Case("aggregator-unknown", ("algo.aggregator=median",), ("algo.aggregator=", "median", "count_mean, admm_sum")),
    Case("model-init-unknown", ("model.init=ones",), ("model.init=", "ones", "default, zeros")),
    Case("weighting-unknown", ("algo.weighting=foo",), ("algo.weighting=", "foo", "num_samples")),
    Case("server-name-unknown", ("algo.server.name=sgdx",), ("algo.server.name=", "sgdx", "adam")),
    Case("server-lr-zero", ("algo.server.lr=0",), ("algo.server.lr=0", "> 0")),
    Case(
        "server-initial-accumulator-negative",
        ("algo=fedyogi", "algo.server.initial_accumulator=-1"),
        ("algo.server.initial_accumulator=-1", ">= 0"),
    ),
    Case(
        "clients-per-round-above-num-clients",
        ("algo.clients_per_round=50",),
        ("algo.clients_per_round=50", "partition.num_clients"),
    ),
    Case("clients-per-round-zero", ("algo.clients_per_round=0",), ("algo.clients_per_round=0", ">= 1")),
    # --- partition parameters (the partitioner is built in the pre-run check) ---
    Case("dirichlet-alpha-zero", ("partition=dirichlet", "partition.alpha=0"), ("partition.alpha=0", "> 0")),
    Case(
        "quantity-skew-alpha-negative", ("partition=quantity_skew", "partition.alpha=-1"), ("partition.alpha=-1", "> 0")
    ),
    Case("test-fraction-one", ("partition.test_fraction=1.0",), ("partition.test_fraction=1.0", "[0, 1)")),
    Case("partition-unknown-parameter", ("+partition.foo=2",), ("partition", "foo")),
    Case(
        "shards-more-classes-than-present",
        ("partition=shards", "partition.classes_per_client=11"),
        ("partition.classes_per_client=11", "10"),
        slow=True,
    ),
    Case(
        "more-clients-than-samples",
        ("partition.num_clients=5000", "algo.clients_per_round=2"),
        ("partition.num_clients=5000", "training samples"),
        slow=True,
    ),
    # --- top-level and trainer values ---
    Case("eval-every-zero", ("eval_every=0",), ("eval_every=0", ">= 1")),
    Case("seed-negative", ("seed=-1",), ("seed=-1", ">= 0")),
    # --- sizes beyond what numpy, torch and the OS take (each used to end in a traceback) ---
    Case("seed-huge", ("seed=99999999999999999999",), ("seed=99999999999999999999", ">= 0 and <= 4294967295")),
    Case("seed-above-32-bits", ("seed=4294967296",), ("seed=4294967296", ">= 0 and <= 4294967295")),
    Case("partition-seed-huge", ("partition.seed=4294967296",), ("partition.seed=4294967296", "<= 4294967295")),
    Case(
        "batch-size-huge",
        ("algo.batch_size=99999999999999999999",),
        ("algo.batch_size=99999999999999999999", ">= 1 and <= 2147483647"),
    ),
    Case(
        "eval-batch-size-huge",
        ("data.eval_batch_size=2147483648",),
        ("data.eval_batch_size=2147483648", "<= 2147483647"),
    ),
    Case(
        "num-threads-huge",
        ("num_threads=100000",),
        ("num_threads=100000", "auto", "null", "from 1 to ", "per CPU core"),
    ),
    Case("num-threads-zero", ("num_threads=0",), ("num_threads=0", "allowed: auto", "null", "from 1 to ")),
    Case("num-threads-text", ("num_threads=many",), ("num_threads='many'", "allowed: auto", "null", "from 1 to ")),
    Case("diverge-factor-one", ("fault.diverge_factor=1",), ("fault.diverge_factor=1", "> 1", "null")),
    Case("diverge-factor-text", ("fault.diverge_factor=big",), ("fault.diverge_factor=", "big", "number")),
    Case("diverge-rounds-zero", ("fault.diverge_rounds=0",), ("fault.diverge_rounds=0", ">= 1")),
    Case("precision-unknown", ("trainer.precision=12",), ("trainer.precision=12", "32-true", "bf16-mixed")),
    Case("limit-negative", ("trainer.limit_train_batches=-3",), ("trainer.limit_train_batches=-3", "fraction")),
    Case("limit-fraction-above-1", ("trainer.limit_train_batches=1.5",), ("trainer.limit_train_batches=1.5", "(0, 1]")),
    Case("strategy-unknown", ("trainer.strategy=fsdp",), ("trainer.strategy=", "fsdp", "ddp")),
    Case("devices-2-without-ddp", ("trainer.devices=2",), ("trainer.strategy", "ddp", "2 devices")),
    Case(
        "state-store-dir-unwritable",
        ("state_store.backend=disk", "state_store.dir=/proc/flx"),
        ("state_store.dir='/proc/flx'", "cannot write there"),
    ),
    Case("devices-not-a-number", ("trainer.devices=abc",), ("trainer.devices", "abc"), slow=True),
    Case(
        "state-store-backend-unknown", ("state_store.backend=foo",), ("state_store.backend", "foo", "memory"), slow=True
    ),
    # --- checkpoints ---
    Case("ckpt-missing", ("ckpt_path={tmp}/missing.ckpt",), ("ckpt_path=", "{tmp}/missing.ckpt", "not found")),
    Case("ckpt-corrupt", ("ckpt_path={tmp}/corrupt.ckpt",), ("ckpt_path=", "{tmp}/corrupt.ckpt"), _corrupt_ckpt),
    Case("ckpt-not-flx", ("ckpt_path={tmp}/foreign.ckpt",), ("ckpt_path=", "{tmp}/foreign.ckpt", "flx"), _foreign_ckpt),
    Case(
        "ckpt-of-another-model",
        ("ckpt_path={tmp}/other.ckpt",),
        ("ckpt_path=", "model._target_", "flx.models.nets.CNN", "flx.models.nets.MLP"),
        _ckpt_of("model=cnn"),
    ),
    Case(
        "ckpt-fedadam-as-fedavg",
        ("ckpt_path={tmp}/other.ckpt",),
        ("ckpt_path=", "algo.name is 'fedadam' in the checkpoint, 'fedavg' in the config"),
        _ckpt_of("algo=fedadam"),
    ),
    Case(
        "ckpt-drfa-as-fedavg",
        ("ckpt_path={tmp}/other.ckpt",),
        ("ckpt_path=", "algo.name is 'drfa' in the checkpoint"),
        _ckpt_of("algo=drfa"),
    ),
    Case(
        "ckpt-other-partition",
        ("ckpt_path={tmp}/other.ckpt", "partition=iid"),
        ("ckpt_path=", "partition._target_"),
        _ckpt_of(),
    ),
    # --- keys that would be ignored or contradict the rounds ---
    Case("wandb-without-account", ("logger=wandb",), ("logger='wandb'", "wandb login", "WANDB_MODE=offline")),
    Case("added-key-nothing-reads", ("+foo=1",), ("+foo=1", "nothing reads foo")),
    Case(
        "added-algo-key-a-part-takes",
        ("algo=fedxl2", "data=digits_binary", "+algo.compositional=false"),
        ("+algo.compositional=false", "algo.parts.passive_buffer.compositional"),
    ),
    Case("max-epochs-conflict", ("trainer.max_epochs=2", "algo.rounds=3"), ("trainer.max_epochs=2", "algo.rounds=3")),
    Case("max-steps-set", ("+trainer.max_steps=10",), ("trainer.max_steps=10", "algo.rounds")),
    Case("fault-policy-unknown", ("fault.policy=ignore",), ("fault.policy=", "ignore", "drop, stop")),
    Case("single-row-batch-unknown", ("algo.single_row_batch=maybe",), ("algo.single_row_batch=", "maybe", "auto")),
    Case("test-on-best-without-monitor", ("test_on=best",), ("test_on=", "best", "checkpoint.monitor")),
    Case("checkpoint-every-rounds-zero", ("checkpoint.every_rounds=0",), ("checkpoint.every_rounds=0", ">= 1")),
    Case("checkpoint-mode-unknown", ("checkpoint.mode=avg",), ("checkpoint.mode=", "avg", "max, min")),
    Case("checkpoint-signal-unknown", ("checkpoint.requeue_signal=SIGFOO",), ("checkpoint.requeue_signal=", "SIGFOO")),
    Case("binary-head-unknown", ("model.binary_head=three",), ("model.binary_head=", "three", "one_logit")),
    Case("one-logit-on-ten-classes", ("model.binary_head=one_logit",), ("model.binary_head=", "the data has 10")),
    Case(
        "monitor-not-logged",
        ("checkpoint.monitor=val/nope", "debug=default"),
        ("checkpoint.monitor=", "val/nope", "val/acc"),
        slow=True,
    ),
    # --- data: missing files and options that choose them are found by the pre-run check (flx.datamodules.files) ---
    Case(
        "cifar10-missing",
        ("data=cifar10",),
        ("data=cifar10", "{data}/cifar-10-batches-py", "data_batch_1", "paths.data_dir"),
    ),
    Case(
        "mnist-missing",
        ("data=mnist",),
        ("data=mnist", "{data}/MNIST/raw", "train-images-idx3-ubyte", "paths.data_dir"),
    ),
    Case(
        "medmnist-unknown-name",
        ("data=medmnist", "data.loader.name=not_a_set"),
        ("data.loader.name=", "not_a_set", "pathmnist"),
    ),
    Case(
        "emnist-bad-split",
        ("data=emnist", "data.loader.split=bad"),
        ("data.loader.split=", "bad", "balanced"),
    ),
    Case(
        "test-size-above-one", ("data.loader.test_size=2",), ("data.loader.test_size=2", "between 0 and 1"), slow=True
    ),
    Case(
        "eval-batch-size-zero",
        ("data.eval_batch_size=0", "debug=default"),
        ("data.eval_batch_size=0",),
        slow=True,
    ),
    # --- models (checked when the net is built inside the run) ---
    Case("cnn-on-tabular", ("data=breast_cancer", "model=cnn"), ("model=cnn", "image", "(30,)"), slow=True),
    Case(
        "timm-unknown-model",
        ("model=timm", "model.name=not_a_model"),
        ("model.name=", "not_a_model", "timm"),
        slow=True,
    ),
    Case(
        "timm-pretrained-missing",
        ("model=timm", "model.pretrained_path={tmp}/missing.pth"),
        ("model.pretrained_path=", "{tmp}/missing.pth", "no such file"),
        slow=True,
    ),
    # --- algorithm parts (checked when the parts are built inside the run) ---
    Case(
        "codasca-control",
        ("algo=codasca", "data=digits_binary", "algo.control=scaffold"),
        ("algo.control=", "scaffold", "grad_mean"),
        slow=True,
    ),
    Case(
        "drfa-sampling",
        ("algo=drfa", "algo.sampling=poisson"),
        ("algo.sampling=", "poisson", "uniform_weighted"),
        slow=True,
    ),
    Case("drfa-prox-rho", ("algo=drfa_prox", "algo.rho=0"), ("algo.rho=0", "> 0"), slow=True),
    # algorithm / data mismatches the config alone decides: reported by the pre-run check, before any import
    Case("codasca-on-multiclass-data", ("algo=codasca", "data=digits"), ("data:", "binary", "digits_binary")),
    Case("fedxl-on-multiclass-data", ("algo=fedxl2", "data=digits"), ("data:", "binary", "10 classes")),
    Case("fedxl1-on-cifar10", ("algo=fedxl1", "data=cifar10"), ("data:", "algo=fedxl1", "10 classes")),
    Case(
        "fedxl-client-without-positives",
        ("algo=fedxl2", "data=digits_binary", "partition=one_class", "partition.num_clients=4"),
        ("partition:", "client 0 has no positives", "stratified"),
        slow=True,
    ),
    Case(
        "drfa-lambda-floor-above-uniform",
        ("algo=drfa", "algo.lambda_floor=0.5"),
        ("algo.lambda_floor=0.5", "1/N"),
        slow=True,
    ),
    Case(
        "drfa-with-local-epochs",
        ("algo=drfa", "algo.local_epochs=1"),
        ("algo.local_epochs=1", "tau steps"),
        slow=True,
    ),
    Case(
        "codasca-with-local-epochs",
        ("algo=codasca", "data=digits_binary", "algo.local_epochs=1"),
        ("algo.local_epochs=1", "steps"),
        slow=True,
    ),
    Case("qfedavg-q-negative", ("algo=qfedavg", "algo.q=-1"), ("algo.q=-1", ">= 0"), slow=True),
]


def _param(case: Case) -> pytest.param:
    return pytest.param(case, id=case.id, marks=[pytest.mark.slow] if case.slow else [])


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_gives_one_line_and_exit_2(case: Case, tmp_path: Path) -> None:
    tmp, data = tmp_path / "files", tmp_path / "data"
    tmp.mkdir()
    data.mkdir()
    if case.setup is not None:
        case.setup(tmp)
    fill = {"tmp": str(tmp.resolve()), "data": str(data.resolve())}
    args = [a.replace("{tmp}", fill["tmp"]) for a in case.args]  # not str.format: "${nope}" must stay as it is
    expect = [e.replace("{tmp}", fill["tmp"]).replace("{data}", fill["data"]) for e in case.expect]
    rc, out, err = run_train(*args, run_dir=tmp_path / "run", data_dir=data)
    assert_one_line_error(rc, out, err, expect)


def test_cases_have_unique_ids() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


# --- nothing already written is lost --------------------------------------------------------------------------------

PREVIOUS_RUN = {  # what an earlier run (and its user) left in the output dir
    "results.txt": b"my notes: keep me\n",
    ".hydra/config.yaml": b"task_name: earlier\n",
    ".hydra/overrides.yaml": b"- algo=fedprox\n",
    "checkpoints/last.ckpt": bytes(range(256)),
    "csv/metrics.csv": b"round,test/acc\n0,0.5\n",
}


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        pytest.param(("algo=nope",), ("algo=",), id="pre-run-check"),
        pytest.param(("data=mnist",), ("data=mnist",), id="missing-data"),
        pytest.param(  # a fresh run into a used folder: the run-folder guard stops it before the in-run check
            ("partition=shards", "partition.classes_per_client=11"),
            ("hydra.run.dir=", "already holds a run's outputs", "ckpt_path=auto", "run.overwrite=true"),
            id="in-run-check",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ("ckpt_path={run}/checkpoints/last.ckpt",), ("not a readable checkpoint",), id="resume-not-a-ckpt"
        ),
        pytest.param(("ckpt_path={run}/cnn.ckpt",), ("model._target_",), id="resume-another-model"),
    ],
)
def test_bad_command_keeps_existing_output(args: tuple[str, ...], expect: tuple[str, ...], tmp_path: Path) -> None:
    run_dir, data = tmp_path / "run", tmp_path / "data"
    data.mkdir()
    for name, content in PREVIOUS_RUN.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(content)
    log = run_dir / "train.log"
    log.write_bytes(b"[earlier run] final test_acc=0.5\n")
    if any("cnn.ckpt" in a for a in args):  # the case: resuming the folder's run with another model
        _ckpt_of("model=cnn")(run_dir)
        (run_dir / "other.ckpt").rename(run_dir / "cnn.ckpt")

    rc, out, err = run_train(*(a.replace("{run}", str(run_dir)) for a in args), run_dir=run_dir, data_dir=data)
    assert_one_line_error(rc, out, err, list(expect))

    changed = [name for name, content in PREVIOUS_RUN.items() if (run_dir / name).read_bytes() != content]
    assert not changed, f"a failed command overwrote files of the earlier run in {run_dir}: {changed}"
    assert log.read_bytes().startswith(b"[earlier run] final test_acc=0.5\n"), "the earlier train.log was truncated"


def test_hydra_flags_are_left_to_hydra(tmp_path: Path) -> None:
    """`--cfg job` prints the composed config instead of being read as an override named 'job'."""
    rc, out, err = run_train("--cfg", "job", "algo=fedprox", run_dir=tmp_path / "run", data_dir=tmp_path / "data")
    assert rc == 0, err
    assert "name: fedprox" in out and "mu: 0.01" in out


# --- the run folder: a real write probe ---------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_run_folder_under_proc_gives_one_line(tmp_path: Path) -> None:
    """`hydra.run.dir=/proc/flxrun` passed the old check as root (os.access says yes to root everywhere) and ended in
    a traceback when Hydra made the folder: the probe of the nearest existing ancestor (/proc) refuses it."""
    data = tmp_path / "data"
    data.mkdir()
    rc, out, err = run_train(run_dir=Path("/proc/flxrun"), data_dir=data)
    assert_one_line_error(rc, out, err, ["hydra.run.dir='/proc/flxrun'", "/proc is not writable", "another folder"])
    assert not os.path.exists("/proc/flxrun")


def _tree(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``: a file's sha256, or "dir"."""
    import hashlib

    return {
        str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


def test_run_folder_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    """The probe makes a folder and a file in the nearest existing ancestor and removes both: the ancestor's tree
    (names and sha256 of every file) is the same after a passing check, and the missing folders are not made; an
    ancestor that is a file is refused by name."""
    from omegaconf import OmegaConf

    from flx.config import _check_run_dir
    from flx.errors import ConfigError

    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "notes.txt").write_bytes(b"keep me\n")
    (tmp_path / "file").write_bytes(b"x")
    cfg = OmegaConf.create({"paths": {"log_dir": str(tmp_path / "logs")}})
    before = _tree(tmp_path)
    _check_run_dir([f"hydra.run.dir={tmp_path / 'a' / 'b' / 'run'}"], cfg)
    _check_run_dir([f"hydra.run.dir={tmp_path / 'earlier'}"], cfg)
    _check_run_dir([], cfg)
    assert _tree(tmp_path) == before
    with pytest.raises(ConfigError, match=r"hydra.run.dir=.*file/run.*file is not a folder"):
        _check_run_dir([f"hydra.run.dir={tmp_path / 'file' / 'run'}"], cfg)


def test_a_checkpoint_that_names_its_parts_where_they_lived_before_flx_parts_still_resumes(tmp_path: Path) -> None:
    """Checkpoints written before the parts moved from ``flx.callbacks`` to ``flx.parts`` store
    ``flx.callbacks.prox.Prox``: the same part, so the fingerprint check passes; another part still fails it."""
    import torch

    from flx.config import precheck
    from flx.errors import ConfigError
    from flx.resume import check_ckpt, fingerprint

    cfg = precheck(["algo=fedprox"])
    saved = fingerprint(cfg)
    assert saved["algo.parts"] == {"prox": "flx.parts.proximal.prox.Prox"}
    for target, resumes in (("flx.callbacks.prox.Prox", True), ("flx.callbacks.qffl.QFFL", False)):
        old = {**saved, "algo.parts": {"prox": target}}
        path = tmp_path / "old.ckpt"
        torch.save({"state_dict": {}, "flx": {"round": 3, "fingerprint": old}}, path)
        if resumes:
            check_ckpt(cfg, str(path))
        else:
            with pytest.raises(ConfigError, match="written for another run: algo.parts.prox"):
                check_ckpt(cfg, str(path))


def test_a_checkpoint_that_names_its_parts_by_another_module_path_still_resumes(tmp_path: Path) -> None:
    """The resume check compares a part's ``_target_`` under ``flx.parts`` by its class name: a checkpoint written
    before the parts were grouped into families (``flx.parts.prox.Prox``, ``flx.parts.central_dp.CentralDP``, as main
    wrote them) or after a part moves to another family resumes under today's config; a part of another class, or one
    outside ``flx.parts``, is still refused."""
    import torch

    from flx.config import precheck
    from flx.errors import ConfigError
    from flx.resume import check_ckpt, fingerprint

    cfg = precheck(["algo=fedprox", "model=logreg", "privacy=central", "privacy.noise_multiplier=1.0"])
    saved = fingerprint(cfg)
    assert saved["algo.parts"]["prox"].endswith(".Prox") and saved["privacy"]["_target_"].endswith(".CentralDP")

    def written(prox: str, privacy: str) -> str:
        old = {**saved, "algo.parts": {"prox": prox}, "privacy": {**saved["privacy"], "_target_": privacy}}
        path = tmp_path / "old.ckpt"
        torch.save({"state_dict": {}, "flx": {"round": 3, "fingerprint": old}}, path)
        return str(path)

    check_ckpt(cfg, written("flx.parts.prox.Prox", "flx.parts.central_dp.CentralDP"))  # main before the families
    check_ckpt(cfg, written("flx.parts.drift.prox.Prox", "flx.parts.dp.central.CentralDP"))  # any family
    refused = {
        ("flx.parts.qffl.QFFL", "flx.parts.central_dp.CentralDP"): "algo.parts.prox is 'flx.parts.qffl.QFFL' in the",
        ("mypkg.prox.Prox", "flx.parts.central_dp.CentralDP"): "algo.parts.prox is 'mypkg.prox.Prox' in the",
        ("flx.parts.prox.Prox", "flx.parts.local_dp.LocalDP"): "privacy._target_ is 'flx.parts.local_dp.LocalDP'",
    }
    for (prox, privacy), message in refused.items():
        with pytest.raises(ConfigError, match=message):
            check_ckpt(cfg, written(prox, privacy))


def test_the_parts_of_flx_parts_have_distinct_class_names() -> None:
    """What makes comparing a part's ``_target_`` by class name sound (flx.resume.compared): no two part classes
    anywhere under ``flx.parts`` share a name, and every ``flx.parts`` target in configs/ names one of them."""
    import importlib
    import inspect
    import pkgutil
    import re

    import flx.parts
    from flx.hooks import FederatedCallback

    names = []
    for info in pkgutil.walk_packages(flx.parts.__path__, "flx.parts."):
        module = importlib.import_module(info.name)
        names += [
            cls.__name__
            for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, FederatedCallback) and cls.__module__ == module.__name__
        ]
    assert len(names) >= 20 and len(names) == len(set(names)), sorted(names)
    targets = {
        m.group(1)
        for path in (ROOT / "configs").rglob("*.yaml")
        for m in re.finditer(r"_target_: flx\.parts\.[\w.]*\.(\w+)", path.read_text())
    }
    assert targets and targets <= set(names), targets - set(names)
