"""Penultimate features (:mod:`flx.models.features`): ``forward == head(penultimate)`` for every native family, the
timm path equals timm's own ``pre_logits`` output, MLP / CNN keep their state_dict keys, ``feature_dim`` changes no
state, and a net without features is a one-line error."""

from __future__ import annotations

import pytest
import torch
from helpers import raises_one_line
from torch import nn

from flx.models.features import feature_dim, penultimate
from flx.models.nets import CNN, MLP, LogisticRegression
from flx.models.resnet_cifar import ResNetCIFAR

SHAPE = (1, 8, 8)
NATIVE = {  # name -> (net, D)
    "resnet_cifar": (lambda: ResNetCIFAR(input_shape=SHAPE, num_classes=5, widths=(4, 8, 8, 16)), 16),
    "mlp": (lambda: MLP(input_shape=SHAPE, num_classes=5, hidden=(16, 12), dropout=0.5), 12),
    "mlp_no_hidden": (lambda: MLP(input_shape=SHAPE, num_classes=5, hidden=()), 64),
    "cnn": (lambda: CNN(input_shape=SHAPE, num_classes=5, channels=(4, 8), hidden=24), 24),
}


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_forward_is_head_of_penultimate(name: str) -> None:
    """In eval mode (dropout off, BatchNorm running statistics): exactly the same logits."""
    torch.manual_seed(0)
    make, dim = NATIVE[name]
    net = make().eval()
    x = torch.randn(6, *SHAPE)
    feats = penultimate(net, x)
    assert feats.shape == (6, dim) and feature_dim(net, SHAPE) == dim
    assert isinstance(net.head, nn.Linear) and net.head.in_features == dim
    torch.testing.assert_close(net.head(feats), net(x), rtol=0, atol=0)


def test_penultimate_backpropagates_in_train_mode() -> None:
    """A regulariser on the features (AugFL's CRD) trains the body: every parameter but the head's gets a gradient."""
    torch.manual_seed(0)
    net = ResNetCIFAR(input_shape=SHAPE, num_classes=5, widths=(4, 8, 8, 16)).train()
    penultimate(net, torch.randn(4, *SHAPE)).square().sum().backward()
    body = [(n, p) for n, p in net.named_parameters() if not n.startswith("head.")]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in body), [n for n, p in body if p.grad is None]
    assert net.head.weight.grad is None


def test_mlp_and_cnn_keep_their_state_dict_keys() -> None:
    """``head`` is a property and ``feat_dim`` a plain int: no new key, so existing checkpoints still load."""
    mlp = MLP(input_shape=SHAPE, num_classes=5, hidden=(16,), dropout=0.5)
    assert list(mlp.state_dict()) == ["net.1.weight", "net.1.bias", "net.4.weight", "net.4.bias"]
    assert mlp.head is mlp.net[-1]
    cnn = CNN(input_shape=SHAPE, num_classes=5, channels=(4,), hidden=8)
    keys = ["features.0.weight", "features.0.bias", "classifier.1.weight", "classifier.1.bias"]
    assert list(cnn.state_dict()) == [*keys, "classifier.3.weight", "classifier.3.bias"]
    assert cnn.head is cnn.classifier[-1] and isinstance(cnn.features, nn.Sequential)


def test_timm_penultimate_is_timms_pre_logits() -> None:
    timm = pytest.importorskip("timm", reason="timm is not installed: the timm path of penultimate is untested")
    from flx.models.timm_factory import timm_net

    torch.manual_seed(0)
    net = timm_net(input_shape=(3, 16, 16), num_classes=5, name="test_resnet").eval()
    assert isinstance(net, timm.models.ResNet)
    x = torch.randn(3, 3, 16, 16)
    expected = net.forward_head(net.forward_features(x), pre_logits=True)
    feats = penultimate(net, x)
    torch.testing.assert_close(feats, expected, rtol=0, atol=0)
    assert feats.shape == (3, net.num_features) and feature_dim(net, (3, 16, 16)) == net.num_features
    torch.testing.assert_close(net.get_classifier()(feats), net(x), rtol=0, atol=0)


def test_feature_dim_probe_changes_no_state() -> None:
    """A net without ``feat_dim`` is measured in eval mode without gradients: BatchNorm statistics and every
    submodule's mode are as before."""
    pytest.importorskip("timm", reason="timm is not installed: the probe of feature_dim is untested")
    from flx.models.timm_factory import timm_net

    net = timm_net(input_shape=(3, 16, 16), num_classes=5, name="test_resnet").train()
    net.fc.eval()  # a mixed-mode net: each submodule's mode must come back as it was
    before = {k: v.clone() for k, v in net.state_dict().items()}
    modes = [m.training for m in net.modules()]
    assert feature_dim(net, (3, 16, 16)) == net.num_features
    assert [m.training for m in net.modules()] == modes
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


@pytest.mark.parametrize(
    "net", [nn.Sequential(nn.Flatten(), nn.Linear(64, 5)), LogisticRegression(input_shape=SHAPE, num_classes=5)]
)
def test_a_net_without_features_is_a_one_line_error(net: nn.Module) -> None:
    name = f"{type(net).__module__}.{type(net).__qualname__}"
    raises_one_line(penultimate, net, torch.randn(2, *SHAPE), match=f"model='{name}': has no penultimate features")
    raises_one_line(feature_dim, net, SHAPE, match="has no penultimate features")
