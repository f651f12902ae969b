"""The pFedFBE configs end to end on a real Trainer (``precheck`` + ``build`` as ``train.py`` does, in process).

Diabetes regression with 4 clients that each hold a test share: every personalised algorithm logs
``test/personal_mse_{mean,worst,p10}`` (``eval_test=true`` evaluates the test split every round), finite; FedAvg's
personalised model is the global one, so its personal summary is the global model's per-client summary. pFedFBE
composes with DRFA's lambda sampling and FedProx's term from the command line (issue 10 item 9): with ``mu=0`` the
run equals pFedFBE with DRFA's lambda exactly.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flx.config import precheck
from flx.parts.robustness.lambda_sampling import LambdaSampling
from flx.run import build

pytestmark = pytest.mark.slow

TINY = [
    "data=diabetes",
    "task=regression",
    "model=logreg",
    "partition=iid",
    "partition.num_clients=4",
    "partition.test_fraction=0.25",
    "eval_test=true",
    "algo.clients_per_round=2",
    "algo.rounds=2",
    "algo.local_steps=2",
    "algo.batch_size=8",
    "logger=none",
    "callbacks.round_curves=null",
    "trainer.accelerator=cpu",
    "trainer.enable_progress_bar=false",
    "checkpoint=null",
    "trainer.precision=64-true",
]
DRFA = [
    "+algo.parts.lambda_sampling._target_=flx.parts.robustness.lambda_sampling.LambdaSampling",
    "+algo.parts.lambda_sampling.gamma=0.05",
]

OBJECTIVE = [
    "+algo.parts.objective._target_=flx.parts.measures.objective.Objective",
    '+algo.parts.objective.regularizer={name: l1, mu: 0.1, params: ["*weight"]}',
]


def _fit(out: Path, *overrides: str):
    cfg = precheck([*TINY, *overrides, f"paths.output_dir={out}"])
    dm, module, trainer = build(cfg)
    trainer.fit(module, datamodule=dm)
    return module, trainer


@pytest.mark.parametrize(
    "overrides",
    [
        ("algo=pfedfbe", "algo.regularizer.name=l1", "algo.regularizer.mu=0.1"),
        ("algo=pfedfbe", "algo.hessian=fd", "algo.hessian_batch=same"),
        ("algo=pfedme", "algo.personal_lr=0.02"),
        ("algo=ditto",),
        ("algo=fedprox_personal",),
        ("algo=fedavg_personal",),
    ],
    ids=["pfedfbe-l1", "pfedfbe-fd-same", "pfedme", "ditto", "fedprox_personal", "fedavg_personal"],
)
def test_each_algorithm_logs_finite_personal_metrics(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    """With the Objective part (h = 0.1 ||weight||_1): the personalised objectives on the training rows and on each
    client's test rows are logged for every algorithm, pFedFBE's envelope objective for pFedFBE; FedAvg's personalised
    model is the global one, so its personalised objective is its objective and its test form is the per-client test
    MSE (the task loss) plus h(w)."""
    _, trainer = _fit(tmp_path, *overrides, *OBJECTIVE)
    m = {k: float(v) for k, v in trainer.callback_metrics.items()}
    keys = ("test/personal_mse_mean", "test/personal_mse_worst", "test/personal_mse_p10", "train/loss")
    for key in (*keys, "train/personal_objective", "test/personal_objective"):
        assert math.isfinite(m[key]), (key, m)
    assert ("train/fbe_objective" in m) == (overrides[0] == "algo=pfedfbe")
    if overrides[0] == "algo=fedavg_personal":
        assert m["test/personal_mse_mean"] == pytest.approx(m["test/client_mse_mean"], rel=1e-6)
        assert m["train/personal_objective"] == pytest.approx(m["train/objective"], rel=1e-6)
        assert m["test/personal_objective"] == pytest.approx(m["test/client_mse_mean"] + m["train/h"], rel=1e-6)


def test_pfedfbe_with_drfa_lambda_and_a_zero_prox_term_from_the_command_line(tmp_path: Path) -> None:
    prox = ["+algo.parts.prox._target_=flx.parts.proximal.prox.Prox", "+algo.parts.prox.mu=0.0"]
    module, trainer = _fit(tmp_path / "both", "algo=pfedfbe", *DRFA, *prox)
    plain, _ = _fit(tmp_path / "drfa", "algo=pfedfbe", *DRFA)
    names = [type(cb).__name__ for cb in trainer.callbacks]
    assert names.index("FBE") < names.index("LambdaSampling") < names.index("Prox")  # Prox adds to G, after FBE
    assert all(torch.equal(a, b) for a, b in zip(module.net.parameters(), plain.net.parameters()))
    (drfa,) = [cb for cb in trainer.callbacks if isinstance(cb, LambdaSampling)]
    assert len(drfa.history) == 2 and not torch.allclose(drfa.lam, torch.full_like(drfa.lam, 0.25))
    assert math.isfinite(float(trainer.callback_metrics["test/personal_mse_mean"]))
