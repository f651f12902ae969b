"""Tasks (flx/tasks.py): the regression loss and metrics, a custom loss, FedAvg on linear regression in closed form,
the task config group end to end, and its one-line errors."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import linear, make_fed, params, raises_one_line, run_rounds
from hydra.utils import instantiate
from omegaconf import OmegaConf

from flx.config import precheck
from flx.datamodules.datamodule import ClientStore
from flx.datamodules.store import TensorData
from flx.run import build
from flx.tasks import Classification, Custom, MaskedLM, Regression

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["callbacks=none", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu"]
DIABETES = ["task=regression", "data=diabetes", "partition=iid", "model=logreg", *QUIET]


def regression_store(sizes: list[int], dim: int = 3, seed: int = 0, noise: float = 0.0) -> ClientStore:
    """float64 Gaussian inputs, targets ``y = x w* + b*`` (+ noise); client ``c`` owns a block of ``sizes[c]`` rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), dim, generator=g, dtype=torch.float64)
    w_star = torch.arange(1, dim + 1, dtype=torch.float64) * (-1.0) ** torch.arange(dim)
    y = x @ w_star + 0.5 + noise * torch.randn(len(x), generator=g, dtype=torch.float64)
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return ClientStore(x, y, [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])])


# ----------------------------------------------------------------------------------------------------- the losses
def test_regression_loss_is_the_mean_squared_error() -> None:
    """``(B, 1)`` outputs against ``(B,)`` targets: mean_b (o_b - y_b)^2 (no (B, B) broadcast); ``(B, K)``: the mean
    over every entry; ``scale`` multiplies it; float32 targets meet float64 outputs in float64."""
    out, y = torch.tensor([[1.0], [2.0], [-1.0]]), torch.tensor([0.5, 2.0, 1.0])
    expected = ((1.0 - 0.5) ** 2 + 0.0 + (-1.0 - 1.0) ** 2) / 3
    assert Regression().loss(out, y).item() == pytest.approx(expected, rel=1e-7)
    assert Regression(scale=0.5).loss(out, y).item() == pytest.approx(0.5 * expected, rel=1e-7)
    wide = torch.tensor([[1.0, 0.0], [3.0, 1.0]])
    assert Regression().loss(wide, torch.zeros(2, 2)).item() == pytest.approx((1 + 0 + 9 + 1) / 4)
    assert Regression().loss(out.double(), y).dtype == torch.float64
    assert Regression().target_dtype == torch.float32 and Classification().target_dtype == torch.int64


def test_custom_loss_sees_outputs_in_the_target_shape() -> None:
    out, y = torch.tensor([[1.0], [2.0], [-1.0]]), torch.tensor([0.5, 2.0, 1.0])
    task = Custom(loss=partial(F.l1_loss), metric=partial(F.mse_loss))
    assert task.loss(out, y).item() == pytest.approx((0.5 + 0.0 + 2.0) / 3)
    assert task.metric_name == "mse_loss" and task.metric(out, y).item() == pytest.approx(Regression().loss(out, y))
    ce = Custom(loss=F.cross_entropy, targets="classes")
    logits, labels = torch.randn(4, 3), torch.tensor([0, 2, 1, 2])
    assert torch.equal(ce.loss(logits, labels), F.cross_entropy(logits, labels))


def test_task_configs_instantiate() -> None:
    """configs/task/*.yaml build with Hydra's instantiate; bad values give one line."""
    for name, cls in (("classification", Classification), ("regression", Regression), ("custom", Custom)):
        assert type(instantiate(OmegaConf.load(ROOT / "configs" / "task" / f"{name}.yaml"))) is cls
    raises_one_line(Regression, scale=-1.0, match="task.scale=-1.0")
    raises_one_line(Custom, loss="l1", match="task.loss='l1'")
    raises_one_line(Custom, loss=F.l1_loss, targets="ordinal", match="allowed: classes, real")


# ----------------------------------------------------------------------------------------------------- FedAvg
def test_custom_l1_task_trains_a_linear_model_by_fedavg() -> None:
    """Noise-free y = x w* + b*: the L1 loss is 0 at (w*, b*) only; FedAvg with local SGD on it gets close."""
    data = regression_store([30, 20, 25, 15])
    net = linear(3, 1, dtype=torch.float64)
    task = Custom(loss=partial(F.l1_loss))
    rows = torch.arange(len(data.y))
    before = task.loss(net(data.x[rows]), data.y[rows]).item()
    fed = make_fed(net, data, loss_fn=task.loss, clients_per_round=4, local_steps=5, batch_size=8, lr=0.05, seed=1)
    run_rounds(fed, 60)
    after = fed.eval_loss(rows)
    assert after < 0.05 * before, (before, after)
    w_star = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(net.weight.detach()[0], w_star, rtol=0, atol=0.05)


def test_one_fedavg_round_of_full_batch_gd_on_linear_regression_is_the_closed_form() -> None:
    """Client i: X~_i = [X_i, 1], theta = (w, b), f_i = ||X~_i theta - y_i||^2 / n_i (the Regression loss); a full
    batch GD step is theta <- A_i theta + c_i with A_i = I - (2 eta / n_i) X~_i^T X~_i, c_i = (2 eta / n_i) X~_i^T y_i,
    so after K steps theta_i = A_i^K theta^t + sum_{j<K} A_i^j c_i, and FedAvg's new global model is
    theta^{t+1} = sum_i n_i theta_i / sum_i n_i."""
    sizes, eta, k = [7, 12, 5], 0.05, 3
    data = regression_store(sizes, noise=0.3)
    net = linear(3, 1, dtype=torch.float64)
    theta0 = torch.cat([p.reshape(-1) for p in params(net)])  # (w_1, w_2, w_3, b)
    fed = make_fed(net, data, loss_fn=Regression().loss, clients_per_round=3, local_steps=k, batch_size=64, lr=eta)
    run_rounds(fed, 1)

    total = torch.zeros_like(theta0)
    for rows in data.client_indices:
        xt = torch.cat([data.x[rows], torch.ones(len(rows), 1, dtype=torch.float64)], 1)
        n = len(rows)
        a = torch.eye(4, dtype=torch.float64) - 2 * eta / n * xt.T @ xt
        c = 2 * eta / n * xt.T @ data.y[rows]
        theta = torch.linalg.matrix_power(a, k) @ theta0 + sum(torch.linalg.matrix_power(a, j) @ c for j in range(k))
        total += n * theta
    expected = total / sum(sizes)
    got = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------------- the module
@pytest.mark.slow
def test_module_val_mse_and_client_mse_equal_the_hand_computed_values(tmp_path: Path) -> None:
    """For the initial (fixed) net: val/mse and val/loss = mean over the validation rows of (net(x) - y)^2, rmse its
    root; test/client_mse_{mean,worst,std} summarise each client's MSE on its held-out rows (worst: the largest)."""
    cfg = precheck(
        [*DIABETES, "logger=none", "checkpoint=null", "partition.test_fraction=0.3", f"paths.output_dir={tmp_path}"]
    )
    dm, module, trainer = build(cfg)
    d = dm.data
    assert d.num_val == math.floor(0.1 * 353 + 0.5) and d.y_val.dtype == torch.float32
    assert abs(float(d.y_train.mean())) < 1e-5 and abs(float(d.y_train.std(unbiased=False)) - 1) < 1e-5
    val = trainer.validate(module, datamodule=dm, verbose=False)[0]
    test = trainer.test(module, datamodule=dm, verbose=False)[0]
    with torch.no_grad():
        mse = ((module.net(d.x_val)[:, 0].double() - d.y_val.double()) ** 2).mean()
        per_client = torch.stack(
            [((module.net(d.x_train[r])[:, 0].double() - d.y_train[r].double()) ** 2).mean() for r in dm.client_test]
        )
    assert val["val/mse"] == pytest.approx(float(mse), rel=1e-6)
    assert val["val/loss"] == pytest.approx(float(mse), rel=1e-6)
    assert val["val/rmse"] == pytest.approx(math.sqrt(float(mse)), rel=1e-6)
    assert test["test/client_mse_mean"] == pytest.approx(float(per_client.mean()), rel=1e-6)
    assert test["test/client_mse_worst"] == pytest.approx(float(per_client.max()), rel=1e-6)
    assert test["test/client_mse_std"] == pytest.approx(float(per_client.std(unbiased=False)), rel=1e-6)
    assert not any("acc" in key for key in (*val, *test))


# ----------------------------------------------------------------------------------------------------- train.py
def _train(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", *args, f"hydra.run.dir={out}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env, check=False)


@pytest.mark.slow
def test_train_regression_on_diabetes_end_to_end(tmp_path: Path) -> None:
    args = ["task=regression", "data=diabetes", "model=mlp", "partition=iid", "algo.rounds=3", *QUIET]
    proc = _train(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final test_mse=" in proc.stdout
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    val = [float(r["val/mse"]) for r in rows if r.get("val/mse")]
    assert len(val) == 3 and all(math.isfinite(v) for v in val)
    assert val[-1] < 1.0  # below the MSE of predicting the training mean (standardised target)
    assert any(r.get("test/rmse") for r in rows) and "val/acc" not in rows[0]


@pytest.mark.parametrize(
    "args, expect",
    [
        (("task=regression",), ("task='regression'", "data=digits has class labels", "task=classification")),
        (("data=diabetes",), ("task='classification'", "real-valued targets", "task=regression")),
        (("task=regression", "data=diabetes"), ("partition='dirichlet'", "allowed: iid, quantity_skew")),
    ],
    ids=["regression-on-classes", "classification-on-real", "dirichlet-on-real"],
)
def test_bad_task_combination_gives_one_line_and_exit_2(
    args: tuple[str, ...], expect: tuple[str, ...], tmp_path: Path
) -> None:
    proc = _train(tmp_path / "run", *args, "logger=none")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("flx: error: ") and all(e in lines[0] for e in expect), lines[0]


def test_precheck_names_the_bad_task_key_in_one_line() -> None:
    """In-process (torch is imported already): a custom loss or metric that does not import, a task that is not one,
    an algorithm for binary labels, per-label client evaluation or a partition by label on real targets."""
    custom = ["task=custom", "data=diabetes", "partition=iid"]
    cases = [
        ([*custom, "task.loss._target_=torch.nn.functional.no_such_loss"], "task.loss._target_='torch.nn"),
        ([*custom, "+task.metric._target_=no_such_module.mse"], "task.metric._target_='no_such_module.mse'"),
        ([*custom, "task.targets=ordinal"], "task.targets='ordinal': allowed: classes, real"),
        (["task._target_=flx.tasks.NoSuchTask"], "task._target_='flx.tasks.NoSuchTask': cannot be imported"),
        ([*DIABETES, "algo=fedxl1"], "algo=fedxl1 needs a binary task"),
        ([*DIABETES, "client_eval=test_labels"], "client_eval='test_labels': needs class labels"),
        ([*DIABETES, "partition=one_class_per_client"], "partition='one_class': splits by class label"),
    ]
    for args, match in cases:
        raises_one_line(precheck, args, match=match)
    assert precheck([*DIABETES, "partition=quantity_skew"]) is not None


# ----------------------------------------------------------------------------------------------------- masked LM
L2, L3 = math.log(2.0), math.log(3.0)
Z = [0.0, 0.0, 0.0]  # softmax 1/3 each; [log 2, 0, 0]: (1/2, 1/4, 1/4)


def _lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches of logits ``(1, L, 3)`` and token targets: A scores 1 of 2 positions (word 0 at ``(1/2, 1/4,
    1/4)``: loss ``log 2``, right), B all 3 (word 1 at ``(1/2, 1/4, 1/4)``: ``log 4``, wrong; word 2 at uniform:
    ``log 3``, wrong (argmax ties pick word 0); word 1 at ``(1/4, 1/2, 1/4)``: ``log 2``, right)."""
    a = (torch.tensor([[[L2, 0.0, 0.0], [0.0, 5.0, 0.0]]]), torch.tensor([[0, -100]]))
    b = (torch.tensor([[[L2, 0.0, 0.0], Z, [0.0, L2, 0.0]]]), torch.tensor([[1, 2, 1]]))
    return [a, b]


def test_masked_lm_loss_is_the_mean_over_scored_positions() -> None:
    """``l = (1/|S|) sum_{S} -log softmax(o)_y`` over the positions with a target (not -100); 0, with a zero
    gradient, when nothing is scored; equal to ``F.cross_entropy(ignore_index=-100)`` otherwise."""
    task = MaskedLM()
    (oa, ya), (ob, yb) = _lm_batches()
    assert task.loss(oa, ya).item() == pytest.approx(L2, rel=1e-6)
    assert task.loss(ob, yb).item() == pytest.approx((2 * L2 + L3 + L2) / 3, rel=1e-6)
    out = torch.randn(4, 5, 7, requires_grad=True)
    y = torch.tensor([[3, -100, 0, -100, 6]] * 4)
    ref = F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)
    torch.testing.assert_close(task.loss(out, y), ref)
    none = task.loss(out, torch.full((4, 5), -100))
    none.backward()
    assert none.item() == 0.0 and not out.grad.any()
    assert task.client_metric(ob, yb).item() == pytest.approx(1 / 3)


def test_masked_lm_epoch_metrics_are_token_means() -> None:
    """Over the batches A (1 scored token) and B (3): ``loss = (log 2 + log 4 + log 3 + log 2) / 4``, not the mean of
    the batch means; ``acc = 2 / 4``; ``ppl = exp(loss) = 48^(1/4)``; per client (A's row: client 0, B's: client 1) the
    token accuracy ``1`` and ``1/3``."""
    metrics = MaskedLM().metrics(3, 2)
    for c, (out, y) in enumerate(_lm_batches()):
        metrics.update(out, y)
        metrics.update_clients(out, y, torch.tensor([c]))
    values = metrics.values()
    loss = (4 * L2 + L3) / 4
    assert values["loss"].compute().item() == pytest.approx(loss, rel=1e-6)
    assert loss != pytest.approx((L2 + (3 * L2 + L3) / 3) / 2)  # what a mean over batches (rows) would give
    assert values["acc"].compute().item() == pytest.approx(0.5)
    assert values["ppl"].item() == pytest.approx(48**0.25, rel=1e-6)
    torch.testing.assert_close(metrics.client_values(), torch.tensor([1.0, 1 / 3]))
    assert metrics.client_key == "acc" and metrics.higher_is_better


def test_masked_lm_matches_only_token_data() -> None:
    """The loaded data's targets decide: token targets ``(N, L)`` for masked_lm, class labels for classification; the
    mismatch is one line naming what is allowed."""
    ids = torch.zeros(4, 6, dtype=torch.long)
    tokens = TensorData(ids, ids, ids, ids, num_classes=9, name="wikitext2")
    labels = TensorData(torch.zeros(4, 2), ids[:, 0], torch.zeros(4, 2), ids[:, 0], num_classes=2, name="digits")
    assert tokens.token_targets and not tokens.class_labels and labels.class_labels
    MaskedLM().check_data(tokens)
    assert MaskedLM().num_outputs(tokens) == 9
    raises_one_line(MaskedLM().check_data, labels, match="task='masked_lm': needs token targets and data=digits has")
    raises_one_line(Classification().check_data, tokens, match="data=wikitext2 has token targets; allowed with")


def test_precheck_names_the_bad_masked_lm_combination_in_one_line() -> None:
    """Before any loading: masked_lm on class labels, classification on WikiText-2, a partition by class label (WHALE's
    default shards) or per-label client evaluation on token targets."""
    lm = ["task=masked_lm", "data=wikitext2", "model=transformer_scalable", "partition=iid"]
    cases = [
        (["task=masked_lm"], "task='masked_lm': needs token targets and data=digits has class labels"),
        (
            ["data=wikitext2", "partition=iid"],
            "data=wikitext2 has token targets; allowed with data=wikitext2: task=masked",
        ),
        ([*lm, "algo=whale", "system=mobile20", "partition=shards"], "partition='shards': splits by class label and"),
        ([*lm, "client_eval=test_labels"], "data=wikitext2 has token targets; allowed: holdout, test_group"),
        ([*lm, "data.targets=ordinal"], "data.targets='ordinal': allowed: classes, real, tokens"),
    ]
    for args, match in cases:
        raises_one_line(precheck, args, match=match)
    message = raises_one_line(precheck, [*lm[:3], "algo=whale", "system=mobile20"], match="partition='shards'")
    assert "token targets (a masked language model); allowed: iid" in message
