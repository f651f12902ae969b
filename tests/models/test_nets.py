"""Tests for the network registry, the small FL nets and the timm factory (with local pretrained weights)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from flx.errors import ConfigError
from flx.models.nets import CNN, MLP, LogisticRegression
from flx.models.registry import NETS, build_net
from flx.models.timm_factory import load_local_weights, timm_net

# One small case per registry entry: (input_shape, options). Registering a net without a case fails the test.
CASES: dict[str, tuple[tuple[int, ...], dict]] = {
    "linear": ((4, 4), {"bias": False}),
    "logreg": ((30,), {}),
    "mlp": ((1, 8, 8), {"hidden": (16, 8), "dropout": 0.1}),
    "cnn": ((3, 32, 32), {"channels": (4, 8), "hidden": 16}),
    "resnet_cifar": ((3, 16, 16), {"depth": 8, "widths": (4, 8, 8, 16)}),
    "cnn_scalable": ((1, 8, 8), {"widths": (4, 8, 8, 8)}),
    "resnet18_scalable": ((3, 8, 8), {"widths": (4, 8, 8, 8)}),
    # zero_init_last=False: timm zeroes the last BN scale per block by default, which zeroes some gradients at init
    "timm": ((1, 32, 32), {"name": "resnet18", "zero_init_last": False}),
}
NUM_CLASSES = 5


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Runs these tiny models on one CPU thread: on small VMs, intra-op threading makes them ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _conv_params(c_in: int, c_out: int, k: int = 5) -> int:
    return c_in * c_out * k * k + c_out


def _linear_params(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(NETS))
def test_registry_entry_maps_batch_to_logits_and_backprops(name: str) -> None:
    assert name in CASES, f"add a test case for registered net {name!r} to CASES"
    shape, options = CASES[name]
    torch.manual_seed(0)
    model = build_net(name, input_shape=shape, num_classes=NUM_CLASSES, **options)
    x = torch.randn(4, *shape)  # (B, *input_shape)

    logits = model(x)
    assert logits.shape == (4, NUM_CLASSES)

    nn.functional.cross_entropy(logits, torch.arange(4) % NUM_CLASSES).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, f"{name}: zero/bad gradient for {pname}"


def test_logistic_regression_is_affine_map_of_flattened_input() -> None:
    model = LogisticRegression(input_shape=(2, 3, 3), num_classes=4)
    x = torch.randn(6, 2, 3, 3)
    expected = x.flatten(1) @ model.linear.weight.T + model.linear.bias  # (6, 18) @ (18, 4) + (4,)
    torch.testing.assert_close(model(x), expected)
    assert _n_params(model) == _linear_params(18, 4)


@pytest.mark.parametrize(("hidden", "dropout"), [((200, 200), 0.0), ((64,), 0.5), ((), 0.0)])
def test_mlp_parameter_count_matches_formula(hidden: tuple[int, ...], dropout: float) -> None:
    model = MLP(input_shape=[1, 28, 28], num_classes=10, hidden=list(hidden), dropout=dropout)
    widths = [28 * 28, *hidden, 10]
    assert _n_params(model) == sum(_linear_params(a, b) for a, b in itertools.pairwise(widths))
    n_dropout = sum(isinstance(m, nn.Dropout) for m in model.modules())
    assert n_dropout == (len(hidden) if dropout > 0 else 0)
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_mlp_batch_norm_sits_between_each_hidden_linear_and_its_relu() -> None:
    """``batch_norm=True``: ``Linear, BatchNorm1d, ReLU`` per hidden layer (2 x width more parameters each, and the
    running statistics as float buffers); in eval mode a fresh BatchNorm (mean 0, variance 1) is the identity up to
    its epsilon, and ``head`` is still the last Linear. ``model.batch_norm`` must be a boolean."""
    torch.manual_seed(0)
    bn = MLP(input_shape=(6,), num_classes=3, hidden=[5, 4], batch_norm=True).eval()
    torch.manual_seed(0)
    plain = MLP(input_shape=(6,), num_classes=3, hidden=[5, 4]).eval()
    kinds = [type(m).__name__ for m in bn.net]
    assert kinds == ["Flatten", "Linear", "BatchNorm1d", "ReLU", "Linear", "BatchNorm1d", "ReLU", "Linear"]
    assert _n_params(bn) == _n_params(plain) + 2 * (5 + 4) and bn.head is bn.net[-1]
    assert sum(b.is_floating_point() for b in bn.buffers()) == 4
    with torch.no_grad():
        for a, b in zip(
            [m for m in bn.net if isinstance(m, nn.Linear)], [m for m in plain.net if isinstance(m, nn.Linear)]
        ):
            a.load_state_dict(b.state_dict())
    x = torch.randn(7, 6)
    torch.testing.assert_close(bn(x), plain(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match=r"^model.batch_norm='yes'"):
        MLP(input_shape=(6,), num_classes=3, batch_norm="yes")


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_cnn_matches_fedavg_formula(shape: tuple[int, int, int]) -> None:
    c, h, w = shape
    flat = 64 * (h // 4) * (w // 4)  # two 2x2 max-pools; 5x5 convs with padding 2 keep the size
    expected = _conv_params(c, 32) + _conv_params(32, 64) + _linear_params(flat, 512) + _linear_params(512, 10)
    model = CNN(input_shape=shape, num_classes=10)
    assert model.flatten_size == flat
    assert _n_params(model) == expected
    if shape == (1, 28, 28):
        assert expected == 1_663_370  # the FedAvg MNIST CNN size reported by McMahan et al. (2017)


@pytest.mark.parametrize("side", [8, 28, 32, 64])
def test_cnn_forward_for_common_image_sizes(side: int) -> None:
    model = CNN(input_shape=(3, side, side), num_classes=7, channels=(4, 8), hidden=16)
    assert model.flatten_size == 8 * (side // 4) ** 2
    assert model(torch.randn(2, 3, side, side)).shape == (2, 7)


def test_timm_resnet18_single_channel() -> None:
    model = timm_net(input_shape=(1, 32, 32), num_classes=3, name="resnet18")
    assert model.conv1.in_channels == 1 and model.fc.out_features == 3
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 3)


def test_hydra_instantiate_with_listconfig_shape() -> None:
    hydra_utils = pytest.importorskip("hydra.utils")
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"_target_": "flx.models.nets.CNN", "channels": [4, 8], "hidden": 16})
    model = hydra_utils.instantiate(cfg, input_shape=OmegaConf.create([1, 28, 28]), num_classes=10)
    assert model.input_shape == (1, 28, 28)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


# ---------------------------------------------------------------------------------------------- pretrained_path


@pytest.fixture(scope="module")
def saved_resnet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A resnet18 state dict made with num_classes=7, saved as a bare .pth file."""
    torch.manual_seed(1)
    state = timm_net(input_shape=(3, 32, 32), num_classes=7, name="resnet18").state_dict()
    path = tmp_path_factory.mktemp("weights") / "resnet18_7.pth"
    torch.save(state, path)
    return path, state


def _assert_body_equal(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Every non-head tensor of ``model`` equals the saved one; the head keeps its own shape."""
    current = model.state_dict()
    body = [k for k in saved if not k.startswith("fc.")]
    assert len(body) > 100
    for key in body:
        torch.testing.assert_close(current[key], saved[key], rtol=0, atol=0, msg=key)
    assert current["fc.weight"].shape == (3, 512)


def test_pretrained_path_loads_body_and_drops_head(saved_resnet, caplog: pytest.LogCaptureFixture) -> None:
    path, saved = saved_resnet
    with caplog.at_level(logging.WARNING, logger="flx.models.timm_factory"):
        model = timm_net(input_shape=(3, 32, 32), num_classes=3, name="resnet18", pretrained_path=str(path))
    _assert_body_equal(model, saved)
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "fc.weight" in warning and "fc.bias" in warning and "layer1" not in warning


def test_load_report_lists_dropped_head(saved_resnet) -> None:
    path, saved = saved_resnet
    model = timm_net(input_shape=(3, 32, 32), num_classes=3, name="resnet18")
    report = load_local_weights(model, path, head=("fc",))
    assert set(report.dropped) == {"fc.weight", "fc.bias"}
    assert report.dropped["fc.weight"] == ((7, 512), (3, 512))
    assert set(report.missing) == {"fc.weight", "fc.bias"} and not report.unexpected
    assert len(report.loaded) == len(saved) - 2


def test_pretrained_path_unwraps_containers_and_prefixes(saved_resnet, tmp_path: Path) -> None:
    _, saved = saved_resnet
    wrapped = tmp_path / "lightning.ckpt.pt"
    # Lightning-style checkpoint: weights under "state_dict", prefixed by the system's attribute name.
    torch.save({"epoch": 3, "state_dict": {f"net.{k}": v for k, v in saved.items()}}, wrapped)
    model = timm_net(input_shape=(3, 32, 32), num_classes=3, name="resnet18", pretrained_path=wrapped)
    _assert_body_equal(model, saved)


def test_pretrained_path_plain_state_dict_wrapper(saved_resnet, tmp_path: Path) -> None:
    _, saved = saved_resnet
    wrapped = tmp_path / "wrapped.pth"
    torch.save({"state_dict": saved}, wrapped)
    model = timm_net(input_shape=(3, 32, 32), num_classes=3, name="resnet18")
    report = load_local_weights(model, wrapped, head=("fc",))
    assert set(report.dropped) == {"fc.weight", "fc.bias"}
    _assert_body_equal(model, saved)


def test_pretrained_path_safetensors(saved_resnet, tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    _, saved = saved_resnet
    path = tmp_path / "w.safetensors"
    st.save_file({k: v.contiguous() for k, v in saved.items()}, str(path))
    model = timm_net(input_shape=(3, 32, 32), num_classes=3, name="resnet18")
    load_local_weights(model, path, head=("fc",))
    _assert_body_equal(model, saved)


def test_pretrained_path_missing_body_weight_is_config_error(saved_resnet, tmp_path: Path) -> None:
    _, saved = saved_resnet
    path = tmp_path / "partial.pth"
    torch.save({k: v for k, v in saved.items() if k != "layer1.0.conv1.weight"}, path)
    model = timm_net(input_shape=(3, 32, 32), num_classes=3, name="resnet18")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=r"model\.pretrained_path=.*partial\.pth.*layer1\.0\.conv1\.weight"):
        load_local_weights(model, path, head=("fc",))
    for key, value in model.state_dict().items():  # a failed load leaves the model untouched
        assert torch.equal(value, before[key]), key


# ------------------------------------------------------------------------------------------------- user errors


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (
            lambda: timm_net(input_shape=(3, 32, 32), num_classes=2, pretrained_path="no/such.pth"),
            "model.pretrained_path",
        ),
        (lambda: timm_net(input_shape=(3, 32, 32), num_classes=2, name="resnet181"), "model.name='resnet181'"),
        (lambda: CNN(input_shape=(30,), num_classes=2), "model=cnn"),
        (lambda: build_net("no_such_net", input_shape=(30,), num_classes=2), "model.name='no_such_net'"),
        (lambda: build_net("mlp", input_shape=(30,), num_classes=2, hiden=(8,)), "model.hiden"),
        (lambda: MLP(input_shape=(30,), num_classes=2, dropout=1.0), "model.dropout"),
        (lambda: LogisticRegression(input_shape=(30,), num_classes=0), "num_classes"),
    ],
    ids=["missing-file", "unknown-timm", "cnn-tabular", "unknown-net", "unknown-option", "bad-dropout", "no-classes"],
)
def test_user_errors_are_one_line_config_errors(build, pattern: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    message = str(info.value)
    assert pattern in message and "\n" not in message


def test_missing_file_message_has_absolute_path() -> None:
    with pytest.raises(ConfigError, match="model.pretrained_path") as info:
        timm_net(input_shape=(3, 32, 32), num_classes=2, pretrained_path="no/such.pth")
    assert str(Path("no/such.pth").resolve()) in str(info.value)


def test_unknown_timm_name_suggests_close_names() -> None:
    with pytest.raises(ConfigError, match="resnet18") as info:
        timm_net(input_shape=(3, 32, 32), num_classes=2, name="resnet181")
    suggestions = str(info.value).split("did you mean ", 1)[1].rstrip("?").split(", ")
    assert "resnet18" in suggestions and len(suggestions) <= 5
