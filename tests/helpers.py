"""Small builders shared by the maths tests: toy data, a federation attached to a net, a round driver."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flx.datamodules.datamodule import ClientStore
from flx.errors import ConfigError
from flx.federation import Federation, FederationConfig, FederationSpec
from flx.hooks import Build, FederatedCallback
from flx.traits import PartTraits


def toy_data(sizes: Sequence[int], dim: int = 5, classes: int = 3, seed: int = 0, dtype=torch.float32) -> ClientStore:
    """Gaussian inputs, random labels; client ``c`` owns a contiguous block of ``sizes[c]`` rows."""
    g = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(n, dim, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (n,), generator=g)
    bounds = torch.tensor([0, *sizes]).cumsum(0)
    return ClientStore(x, y, [torch.arange(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])])


def linear(dim: int = 5, out: int = 3, seed: int = 0, dtype=torch.float32, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(dim, out, bias=bias).to(dtype)


def make_fed(
    net: nn.Module,
    data: ClientStore,
    parts: Sequence[FederatedCallback] = (),
    loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy,
    rank: int = 0,
    world_size: int = 1,
    reduce_sum: Callable[[Tensor], Tensor] | None = None,
    gather: Callable[[object], list[object]] | None = None,
    broadcast: Callable[[object], object] | None = None,
    resources: object = None,
    system: object = None,
    **cfg: object,
) -> Federation:
    return Federation(
        FederationSpec(FederationConfig(**cfg), system=system),
        net,
        data,
        loss_fn,
        parts,
        reduce_sum,
        rank=rank,
        world_size=world_size,
        gather=gather,
        broadcast=broadcast,
        resources=resources,
    )


def build_of(
    parts: Sequence[FederatedCallback], cfg: FederationConfig | None = None, net: nn.Module | None = None, data=None
) -> Build:
    """What a part's ``check`` sees (:class:`flx.hooks.Build`) for ``parts`` on a small federation: ``cfg`` (default
    settings), ``net`` (a 5 -> 3 linear layer) and ``data`` (four clients of 10 rows) unless given."""
    return Build(cfg or FederationConfig(), net or linear(), tuple(parts), data or toy_data([10, 10, 10, 10]))


def run_rounds(fed: Federation, rounds: int, start: int = 0) -> None:
    """Drives the protocol as the Lightning loops do on a single process."""
    for r in range(start, start + rounds):
        fed.train_clients(fed.begin_round(r).shard)
        fed.end_round()


def params(net: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def full_batch_gd(net: nn.Module, x: Tensor, y: Tensor, lr: float, steps: int) -> nn.Module:
    """The centralised reference: ``steps`` plain gradient steps on the mean cross-entropy of ``(x, y)``."""
    for _ in range(steps):
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= lr * p.grad
    return net


def binary_store(
    pos: Sequence[int], neg: Sequence[int], dim: int = 4, seed: int = 0, shift: float = 0.0
) -> ClientStore:
    """Client c holds pos[c] positives (label 1, inputs shifted by ``shift``) then neg[c] negatives (float64)."""
    g = torch.Generator().manual_seed(seed)
    ys, idx, start = [], [], 0
    for p, n in zip(pos, neg):
        ys.append(torch.tensor([1] * p + [0] * n))
        idx.append(torch.arange(start, start + p + n))
        start += p + n
    y = torch.cat(ys)
    x = torch.randn(len(y), dim, generator=g, dtype=torch.float64) + shift * y[:, None].double()
    return ClientStore(x, y, idx)


def raises_one_line(func: Callable[..., object], *args: object, match: str, **kwargs: object) -> str:
    """Calls ``func`` expecting a one-line :class:`ConfigError` containing ``match``; returns the message."""
    with pytest.raises(ConfigError) as info:
        func(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message and match in message, message
    return message


class KillMidRound(FederatedCallback):
    """Test callback for real crashes: SIGKILLs its own process after the ``client``-th client of round ``round``
    (0-based), i.e. in the middle of that round, as a node failure or the OOM killer would.

    Checkpoints are written in a background thread (:mod:`flx.checkpoint_io`), so which file a kill finds on disk
    depends on timing; both cases are made deterministic here. By default the kill comes once the files saved so far
    are on disk (a crash in the middle of a round's compute): round ``round``'s start checkpoint is the last one. With
    ``stall_write`` seconds, the writer is held that long from the end of round ``round - 1``, so the kill lands while
    that round's checkpoint is still in flight: the one before it is the last on disk.
    """

    def __init__(
        self, round: int, client: int = 2, signal: str = "SIGKILL", stall_write: float = 0.0, delay: float = 0.0
    ) -> None:
        self.round, self.client, self.signal, self.stall_write, self._seen = round, client, signal, stall_write, 0
        self.delay = delay  # seconds between the client and the kill (W&B writes its file every second or so)
        self._io: object = None

    def setup(self, trainer: object, pl_module: object, stage: str) -> None:
        self._io = trainer.strategy.checkpoint_io

    def on_train_epoch_end(self, trainer: object, pl_module: object) -> None:
        # runs before the checkpoint callbacks' (Lightning orders those last): the round's file, submitted by the
        # checkpoint IO after it waited for the previous one, queues behind a sleep
        if self.stall_write and trainer.current_epoch + 1 == self.round:
            io = self._io

            def stalled(fn: object, *args: object) -> None:
                import time

                del io.submit  # the class's method again
                io.submit(time.sleep, self.stall_write)
                io.submit(fn, *args)

            io.submit = stalled

    def on_client_end(self, fed: Federation, client: object) -> None:
        import os
        import signal

        if fed.rnd.round == self.round:
            self._seen += 1
            if self._seen == self.client:
                if not self.stall_write:
                    self._io.wait()
                if self.delay:
                    import time

                    time.sleep(self.delay)
                os.kill(os.getpid(), getattr(signal, self.signal))


class PoisonFrom(FederatedCallback):
    """Test part: client updates turn NaN: the lowest client id of round ``one`` (0-based), every client from round
    ``every`` on."""

    def __init__(self, one: int, every: int) -> None:
        self.one, self.every = one, every

    def on_client_end(self, fed: Federation, client: object) -> None:
        rnd = fed.rnd
        if rnd.round >= self.every or (rnd.round == self.one and client.cid == min(rnd.cohort)):
            with torch.no_grad():
                fed.params[0].view(-1)[0] = float("nan")


class SleepPerRound(FederatedCallback):
    """Test callback: sleeps ``seconds`` at every round start (of the rounds before ``until``, 0-based, when given), so
    that an outside signal lands mid-run or a wall-time rule sees slow rounds."""

    def __init__(self, seconds: float, until: int | None = None) -> None:
        self.seconds, self.until = seconds, until

    def on_round_start(self, fed: Federation, rnd: object) -> None:
        import time

        if self.until is None or rnd.round < self.until:
            time.sleep(self.seconds)


def process_start_time(pid: int | str = "self") -> float:
    """When process ``pid`` was created (epoch seconds, 10 ms resolution), from /proc."""
    import os

    start_ticks = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
    boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


class StartTimes(FederatedCallback):
    """Writes ``rank<LOCAL_RANK>.json`` to ``out`` at fit start: the process's creation time, the fit start, and the
    garbage collector's state (on, and how many objects ``gc.freeze`` left out of its collections)."""

    def __init__(self, out: str) -> None:
        self.out = out

    def on_fit_start(self, trainer, pl_module) -> None:
        import gc
        import json
        import os
        import time

        rank = os.environ.get("LOCAL_RANK", "0")
        record = {"created": process_start_time(), "fit_start": time.time(), "global_rank": trainer.global_rank}
        record.update(gc_enabled=gc.isenabled(), gc_frozen=gc.get_freeze_count())
        with open(os.path.join(self.out, f"rank{rank}.json"), "w") as f:
            json.dump(record, f)


class SignalAtFitStart(FederatedCallback):
    """Test callback: sends ``signal`` to its own process in ``on_fit_start``: after the start-up's last check and
    before the first round, the window the fit loop covers (flx.loop.FederatedFitLoop.on_run_start)."""

    def __init__(self, signal: str) -> None:
        self.signal = signal

    def on_fit_start(self, trainer: object, pl_module: object) -> None:
        import os
        import signal

        os.kill(os.getpid(), getattr(signal, self.signal))


class RecordOrder(FederatedCallback):
    """Records the order of a part's build check, attach and state load (class-level: the run builds its own)."""

    traits = PartTraits(uploads={})
    calls: list[str] = []

    def check(self, build: Build) -> None:
        RecordOrder.calls.append("check")

    def on_attach(self, fed) -> None:
        RecordOrder.calls.append("on_attach")

    def state_dict(self) -> dict[str, int]:
        return {"saved": 1}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        RecordOrder.calls.append("load_state_dict")
