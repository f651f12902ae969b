"""ClientLoss: max_i f_i and mean_i f_i of the global model on the clients' training rows (the DRFA objective)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, run_rounds, toy_data

from flx.config import precheck
from flx.parts.robustness.client_loss import ClientLoss, client_train_losses
from flx.run import build

QUIET = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu", "logger=csv"]


def _by_hand(net: torch.nn.Module, data) -> torch.Tensor:
    """f_i = (1/n_i) sum_{r in D_i} CE(net(x_r), y_r), one entry per client (float64)."""
    with torch.no_grad():
        return torch.stack([F.cross_entropy(net(data.x[i]), data.y[i]) for i in data.client_indices]).double()


def test_losses_are_the_full_training_loss_per_client_on_one_and_two_ranks() -> None:
    """After a round, f_i of the new global model on each client's rows (sizes 3, 8, 5: an unweighted entry per
    client); on 2 ranks, rank 0 computes clients 0 and 2, rank 1 client 1, and their sum is the same vector."""
    data = toy_data([3, 8, 5], dtype=torch.float64)
    fed = make_fed(linear(dtype=torch.float64), data, clients_per_round=3, local_steps=2, batch_size=4, lr=0.5)
    run_rounds(fed, 1)
    expected = _by_hand(fed.net, data)
    torch.testing.assert_close(client_train_losses(fed), expected, rtol=0, atol=1e-12)

    # 2 ranks: client i on rank i mod 2; the identity stands in for the all-reduce, so each rank returns its share
    shares = [
        client_train_losses(make_fed(fed.net, data, rank=r, world_size=2, reduce_sum=lambda t: t, clients_per_round=3))
        for r in (0, 1)
    ]
    assert float(shares[0][1]) == 0 and float(shares[1][0]) == float(shares[1][2]) == 0
    torch.testing.assert_close(shares[0] + shares[1], expected, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_logged_values_equal_a_hand_computation(tmp_path: Path) -> None:
    """algo=drfa on digits (3 clients, 2 rounds, validated after round 2): train/client_loss_max and _mean logged
    after round 2 equal max_i f_i and (1/3) sum_i f_i of the final global model, computed by hand on each client's
    training rows; algo.client_loss=false logs neither; the DRFA family lists the part."""
    common = ["algo=drfa", "model=logreg", "partition=iid", "partition.num_clients=3", "algo.rounds=2", *QUIET]
    on = [*common, "algo.local_steps=2", "eval_every=2", f"paths.output_dir={tmp_path / 'on'}"]
    dm, module, trainer = build(precheck(on))
    trainer.fit(module, datamodule=dm)
    f = _by_hand(module.net, dm.clients)
    logged = trainer.callback_metrics
    assert float(logged["train/client_loss_max"]) == pytest.approx(float(f.max()), rel=1e-6)
    assert float(logged["train/client_loss_mean"]) == pytest.approx(float(f.mean()), rel=1e-6)
    assert float(f.max()) > float(f.mean())  # the clients differ: max and mean are not the same number
    curves = json.loads((tmp_path / "on" / "curves.json").read_text())  # recorded for the validated round only
    assert curves["train/client_loss_max"] == [[2, pytest.approx(float(f.max()), rel=1e-6)]]
    part = next(cb for cb in trainer.callbacks if isinstance(cb, ClientLoss))
    torch.testing.assert_close(part.last, f, rtol=1e-6, atol=0)

    dm, module, trainer = build(precheck([*common, "algo.client_loss=false", f"paths.output_dir={tmp_path / 'off'}"]))
    trainer.fit(module, datamodule=dm)
    assert "train/client_loss_max" not in trainer.callback_metrics and "val/acc" in trainer.callback_metrics
    for algo in ("drfa_prox", "drfa_ga", "afl"):
        cfg = precheck([f"algo={algo}", f"paths.output_dir={tmp_path / algo}"])
        assert cfg.algo.parts.client_loss._target_ == "flx.parts.robustness.client_loss.ClientLoss"
