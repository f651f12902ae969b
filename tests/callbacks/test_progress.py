"""The console (``flx.callbacks.progress.RoundProgressBar``): bars that redraw by time, not per client; one line per
evaluation round in logs; nothing of Lightning's own epoch / validation / test bars."""

from __future__ import annotations

import csv
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from flx.callbacks.progress import RoundProgressBar
from flx.config import precheck
from flx.errors import ConfigError
from flx.run import train
from flx.tasks import Classification

TINY = ["model=logreg", "partition.num_clients=6", "algo.clients_per_round=3", "algo.local_steps=2"]
TINY += ["trainer.accelerator=cpu", "callbacks.round_curves=null"]


class Clock:
    """tqdm's clock (``tqdm.std.time``), moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _trainer(epoch: int = 0, rounds: int = 6, clients: int = 1000) -> SimpleNamespace:
    """The few Trainer attributes the bar reads."""
    return SimpleNamespace(
        current_epoch=epoch,
        max_epochs=rounds,
        max_steps=-1,
        global_step=0,
        train_dataloader=SimpleNamespace(clients=tuple(range(clients))),  # the round's one batch: this rank's shard
        callbacks=[],
        callback_metrics={},
        sanity_checking=False,
        is_global_zero=True,
    )


def test_client_bar_redraws_by_time_not_per_client(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """1000 clients, 1 ms each on tqdm's clock, ``refresh_seconds=0.2``: the client bar is drawn at the round start
    and then at most once per 0.2 s of the round's 1 s, i.e. a handful of times, not 1000; it still counts every
    client."""
    clock = Clock()
    monkeypatch.setattr("tqdm.std.time", clock)
    bar, trainer = RoundProgressBar(mode="bar", refresh_seconds=0.2), _trainer()
    module = SimpleNamespace(task=Classification())
    bar.setup(trainer, module, "fit")
    bar.on_train_start(trainer, module)
    bar.on_train_epoch_start(trainer, module)
    capsys.readouterr()
    for _ in range(1000):
        clock.now += 1e-3
        bar.on_train_client_end(trainer, module, 0)
    draws = capsys.readouterr().err.count("clients:")
    assert bar.clients.n == 1000 and bar.clients.total == 1000
    assert 1 <= draws <= 1 / 0.2 + 1


def test_round_bar_starts_at_the_resumed_round_and_shows_loss_and_headline(capsys) -> None:
    """Resumed after 3 of 6 rounds: the round bar starts at 3/6. When round 4's values are logged (reported as round
    5 starts) it is at 4/6 with the loss and the headline metrics of the latest evaluation, not the other metrics."""
    bar, trainer = RoundProgressBar(mode="bar"), _trainer(epoch=3)
    module = SimpleNamespace(task=Classification())
    bar.setup(trainer, module, "fit")
    bar.on_train_start(trainer, module)
    assert (bar.rounds.n, bar.rounds.total) == (3, 6)
    bar.on_train_epoch_start(trainer, module)
    bar.on_validation_end(trainer, module)
    bar.on_train_epoch_end(trainer, module)
    trainer.callback_metrics = {"train/loss": 0.41234, "val/acc": 0.9125, "val/loss": 0.3}
    trainer.current_epoch = 4
    bar.on_train_epoch_start(trainer, module)
    assert bar.rounds.n == 4 and bar.rounds.postfix == "loss=0.4123  val/acc=0.9125"
    bar.on_train_end(trainer, module)
    assert bar.rounds is None and bar.clients is None


def test_mode_is_checked() -> None:
    with pytest.raises(ConfigError, match="callbacks.progress_bar.mode"):
        RoundProgressBar(mode="quiet")


def _csv_by_round(path: Path) -> dict[int, dict[str, float]]:
    by_round: dict[int, dict[str, float]] = defaultdict(dict)
    for row in csv.DictReader(open(path)):
        by_round[int(row["epoch"]) + 1] |= {k: float(v) for k, v in row.items() if v and k != "epoch"}
    return by_round


@pytest.mark.slow
def test_lines_mode_prints_one_line_per_evaluation_round(tmp_path: Path, capfd) -> None:
    """``mode=lines``, 3 rounds, ``eval_every=2``: one line for round 2 (evaluated) and one for round 3 (the last,
    not evaluated: loss only), with the values of ``csv/metrics.csv``; no carriage return, no Lightning bar text, no
    ``weights_only`` notice (written by every checkpoint before), and the final line."""
    over = [*TINY, "logger=csv", "algo.rounds=3", "eval_every=2"]
    train(precheck([*over, "callbacks.progress_bar.mode=lines", f"paths.output_dir={tmp_path}"]))
    out, err = capfd.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("round ")]
    assert [line.split("  ")[0] for line in lines] == ["round 2/3", "round 3/3"]
    logged = _csv_by_round(tmp_path / "csv" / "metrics.csv")
    for line, r, keys in zip(lines, (2, 3), (("loss", "val/acc"), ("loss",))):
        shown = dict(re.findall(r"(\S+)=(\S+)", line))
        assert tuple(shown) == keys and line.endswith(" s")
        for key, value in shown.items():
            assert float(value) == pytest.approx(logged[r]["train/loss" if key == "loss" else key], rel=5e-4)
    assert "\r" not in out + err and not re.search("Epoch|Validation|Testing|weights_only", out + err)
    assert re.search(r"^final test_acc=\d\.\d{4}$", out, re.M)


@pytest.mark.slow
def test_bar_mode_draws_rounds_and_clients_only(tmp_path: Path, capfd) -> None:
    """``mode=bar``: the round and client bars, none of Lightning's (``Epoch``, ``Validation DataLoader``,
    ``Testing``, ``Training``)."""
    over = [*TINY, "logger=none", "checkpoint=null", "algo.rounds=2", "callbacks.progress_bar.mode=bar"]
    train(precheck([*over, f"paths.output_dir={tmp_path}"]))
    out, err = capfd.readouterr()
    assert "round:" in err and "clients:" in err and "loss=" in err and "val/acc=" in err
    assert not re.search("Epoch|Validation|Testing|Training", out + err)


@pytest.mark.slow
def test_fedxl_final_line_has_auroc_and_pauc(tmp_path: Path, capfd) -> None:
    """FeDXL's part adds AUROC and the pAUCs to the final line, after ``final test_acc=``, with the test's values."""
    over = ["algo=fedxl2", "data=digits_binary", "partition=iid", "partition.num_clients=4", "algo.local_steps=2"]
    over += ["algo.rounds=1", "logger=none", "checkpoint=null", "trainer.accelerator=cpu"]
    metrics = train(precheck([*over, "callbacks.progress_bar.mode=off", f"paths.output_dir={tmp_path}"]))
    out, _ = capfd.readouterr()
    expected = " ".join(f"test_{k}={metrics[f'test/{k}']:.4f}" for k in ("acc", "auroc", "pauc_0.3", "pauc_0.5"))
    assert f"final {expected}\n" in out
