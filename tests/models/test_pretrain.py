"""The PM training loop (:mod:`flx.models.pretrain`): ``fit`` separates a separable problem and is a function of the
seeds; ``crop_flip`` moves pixels without changing them; the step and cosine schedules as formulas; every bad
``PretrainParams`` value is one line naming its key; ``save_state_dict`` is atomic and never overwrites unforced."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from helpers import raises_one_line
from torch import nn

from flx.models.pretrain import PretrainParams, accuracy, crop_flip, fit, save_state_dict, schedule

N, SIDE = 65, 8  # 65 rows in batches of 16: the last batch has one row, which BatchNorm cannot take (skipped)


def _problem(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 1, 8, 8)`` of mean -1 (class 0) or +1 (class 1) plus N(0, 0.5^2) noise: the pixel sum separates
    them, and still does after any 4-pixel crop (at least 4x4 of the image stays in the window)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(N) % 2
    return (2.0 * y - 1)[:, None, None, None] + 0.5 * torch.randn(N, 1, SIDE, SIDE, generator=g), y


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(SIDE * SIDE, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _fit(augment: str, gen_seed: int = 0) -> nn.Module:
    x, y = _problem()
    net = _net()
    params = PretrainParams(epochs=6, lr=0.05, batch_size=16, schedule="cosine", augment=augment)
    fit(net, x, y, params, torch.Generator().manual_seed(gen_seed), progress=False)
    return net


@pytest.mark.parametrize("augment", ["none", "crop_flip"])
def test_fit_separates_a_separable_problem(augment: str) -> None:
    x, y = _problem(seed=1)  # fresh rows from the same distribution
    assert accuracy(_fit(augment), x, y, batch_size=32) >= 0.95


@pytest.mark.parametrize("augment", ["none", "crop_flip"])
def test_fit_is_a_function_of_the_seeds(augment: str) -> None:
    """Same initialisation and generator seed: identical weights (BatchNorm statistics included); another generator
    seed (other shuffles and crops): other weights."""
    first, second, other = _fit(augment), _fit(augment), _fit(augment, gen_seed=1)
    for name, tensor in first.state_dict().items():
        assert torch.equal(second.state_dict()[name], tensor), name
    assert not torch.equal(other.state_dict()["1.weight"], first.state_dict()["1.weight"])


def test_fit_without_progress_prints_nothing(capsys: pytest.CaptureFixture) -> None:
    _fit("none")
    assert capsys.readouterr() == ("", "")


def test_step_schedule_multiplies_by_a_tenth_after_each_milestone() -> None:
    """``lr_e = lr * 0.1 ** #{m <= e}``; default milestones ``round(f * epochs)`` for f = 5/8, 3/4, 7/8."""
    assert PretrainParams().step_epochs == (150, 180, 210)
    for params in (PretrainParams(epochs=8, lr=0.5), PretrainParams(epochs=8, lr=0.5, milestones=[2, 2, 6])):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=params.lr)
        sched, lrs = schedule(opt, params), []
        for _ in range(params.epochs):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        expected = [params.lr * 0.1 ** sum(m <= e for m in params.step_epochs) for e in range(params.epochs)]
        assert lrs == pytest.approx(expected, rel=1e-12)


def test_cosine_schedule() -> None:
    """``lr_e = lr * (1 + cos(pi e / T)) / 2`` for epochs ``e < T``."""
    params = PretrainParams(epochs=5, lr=0.2, schedule="cosine")
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=params.lr)
    sched, lrs = schedule(opt, params), []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.2 * (1 + math.cos(math.pi * e / 5)) / 2 for e in range(5)], rel=1e-12)


def test_crop_flip_keeps_shapes_and_moves_pixels_without_changing_them() -> None:
    """Distinct positive pixels: each output image holds distinct values taken from its own input image (zeros are
    padding), so it is a permutation of a window of the padded image; channels move together."""
    x = torch.arange(1, 1 + 5 * 3 * 6 * 7, dtype=torch.float).reshape(5, 3, 6, 7)
    x[:, 1] = 2 * x[:, 0]
    out = crop_flip(x, torch.Generator().manual_seed(0), pad=2)
    assert out.shape == x.shape
    torch.testing.assert_close(out[:, 1], 2 * out[:, 0], rtol=0, atol=0)
    for b in range(5):
        for c in (0, 2):
            kept = out[b, c][out[b, c] != 0]
            assert len(kept.unique()) == len(kept) and torch.isin(kept, x[b, c]).all()


def test_crop_flip_without_padding_is_the_identity_or_a_mirror() -> None:
    """``pad=0``: zero shift, so each image is itself or its horizontal mirror, and a flip-symmetric image is kept."""
    x = torch.randn(32, 2, 4, 5)
    out = crop_flip(x, torch.Generator().manual_seed(0), pad=0)
    flipped = [not torch.equal(o, i) for o, i in zip(out, x)]
    assert 0 < sum(flipped) < len(x)  # both outcomes drawn (probability 1 - 2 ** -31)
    for o, i, f in zip(out, x, flipped):
        torch.testing.assert_close(o, i.flip(-1) if f else i, rtol=0, atol=0)
    symmetric = x + x.flip(-1)
    torch.testing.assert_close(crop_flip(symmetric, torch.Generator().manual_seed(0), pad=0), symmetric, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("epochs", 0, "must be an integer >= 1"),
        ("epochs", 2.0, "must be an integer >= 1"),
        ("batch_size", True, "must be an integer >= 1"),
        ("lr", 0.0, "must be > 0"),
        ("momentum", 1.0, "must be in [0, 1)"),
        ("weight_decay", -1e-4, "must be >= 0"),
        ("schedule", "linear", "allowed: step, cosine"),
        ("milestones", [], "the epochs of the x0.1 steps, integers >= 1"),
        ("milestones", [0, 3], "the epochs of the x0.1 steps, integers >= 1"),
        ("augment", "flip", "allowed: none, crop_flip"),
    ],
)
@pytest.mark.parametrize(("prefix", "cli"), [("algo.pm_pretrain.", False), ("--", True)])
def test_bad_params_are_one_line_naming_the_key(
    field: str, value: object, allowed: str, prefix: str, cli: bool
) -> None:
    """A run names ``algo.pm_pretrain.<field>``; the script names its option, hyphenated (``--batch-size``)."""
    key = prefix + (field.replace("_", "-") if cli else field)
    message = raises_one_line(PretrainParams, **{field: value}, key_prefix=prefix, match=f"{key}={value!r}: ")
    assert message == f"{key}={value!r}: {allowed}"


def test_params_hold_milestones_as_a_tuple_and_compare_without_the_prefix() -> None:
    a = PretrainParams(milestones=[3, 5], key_prefix="--")
    assert (
        a.milestones == (3, 5)
        and a == PretrainParams(milestones=(3, 5))
        and hash(a) == hash(PretrainParams(milestones=(3, 5)))
    )


def _no_hard_links(src: object, dst: object) -> None:
    raise PermissionError(1, "Operation not permitted")


def _state(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("hard_links", [True, False])
def test_save_state_dict_never_overwrites_unless_forced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hard_links: bool
) -> None:
    """A new file (folders made) holds the state_dict; an existing one is refused and left as it was, with no
    temporary file left behind; ``force`` replaces it. Without hard links (some network file systems) the same."""
    if not hard_links:
        monkeypatch.setattr(os, "link", _no_hard_links)
    path = tmp_path / "pm" / "net.pt"
    first, second = _net(0), _net(1)
    save_state_dict(first, path)
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        save_state_dict(second, path)
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == ["net.pt"]
    save_state_dict(second, path, force=True)
    saved = torch.load(path, weights_only=True)
    assert saved.keys() == second.state_dict().keys()
    assert all(torch.equal(saved[k], v) for k, v in _state(second).items())
    assert sorted(p.name for p in path.parent.iterdir()) == ["net.pt"]
