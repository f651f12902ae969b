"""model.init: the starting weights w^0 (``zeros`` for convex models, as the DRFA authors' code does)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import raises_one_line

from flx.config import precheck
from flx.models.init import init_weights
from flx.models.nets import MLP
from flx.run import build

QUIET = ["callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "trainer.accelerator=cpu", "logger=none"]


def test_zeros_sets_every_parameter_to_zero_and_default_keeps_the_net() -> None:
    net = MLP(input_shape=(6,), num_classes=3, hidden=(4,))
    before = [p.detach().clone() for p in net.parameters()]
    assert init_weights(net, "default") is net
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), before))
    init_weights(net, "zeros")
    assert all(torch.count_nonzero(p) == 0 for p in net.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("model", ["logreg", "mlp"])
def test_build_with_zeros_gives_an_all_zero_global_model(model: str, tmp_path: Path) -> None:
    """After ``build``, every parameter of the module's net (and so the federation's w^0) is exactly 0; the
    default init is not (PyTorch's uniform draws)."""
    for init, zero in (("zeros", True), ("default", False)):
        cfg = precheck([f"model={model}", f"model.init={init}", *QUIET, f"paths.output_dir={tmp_path / init}"])
        _, module, _ = build(cfg)
        counts = [int(torch.count_nonzero(p)) for p in module.net.parameters()]
        assert (sum(counts) == 0) == zero, counts


def test_bad_init_is_one_line(tmp_path: Path) -> None:
    raises_one_line(precheck, ["model.init=ones", f"paths.output_dir={tmp_path}"], match="model.init='ones'")
    raises_one_line(init_weights, MLP(input_shape=(2,), num_classes=2), "xavier", match="allowed: default, zeros")
