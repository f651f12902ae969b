"""Frozen models (:func:`flx.models.frozen.load_frozen`): both checkpoint formats give the saved weights exactly; the
model has no trainable parameter and stays in eval mode; every bad checkpoint is one line naming the config key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import raises_one_line
from torch import nn

from flx.federation import FederationConfig, FederationSpec
from flx.models.build import net_from_config
from flx.models.frozen import load_frozen
from flx.module import FederatedModule

MLP = {"_target_": "flx.models.nets.MLP", "hidden": [16], "dropout": 0.5}
RESNET = {"_target_": "flx.models.timm_factory.timm_net", "name": "test_resnet"}  # tiny, with BatchNorm
SHAPE, CLASSES = (1, 8, 8), 10
KEY = "server.models.pm.checkpoint"


def _trained(model: dict = MLP, seed: int = 0) -> nn.Module:
    """A net whose weights differ from a fresh build's (so loading is seen), BatchNorm statistics included."""
    torch.manual_seed(seed)
    net = net_from_config(model, SHAPE, CLASSES)
    with torch.no_grad():
        for t in net.state_dict().values():
            t.copy_(torch.randn_like(t.float()).to(t.dtype) if t.is_floating_point() else t + 3)
    return net


def _save(net: nn.Module, path: Path, fmt: str) -> Path:
    """``state_dict``: the net's own state_dict; ``lightning``: a flx run's checkpoint (the module's state_dict,
    ``net.``-prefixed, next to Lightning's other entries)."""
    if fmt == "state_dict":
        torch.save(net.state_dict(), path)
    else:
        module = FederatedModule(net, FederationSpec(FederationConfig()), CLASSES, num_clients=4)
        torch.save({"epoch": 2, "global_step": 7, "state_dict": module.state_dict(), "flx": {"round": 3}}, path)
    return path


@pytest.mark.parametrize("fmt", ["state_dict", "lightning"])
def test_both_checkpoint_formats_load_the_saved_weights_exactly(tmp_path: Path, fmt: str) -> None:
    net = _trained()
    frozen = load_frozen(MLP, _save(net, tmp_path / "pm.ckpt", fmt), SHAPE, CLASSES, key=KEY)
    assert frozen.state_dict().keys() == net.state_dict().keys()
    for name, tensor in net.state_dict().items():
        assert torch.equal(frozen.state_dict()[name], tensor), name
    x = torch.randn(5, *SHAPE)
    torch.testing.assert_close(frozen(x), net.eval()(x), rtol=0, atol=0)


def test_frozen_model_has_no_trainable_parameters_and_stays_in_eval_mode(tmp_path: Path) -> None:
    """Even inside a parent switched to train mode (Lightning does so at fit start): dropout off, BatchNorm running
    statistics unchanged by a forward pass, no gradient reaches the frozen weights."""
    shape = (1, 32, 32)
    torch.manual_seed(0)
    net = net_from_config(RESNET, shape, CLASSES)
    torch.save(net.state_dict(), tmp_path / "pm.pt")
    frozen = load_frozen(RESNET, tmp_path / "pm.pt", shape, CLASSES)
    assert not any(p.requires_grad for p in frozen.parameters())
    parent = nn.ModuleDict({"pm": frozen, "head": nn.Linear(2, 2)}).train()
    assert parent["head"].training and not any(m.training for m in frozen.modules())
    before = {k: v.clone() for k, v in frozen.state_dict().items()}
    out = frozen(torch.randn(4, *shape))
    assert not out.requires_grad
    assert all(torch.equal(before[k], v) for k, v in frozen.state_dict().items())
    mlp = load_frozen(MLP, _save(_trained(), tmp_path / "mlp.pt", "state_dict"), SHAPE, CLASSES).train()
    x = torch.randn(8, *SHAPE)
    torch.testing.assert_close(mlp(x), mlp(x), rtol=0, atol=0)  # dropout(0.5) is off


def test_missing_checkpoint_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "nope.pt"
    message = raises_one_line(load_frozen, MLP, str(path), SHAPE, CLASSES, key=KEY, match="no such file")
    assert message == f"{KEY}='{path}': no such file (looked at {path})"


def test_shape_mismatch_names_the_key_and_the_first_mismatching_tensor(tmp_path: Path) -> None:
    path = _save(_trained(), tmp_path / "pm.pt", "state_dict")
    wide = {**MLP, "hidden": [32]}
    message = raises_one_line(load_frozen, wide, path, SHAPE, CLASSES, key=KEY, match=KEY)
    assert message.endswith("tensor 'net.1.weight' has shape (16, 64) in the checkpoint, (32, 64) in the model")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"not a checkpoint", "not a readable checkpoint"),
        ({"weights": [1, 2]}, "must hold a state_dict"),
        ({"state_dict": {"model.w": torch.zeros(2)}}, "a Lightning checkpoint without 'net.*' tensors"),
        ({"net.1.weight": torch.zeros(16, 64)}, "has no tensor 'net.1.bias' (the model has 4 tensors)"),
    ],
)
def test_bad_checkpoints_are_one_line(tmp_path: Path, content, match: str) -> None:
    path = tmp_path / "pm.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    message = raises_one_line(load_frozen, MLP, path, SHAPE, CLASSES, key=KEY, match=match)
    assert message.startswith(f"{KEY}='{path}': ")


def test_an_extra_tensor_is_named(tmp_path: Path) -> None:
    state = {**_trained().state_dict(), "aux.weight": torch.zeros(1)}
    torch.save(state, tmp_path / "pm.pt")
    raises_one_line(
        load_frozen, MLP, tmp_path / "pm.pt", SHAPE, CLASSES, key=KEY, match="tensor 'aux.weight' is not in"
    )
