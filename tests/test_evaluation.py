"""Per-client evaluation: the global model batched over clients, the personalised models one by one, and evaluation
work only on the rounds Lightning validates."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, toy_data
from torch import Tensor

import flx.parts.robustness.client_loss as client_loss
from flx import evaluation
from flx.config import precheck
from flx.datamodules.client_eval import ClientRows
from flx.federation import Federation
from flx.hooks import FederatedCallback
from flx.module import FederatedModule
from flx.module_logging import Reporter
from flx.run import build

f64 = torch.float64


def _forwards(net: torch.nn.Module) -> list[int]:
    """The batch size of each forward pass of ``net`` from now on."""
    sizes: list[int] = []
    net.register_forward_hook(lambda m, args, out: sizes.append(len(args[0])))
    return sizes


def _by_hand(net: torch.nn.Module, x: Tensor, y: Tensor, rows: list[Tensor], fn=F.cross_entropy) -> list[float]:
    """``n_c fn(net(x_c), y_c)``, one forward per client."""
    with torch.no_grad():
        return [float(fn(net(x[r]), y[r])) * len(r) for r in rows]


def test_global_sums_forward_each_distinct_row_once_per_group() -> None:
    """batch_rows = 6; clients' rows {0..3}, {2..5}, {6..8}, {0..11}. Clients 0 and 1 share rows 2, 3: one group of
    6 distinct rows (not 8); client 2 (3 rows) would make it 9 > 6, so it starts a group; client 3 (12 > 6 rows) is
    alone, in chunks of 6. Forward passes: 6, 3, 6, 6 rows (21, not 23). Values: n_c CE of each client's rows, as one
    forward per client gives them; the net is back in training mode."""
    data = toy_data([12], dtype=f64)
    net = linear(dtype=f64)
    rows = [torch.arange(0, 4), torch.arange(2, 6), torch.arange(6, 9), torch.arange(0, 12)]
    fed = make_fed(net, data)
    sizes = _forwards(net)
    got = evaluation.global_sums(fed, data.x, data.y, rows, range(4), F.cross_entropy, batch_rows=6)
    assert sizes == [6, 3, 6, 6]
    expected = _by_hand(net, data.x, data.y, rows)
    assert list(got) == [0, 1, 2, 3]
    torch.testing.assert_close(torch.tensor(list(got.values())), torch.tensor(expected), rtol=1e-12, atol=0)
    assert net.training


class _ShiftOdd(FederatedCallback):
    """Odd clients' personalised model: the global one with ``cid`` added to class 0's bias; even clients: the
    global."""

    def personalize(self, fed, cid):
        if cid % 2 == 0:
            return None

        @contextlib.contextmanager
        def shifted():
            with torch.no_grad():
                fed.net.bias[0] += float(cid)
            yield

        return shifted()


def _shift_case() -> tuple[object, ClientRows]:
    """6 clients over 8 shared rows (client c: rows c .. c + 2), client 5 none."""
    data = toy_data([8], dtype=f64)
    rows = [torch.arange(c, c + 3) for c in range(5)] + [torch.zeros(0, dtype=torch.long)]
    return data, ClientRows(data.x, data.y, rows)


def test_evaluate_clients_batches_the_global_model_clients_and_runs_each_personalised_one() -> None:
    """Clients 0, 2, 4 have the global model: one forward over their 7 distinct rows (0..6); clients 1 and 3 one
    forward each with their shifted bias. Values: each client's accuracy under its own model; NaN without rows."""
    data, evaluation_rows = _shift_case()
    net = linear(dtype=f64)
    fed = make_fed(net, data, [_ShiftOdd()])
    sizes = _forwards(net)
    got = fed.evaluate_clients(evaluation_rows, _acc)
    assert sorted(sizes) == [3, 3, 7]
    with torch.no_grad():
        for c in range(5):
            x, y = evaluation_rows[c]
            out = net(x)
            out[:, 0] += float(c) if c % 2 else 0.0
            assert float(got[c]) == pytest.approx(float(_acc(out, y)), abs=1e-12)
        x, y = evaluation_rows[3]
        assert float(got[3]) != pytest.approx(float(_acc(net(x), y)))  # the shift changed client 3's predictions
    assert torch.isnan(got[5])


def test_evaluate_clients_on_two_ranks_sums_to_one_rank() -> None:
    """Client c on rank c % 2; the two ranks' (sum, rows) tables add up to the one-rank values."""
    data, evaluation_rows = _shift_case()
    one = make_fed(linear(dtype=f64), data, [_ShiftOdd()]).evaluate_clients(evaluation_rows, _acc)
    tables: list[Tensor] = []

    def keep(table: Tensor) -> Tensor:  # stands in for the all-reduce: each rank's own table
        tables.append(table)
        return table

    for r in (0, 1):
        fed = make_fed(linear(dtype=f64), data, [_ShiftOdd()], rank=r, world_size=2, reduce_sum=keep)
        fed.evaluate_clients(evaluation_rows, _acc)
    total = tables[0] + tables[1]
    assert tables[0][1::2, 1].sum() == 0 and tables[1][0::2, 1].sum() == 0  # each rank only its own clients
    torch.testing.assert_close((total[:5, 0] / total[:5, 1]).cpu(), one[:5], rtol=0, atol=1e-12)


def _acc(out: Tensor, y: Tensor) -> Tensor:
    return (out.argmax(-1) == y).double().mean()


# ------------------------------------------------------------------------------------------------ every k rounds
SMALL = [
    "model=logreg",
    "partition.num_clients=6",
    "algo.clients_per_round=3",
    "algo.local_steps=2",
    "algo.rounds=7",
    "eval_every=3",
    "logger=csv",
    "checkpoint=null",
    "callbacks.progress_bar=null",
    "trainer.enable_progress_bar=false",
    "trainer.accelerator=cpu",
    "+algo.parts.client_loss._target_=flx.parts.robustness.client_loss.ClientLoss",
    "+algo.parts.personal._target_=flx.parts.personalisation.personal_model.PersonalModel",
    "+algo.parts.personal.model=local",
]


@pytest.mark.slow
def test_evaluation_work_runs_on_validated_rounds_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """eval_every=3 over 7 rounds: Lightning validates after rounds 3 and 6, and every piece of evaluation work runs
    after exactly those rounds: the validation steps, the per-client training losses (ClientLoss), the personalised
    evaluation, the global model's batched per-client passes and the per-client table; FedAvg's training evaluates
    no loss (``eval_loss`` runs once, on the initial model, for the divergence rule's reference)."""
    calls: dict[str, list[int]] = defaultdict(list)

    def spy(owner: object, name: str, key: str | None = None) -> None:
        original = getattr(owner, name)

        def counted(first, *args, **kwargs):
            fed = first if isinstance(first, Federation) else getattr(first, "module", first).federation
            calls[key or name].append(fed.server.round)
            return original(first, *args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    spy(FederatedModule, "validation_step")
    spy(Reporter, "client_table")  # the module's logging: its first argument is the Reporter
    spy(Federation, "evaluate_clients")
    spy(Federation, "eval_loss")
    spy(client_loss, "client_train_losses")
    spy(evaluation, "global_sums")  # client_losses (ClientLoss) and evaluate_clients call it
    dm, module, trainer = build(precheck([*SMALL, f"paths.output_dir={tmp_path}"]))
    trainer.fit(module, datamodule=dm)
    assert module.federation.server.round == 7
    for key in ("validation_step", "client_table", "evaluate_clients", "client_train_losses", "global_sums"):
        assert sorted(set(calls[key])) == [3, 6], key
    assert calls["eval_loss"] == [0]  # once, before round 1: the divergence rule's L_0 (flx.faults.DivergenceWatch)
    assert calls["client_train_losses"] == calls["evaluate_clients"] == [3, 6]  # once per validation
