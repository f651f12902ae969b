"""Float64 runs log float64 values: a ratio such as 4/10 reaches ``metrics.csv`` as ``0.4``, never as the float32
``0.4000000059604645``; float32 runs log what Lightning logs (float32).

The paths a value takes: a Python number through ``self.log`` (the parts' values) or ``Reporter.publish``
(``train/loss``), torchmetrics' states (``loss``, ``acc``, ``mse``), flx's per-client metrics and the AUROC's ROC
curve, and on N processes the one all-reduce of the metrics' sums (:func:`flx.metrics.sync.reduce_sums`), simulated
here with two ranks in process.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from flx.config import precheck
from flx.metrics.auc import AUROCs
from flx.metrics.dtype import default_dtype, logged_dtype
from flx.metrics.sync import reduce_sums, summed
from flx.parts.measures.structure import Structure
from flx.run import build
from flx.tasks import Classification
from flx.wandb_files import load_run
from flx.wandb_logging import finish

f64 = torch.float64
QUIET = ["trainer.accelerator=cpu", "trainer.enable_progress_bar=false", "callbacks.progress_bar=null"]
RUN = [*QUIET, "logger=csv", "checkpoint=null", "callbacks.round_curves=null", "trainer.precision=64-true"]


class _Trainer:
    def __init__(self, precision: str) -> None:
        self.precision = precision


def _is_float32(x: float) -> bool:
    return float(np.float32(x)) == x


def test_logged_dtype_follows_the_precision_plugin() -> None:
    assert logged_dtype(_Trainer("64-true")) == f64
    assert [logged_dtype(_Trainer(p)) for p in ("32-true", "bf16-mixed", "16-true")] == [torch.float32] * 3
    with default_dtype(f64):
        assert torch.tensor(0.8).item() == 0.8
    assert torch.get_default_dtype() == torch.float32


def test_split_metrics_in_float64_over_two_ranks_sum_exactly() -> None:
    """Rank 0 sees 2 rows (2 right), rank 1 sees 3 (2 right); after the one all-reduce of the sums every rank's
    accuracy is 4/5 = 0.8 and its loss the float64 mean of the five rows' losses; client 0 holds rows of both ranks
    (3 right of 4: 0.75), client 1 one row (1 right)."""
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 3.0], [0.5, 0.0]], dtype=f64)
    target, client = torch.tensor([0, 1, 0, 1, 1]), torch.tensor([0, 0, 0, 1, 0])
    ranks = [Classification().metrics(2, 2) for _ in range(2)]
    for metrics, rows in zip(ranks, (slice(0, 2), slice(2, 5))):
        metrics.set_value_dtype(f64)
        metrics.update(logits[rows], target[rows])
        metrics.update_clients(logits[rows], target[rows], client[rows])
    packed = [torch.cat([s.reshape(-1).double() for m in summed(r) for s in m.metric_state.values()]) for r in ranks]
    total = packed[0] + packed[1]  # what the all-reduce returns on each rank
    reduce_sums(summed(ranks[0]), lambda t: total)
    values = ranks[0].values()
    acc, loss = values["acc"].compute(), values["loss"].compute()
    assert acc.dtype == loss.dtype == f64 and acc.item() == 4 / 5
    rows = F.cross_entropy(logits, target, reduction="none").tolist()
    assert loss.item() == pytest.approx(math.fsum(rows) / 5, rel=1e-15)
    assert ranks[0].client_values().tolist() == [3 / 4, 1.0]


def test_auroc_in_float64_equals_sklearn() -> None:
    """Tied scores, 500 rows: AUROC and the McClish pAUCs agree with sklearn to float64 round-off (float32: ~1e-8)."""
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(500, generator=g, dtype=f64) * 4).round() / 4
    target = (torch.rand(500, generator=g) < 0.4).long()
    metric = AUROCs()
    metric.value_dtype = f64
    metric.update(scores, target)
    for key, value in metric.compute().items():
        max_fpr = None if key == "auroc" else float(key.removeprefix("pauc_"))
        expected = roc_auc_score(target.numpy(), scores.numpy(), max_fpr=max_fpr)
        assert value.dtype == f64 and value.item() == pytest.approx(expected, rel=1e-15, abs=1e-15), key


def _fit(out: Path, *overrides: str):
    dm, module, trainer = build(precheck([*RUN, *overrides, f"paths.output_dir={out}"]))
    trainer.fit(module, datamodule=dm)
    rows = list(csv.DictReader(open(out / "csv" / "metrics.csv")))
    return dm, module, trainer, rows


def _last(rows: list[dict[str, str]], key: str) -> str:
    return [r[key] for r in rows if r.get(key)][-1]


@pytest.mark.slow
def test_a_float64_lasso_run_logs_its_support_ratios_exactly(tmp_path: Path) -> None:
    """FedAvg on a 10-dimensional Lasso (truth: 4 ones, 6 zeros), 2 rounds: every weight of the final model is above
    the threshold, so the support precision (at each validation: ``val/``) is 4/10 and the recall 4/4, written
    ``0.4`` and ``1.0``; F1 2*4/(10+4); the test MSE and the loss (half the MSE) equal the hand computation on the
    test rows in float64; ``train/loss`` (a Python float, published) is the federation's own value, digit
    for digit."""
    lasso = ["algo=fedavg", "data=lasso_synthetic", "data.loader.num_clients=5", "data.loader.dim=10"]
    lasso += ["data.loader.ones=4", "data.loader.samples=20", "data.loader.test_samples=10", "algo.rounds=2"]
    lasso += ["algo.clients_per_round=5", "algo.local_steps=2", "algo.batch_size=10", "client_eval=test_group"]
    structure = "+algo.parts.structure._target_=flx.parts.measures.structure.Structure"
    dm, module, trainer, rows = _fit(tmp_path, *lasso, "eval_test=true", structure)
    (part,) = [cb for cb in trainer.callbacks if isinstance(cb, Structure)]
    (w,) = [p.detach() for n, p in module.net.named_parameters() if n.endswith("weight")]  # Structure's "*weight"
    assert bool((w.abs() >= part.threshold).all()) and int((part.truths != 0).sum(1).unique()) == 4
    assert _last(rows, "val/support_precision") == "0.4" == repr(4 / 10)
    assert _last(rows, "val/support_recall") == "1.0" == _last(rows, "val/personal_support_recall_mean")
    assert float(_last(rows, "val/support_f1")) == pytest.approx(8 / 14, rel=1e-15)
    x, y = dm.data.x_test.to(f64), dm.data.y_test.to(f64)
    with torch.no_grad():
        sq = (module.net(x).reshape(-1) - y).square().tolist()
    mse = math.fsum(sq) / len(sq)
    for key, expected in (("test/mse", mse), ("test/loss", mse / 2), ("test/rmse", math.sqrt(mse))):
        got = float(_last(rows, key))
        assert got == pytest.approx(expected, rel=1e-14) and not _is_float32(got), key
    assert _last(rows, "train/loss") == repr(module.federation.train_loss)


@pytest.mark.slow
def test_a_float64_classification_run_logs_its_accuracy_exactly(tmp_path: Path) -> None:
    """Digits, logistic regression, 2 rounds in float64: ``val/acc`` is k/n of the final model on the validation
    rows, written as the float64 ``repr(k / n)`` in ``metrics.csv`` and logged as that float to W&B (offline, read
    back from its files); ``val/loss`` is their mean cross-entropy in float64."""
    small = ["model=logreg", "partition.num_clients=6", "algo.clients_per_round=3", "algo.local_steps=3"]
    dm, module, trainer, rows = _fit(tmp_path, *small, "algo.rounds=2", "logger=[csv,wandb]")
    finish(trainer)
    x, y = dm.data.x_val.to(f64), dm.data.y_val
    with torch.no_grad():
        logits = module.net(x)
    k, n = int((logits.argmax(-1) == y).sum()), len(y)
    assert 0 < k < n and _last(rows, "val/acc") == repr(k / n)
    assert [row["val/acc"] for row in load_run(tmp_path).history if "val/acc" in row][-1] == k / n
    loss = math.fsum(F.cross_entropy(logits, y, reduction="none").tolist()) / n
    got = float(_last(rows, "val/loss"))
    assert got == pytest.approx(loss, rel=1e-14) and not _is_float32(got)
