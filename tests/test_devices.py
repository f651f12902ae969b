"""Devices (docs/loop.md, "Devices"): every tensor that meets the net's parameters is on the net's device, a local
step never waits for the host, and ``trainer.deterministic=true`` sets what CUDA needs before it starts.

The round runs on a second device made on the CPU (``tests/fake_device.py``): the net and the store are moved to it
as flx moves them to a GPU, an op that mixes it with a host tensor raises as CUDA would, and every host sync
(``.item()``, ``float()``, ``bool()``) and device-to-host copy is counted. A sync inside the local steps shows as a
count that grows with ``algo.local_steps``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from fake_device import FAKE, DeviceMismatch, FakeDevice
from helpers import linear, make_fed, run_rounds, toy_data

from flx.config import precheck
from flx.datamodules.placement import HostRows, fits_on
from flx.determinism import CUBLAS_DEFAULT, CUBLAS_ENV, cuda_determinism
from flx.federation import Federation
from flx.hooks import FederatedCallback
from flx.models.resnet_cifar import GlobalAvgPool
from flx.run import build, build_trainer

ROUNDS, COHORT = 2, 4


def test_the_fake_device_refuses_host_tensors_and_counts_syncs() -> None:
    """The check itself: a host index into a device tensor raises, a 0-dim host scalar does not (as on CUDA), and
    ``.item()``, ``.cpu()``, ``.to(device)`` are counted as a sync, a copy to the host and a copy to the device."""
    with FakeDevice() as mode:
        x = torch.arange(6.0).to(FAKE)
        with pytest.raises(DeviceMismatch, match=r"aten.index.Tensor: a device tensor meets host tensors"):
            x[torch.tensor([0, 2])]
        assert (x * torch.tensor(2.0)).device == FAKE  # a CPU scalar is allowed
        assert x[torch.tensor([0, 2]).to(FAKE)].sum().item() == 2.0
        assert x.cpu().device.type == "cpu"
        assert mode.counts() == (1, 1, 2)


def _fedavg(
    vectorize: bool, device: torch.device, store_on_device: bool = True
) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
    """FedAvg, ``ROUNDS`` rounds of ``COHORT`` of 6 clients, 3 local steps, with the net on ``device`` and the store
    there too or kept on the host (under the fake-device mode); returns the global model (on the host) and the mode's
    counts."""
    with FakeDevice() as mode:
        net = linear(dim=5, out=3).to(device)
        data = toy_data([7, 9, 5, 8, 6, 10]).to(device, torch.float32, on_device=store_on_device)
        fed = make_fed(net, data, clients_per_round=COHORT, local_steps=3, batch_size=4, lr=0.1, vectorize=vectorize)
        run_rounds(fed, ROUNDS)
        counts = mode.counts()
        model = [p.detach().cpu() for p in net.parameters()]
    return model, counts


@pytest.mark.parametrize("store_on_device", [True, False], ids=["store-on-device", "store-on-host"])
@pytest.mark.parametrize("vectorize", [False, True], ids=["sequential", "vectorized"])
def test_fedavg_on_a_device_syncs_once_per_client_and_equals_the_host_run(vectorize: bool, store_on_device) -> None:
    """On the device, FedAvg's host syncs are exactly: one fault check per client (``all_finite``), the server
    step's zero-weight check and the new global model's fault check per round, the initial loss of the divergence
    rule once; one device-to-host copy per round (the round's counters, read once after the reduce); none per local
    step. The model is bitwise the host run's (the device holds the same values: row indices moved, not redrawn),
    whether the store is on the device or kept on the host (``HostRows``: minibatches copied to the device)."""
    on_device, counts = _fedavg(vectorize, FAKE, store_on_device)
    on_host, _ = _fedavg(vectorize, torch.device("cpu"))
    syncs, to_host, _ = counts
    assert syncs == ROUNDS * COHORT + 2 * ROUNDS + 1
    assert to_host == ROUNDS
    assert all(torch.equal(a, b) for a, b in zip(on_device, on_host))


# every algorithm family; the WHALE-FL variants share whale's parts (one stands for them), per-sample traces are slow
# under the check's dispatch, so WHALE trains 2 clients
ALGOS = {
    "fedavg": [],
    "fedavg_vectorized": ["algo=fedavg", "algo.vectorize=true", "model=mlp"],  # the cohort folded into the batch
    "fedavg_vectorized_vmap": [
        "algo=fedavg",
        "algo.vectorize=true",
        "model=cnn",
        "model.channels=[4,8]",
        "model.hidden=16",
    ],
    "fedprox": [],
    "fedadam": [],
    "fedyogi": [],  # the adaptive steps share FedAdam's code but yogi's sign
    "fednova": ["algo.local_epochs=null", "algo.random_work=[1,3]"],  # unequal work: the uploads rescaled
    "feddualavg": [],
    "fedmid": [],
    "qfedavg": [],
    "afl": [],
    "drfa": [],
    "drfa_ga": [],
    "drfa_prox": [],
    "fedxl1": [],
    "fedxl2": [],
    "fedxl_localpair": [],
    "codasca": [],
    "pfedfbe": [],
    "pfedme": [],
    "ditto": [],
    "fedavg_personal": [],
    "fedprox_personal": [],
    "per_fedavg": [],
    "fedavg_ft": [],
    "fedbn": [],
    "fedper": [],
    "fedrep": ["algo.local_epochs=null", "algo.rep_steps=1"],  # the local steps counted in steps
    "fedbabu": [],
    "lg_fedavg": [],
    "augfl": [],
    "whale": ["algo.clients_per_round=2"],
}


def _counts_on_device(name: str, steps: int) -> tuple[int, int]:
    """``(host syncs, device-to-host copies)`` of two rounds of ``algo=name`` with ``steps`` local steps, the net and
    the store on the fake device (raises :class:`DeviceMismatch` where a host tensor meets the device)."""
    extra = ALGOS[name] if "algo=" in " ".join(ALGOS[name]) else [f"algo={name}", *ALGOS[name]]
    with tempfile.TemporaryDirectory() as out:
        cfg = precheck([*extra, f"algo.local_steps={steps}", "callbacks.progress_bar=null", f"paths.output_dir={out}"])
        dm, module, trainer = build(cfg)
        parts = [cb for cb in trainer.callbacks if isinstance(cb, FederatedCallback)]
        net = module.net
        with FakeDevice() as mode:
            net.to(FAKE)
            store = dm.clients.to(FAKE, next(net.parameters()).dtype)
            fed = Federation(module.spec, net, store, module.task.loss, parts=parts, resources=dm.server_resources)
            run_rounds(fed, ROUNDS)
    syncs, to_host, _ = mode.counts()
    return syncs, to_host


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ALGOS))
def test_no_algorithm_mixes_devices_or_syncs_per_local_step(name: str) -> None:
    """Two rounds of every algorithm family with the net and the store on a second device: no op mixes it with host
    tensors, and the host syncs and device-to-host copies do not grow with the local steps (1 vs 3)."""
    assert _counts_on_device(name, 1) == _counts_on_device(name, 3)


def test_the_store_and_every_clients_rows_move_to_the_device_once() -> None:
    """``ClientStore.to``: inputs, targets, each client's rows (one flat tensor, the counts kept on the host) and
    support rows on the device; on the CPU the rows stay the objects they were; a store kept on the host
    (``HostRows``) keeps its rows there and hands out minibatches on the device."""
    data = toy_data([3, 0, 2])
    rows = data.client_indices
    assert data.to(torch.device("cpu"), torch.float32).client_indices is rows
    with FakeDevice():
        moved = toy_data([3, 0, 2]).to(FAKE, torch.float32)
        assert [r.device for r in (moved.x, moved.y, moved.client_indices.values)] == [FAKE] * 3
        assert [len(r) for r in moved.client_indices] == [3, 0, 2] and moved.client_indices.size(2) == 2
        assert moved.client_indices[2].elem.tolist() == [3, 4]
        kept = toy_data([3, 0, 2]).to(FAKE, torch.float64, on_device=False)  # a store too big for the device
        assert isinstance(kept.x, HostRows) and kept.client_indices[2].device.type == "cpu"
        batch = kept.x[torch.tensor([[4, 0], [1, 1]])]  # (m, B) rows, as the vectorised path asks
        assert batch.device == FAKE and batch.dtype == torch.float64 and batch.shape == (2, 2, 5)
        assert torch.equal(batch.elem, data.x.double()[torch.tensor([[4, 0], [1, 1]])])
    assert fits_on(torch.device("cpu"), 1 << 60)  # nothing moves on the CPU, whatever the size


def test_the_global_pool_is_the_adaptive_pool_on_the_cpu() -> None:
    """ResNet's global pool is ``AdaptiveAvgPool2d(1)`` bit for bit on the CPU, deterministic mode or not (the mean
    form is for CUDA only, whose adaptive-pool backward has no deterministic kernel)."""
    x = torch.randn(2, 3, 5, 7, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.AdaptiveAvgPool2d(1)(x)
    assert torch.equal(GlobalAvgPool()(x), expected)
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.equal(GlobalAvgPool()(x), expected)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.fixture
def torch_flags():
    """Restores the global determinism flags a Trainer with ``deterministic=true`` sets."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    saved += (torch.backends.cudnn.benchmark,)
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]


def _trainer(tmp_path: Path, *overrides: str) -> pl.Trainer:
    cfg = precheck([*overrides, "callbacks.progress_bar=null", f"paths.output_dir={tmp_path}"])
    return build_trainer(cfg, [])


@pytest.mark.parametrize("user", [None, ":16:8"], ids=["default", "user-set"])
def test_deterministic_runs_set_what_cuda_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch_flags: None, user: str | None
) -> None:
    """``trainer.deterministic=true``: after the Trainer is built (before anything runs on a GPU) cuBLAS has a fixed
    workspace (``:4096:8``, or the user's value, which Lightning alone would overwrite), cuDNN is deterministic and not
    benchmarked, and torch uses deterministic algorithms."""
    monkeypatch.setenv(CUBLAS_ENV, user or "")  # recorded, so the test's value is undone after it
    if user is None:
        monkeypatch.delenv(CUBLAS_ENV)
    torch.backends.cudnn.benchmark = True
    _trainer(tmp_path, "trainer.deterministic=true")
    assert os.environ[CUBLAS_ENV] == (user or CUBLAS_DEFAULT)
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.are_deterministic_algorithms_enabled()


def test_nondeterministic_runs_leave_cuda_alone(monkeypatch: pytest.MonkeyPatch, torch_flags: None) -> None:
    """``trainer.deterministic=false`` (the default): no variable set, cuDNN's flags as they were."""
    monkeypatch.setenv(CUBLAS_ENV, "")
    monkeypatch.delenv(CUBLAS_ENV)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = True, False
    with cuda_determinism(False):
        pass
    assert CUBLAS_ENV not in os.environ
    assert torch.backends.cudnn.benchmark and not torch.backends.cudnn.deterministic
