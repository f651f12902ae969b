"""Binary heads: one place for loss, prediction and score, with one logit or two (model.binary_head)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import raises_one_line

from flx.config import precheck
from flx.models import heads
from flx.run import build

Z = torch.tensor([[2.0], [-1.0], [0.0]], dtype=torch.float64)  # one logit z per sample
Y = torch.tensor([1, 0, 1])


def test_one_logit_margin_score_prediction_and_loss() -> None:
    """z = [2, -1, 0], y = [1, 0, 1]: score sigmoid(z); prediction z > 0 = [1, 0, 0];
    BCE = (log(1 + e^-2) + log(1 + e^-1) + log 2) / 3 (y=0 costs log(1 + e^z))."""
    assert heads.binary_margin(Z).tolist() == [2.0, -1.0, 0.0]
    expected = [1 / (1 + math.exp(-2)), 1 / (1 + math.exp(1)), 0.5]
    torch.testing.assert_close(heads.binary_score(Z), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-15)
    assert heads.binary_score(Z, "logit").tolist() == [2.0, -1.0, 0.0]
    assert heads.predict(Z).tolist() == [1, 0, 0]
    bce = (math.log1p(math.exp(-2)) + math.log1p(math.exp(-1)) + math.log(2)) / 3
    assert heads.classification_loss(Z, Y).item() == pytest.approx(bce, abs=1e-15)


def test_two_logits_zero_and_z_are_the_one_logit_head() -> None:
    """Logits (0, z) give softmax p_1 = sigmoid(z): the same margin, score, prediction and loss as the one logit z."""
    two = torch.cat([torch.zeros_like(Z), Z], dim=1)
    torch.testing.assert_close(heads.binary_margin(two), heads.binary_margin(Z), rtol=0, atol=0)
    torch.testing.assert_close(heads.binary_score(two), heads.binary_score(Z), rtol=0, atol=1e-15)
    assert heads.predict(two).tolist() == heads.predict(Z).tolist()  # argmax of (0, 0) is class 0, as z > 0
    torch.testing.assert_close(heads.classification_loss(two, Y), heads.classification_loss(Z, Y), rtol=0, atol=1e-15)


def test_two_logits_margin_is_the_difference() -> None:
    out = torch.tensor([[0.5, 2.0], [1.0, -1.0]])
    assert heads.binary_margin(out).tolist() == [1.5, -2.0] and heads.predict(out).tolist() == [1, 0]
    with pytest.raises(ValueError, match="shape"):
        heads.binary_margin(torch.zeros(4, 3))


def test_num_outputs() -> None:
    assert heads.num_outputs("one_logit", 2) == 1 and heads.num_outputs("two_logits", 2) == 2
    assert heads.num_outputs("two_logits", 10) == 10
    raises_one_line(heads.num_outputs, "one_logit", 10, match="model.binary_head='one_logit'")
    raises_one_line(heads.num_outputs, "sigmoid", 2, match="allowed: two_logits, one_logit")


def test_build_rejects_one_logit_on_a_multiclass_dataset(tmp_path: Path) -> None:
    """Rejected by the pre-run check where the data config states its classes, by ``build`` from the loaded labels
    where it does not (``data.num_classes=null``)."""
    args = ["data=digits", "model=logreg", "model.binary_head=one_logit", f"paths.output_dir={tmp_path}"]
    raises_one_line(precheck, args, match="one_logit needs a binary task (2 classes), the data has 10")
    cfg = precheck([*args, "data.num_classes=null", "model.binary_head=two_logits"])
    cfg.model.binary_head = "one_logit"
    raises_one_line(build, cfg, match="one_logit needs a binary task (2 classes), the data has 10")


def test_build_one_logit_net_has_one_output(tmp_path: Path) -> None:
    overrides = ["data=digits_binary", "model=mlp", "model.binary_head=one_logit", "logger=none"]
    _, module, _ = build(precheck([*overrides, f"paths.output_dir={tmp_path}"]))
    assert module.net(torch.zeros(3, 64)).shape == (3, 1)
