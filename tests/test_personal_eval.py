"""Personalised evaluation inside Lightning's validation loop, against hand computations (real Trainer, digits).

A part that overrides ``personalize`` makes every validation log ``val/personal_acc_{mean,worst,p10}``: each client's
personalised model on its own evaluation rows. An identity personalisation must give the global model's per-client
summary; a personalisation that zeroes the net predicts class 0 everywhere, so a client's value is the share of label 0
among its rows.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from flx.config import precheck
from flx.hooks import FederatedCallback
from flx.run import build

pytestmark = pytest.mark.slow

TINY = [
    "data=digits",
    "model=mlp",
    "model.hidden=[8]",
    "partition=dirichlet",
    "partition.alpha=0.3",
    "partition.num_clients=5",
    "partition.test_fraction=0.3",  # each client's own test rows (client_eval=holdout)
    "algo.clients_per_round=3",
    "algo.local_steps=2",
    "algo.rounds=2",
    "logger=none",
    "callbacks.round_curves=null",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "checkpoint=null",
]


class Identity(FederatedCallback):
    """Personalises nothing: the personalised model is the global one."""

    def personalize(self, fed, cid):
        return contextlib.nullcontext()


class Zero(FederatedCallback):
    """Client c's "personal" model has every parameter zero: constant logits, argmax class 0."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def personalize(self, fed, cid):
        self.calls.append(cid)

        @contextlib.contextmanager
        def zeroed():
            with torch.no_grad():
                for p in fed.params:
                    p.zero_()
            yield

        return zeroed()


def _fit(out: Path, part: str):
    cfg = precheck([*TINY, f"+algo.parts.p._target_=test_personal_eval.{part}", f"paths.output_dir={out}"])
    dm, module, trainer = build(cfg)
    trainer.fit(module, datamodule=dm)
    return dm, module, trainer


def test_identity_personalisation_equals_the_global_per_client_summary(tmp_path: Path) -> None:
    _, _, trainer = _fit(tmp_path, "Identity")
    m = trainer.callback_metrics
    for k in ("mean", "worst"):
        assert float(m[f"val/personal_acc_{k}"]) == pytest.approx(float(m[f"val/client_acc_{k}"]), abs=1e-6)
    assert float(m["val/personal_acc_worst"]) <= float(m["val/personal_acc_p10"]) <= float(m["val/personal_acc_mean"])


def test_zeroed_personal_models_score_the_share_of_label_0_and_the_net_is_restored(tmp_path: Path) -> None:
    dm, module, trainer = _fit(tmp_path, "Zero")
    part = next(cb for cb in trainer.callbacks if isinstance(cb, Zero))
    d = dm.data
    expected = []
    for rows in dm.client_train:  # a client's validation rows: those of the labels it trains on (client_eval=holdout)
        mine = torch.isin(d.y_val, d.y_train[rows].unique())
        expected.append(float((d.y_val[mine] == 0).double().mean()))
    expected = torch.tensor(expected, dtype=torch.float64)
    m = trainer.callback_metrics
    assert float(m["val/personal_acc_mean"]) == pytest.approx(float(expected.mean()), abs=1e-6)
    assert float(m["val/personal_acc_worst"]) == pytest.approx(float(expected.min()), abs=1e-6)
    assert float(m["val/personal_acc_p10"]) == pytest.approx(float(torch.quantile(expected, 0.1)), abs=1e-6)
    assert sorted(set(part.calls)) == list(range(5))  # every client, in each of the 2 validations
    assert len(part.calls) == 2 * 5
    assert any(float(p.abs().max()) > 0 for p in module.net.parameters())  # the global model came back
    assert float(m["val/acc"]) > float(expected.mean())  # and it, not the zeroed one, is what val/acc measured
    # the test loop runs under inference mode: the personalised evaluation must work there too
    trainer.test(module, datamodule=dm, verbose=False)
    tested = trainer.callback_metrics
    test_rows = dm.client_eval_data("test")
    share = torch.tensor([float((y == 0).double().mean()) for _, y in test_rows if len(y)], dtype=torch.float64)
    assert float(tested["test/personal_acc_mean"]) == pytest.approx(float(share.mean()), abs=1e-6)
