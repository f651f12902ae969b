"""``scripts/pretrain_pm.py``: a short run on the embedded digits trains on the server rows, beats chance on the test
split and writes a state_dict that ``load_frozen`` (directly, and through the ``server.models`` entry it prints, in a
run) turns into the same function; it is seeded; it refuses without a server split and never overwrites a file
without ``--force``."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flx.config import precheck
from flx.models.frozen import load_frozen
from flx.models.pretrain import crop_flip

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pretrain_pm.py"
_spec = importlib.util.spec_from_file_location("pretrain_pm", SCRIPT)
pm = sys.modules["pretrain_pm"] = importlib.util.module_from_spec(_spec)  # registered first: its dataclass looks
_spec.loader.exec_module(pm)  # itself up in sys.modules

SHAPE, CLASSES = (1, 8, 8), 10
DATA = ["data=digits", "data.server_fraction=0.5"]
RESNET = ["model=resnet8x4", "model.widths=[8,8,16,16]"]  # the CIFAR ResNet's structure (BatchNorm), narrow
FAST = ["--epochs", "2", "--lr", "0.1", "--batch-size", "32", "--schedule", "cosine"]
QUIET = ["logger=none", "callbacks.progress_bar=null", "trainer.enable_progress_bar=false", "checkpoint=null"]


def _pretrain(*argv: str) -> tuple[object, list[str]]:
    """Runs the script in-process; returns its Result and its stdout lines."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = pm.pretrain(pm.parse(list(argv)))
    return result, out.getvalue().splitlines()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, list[str]]:
    out = tmp_path_factory.mktemp("pm") / "pm.pt"
    return _pretrain(*DATA, *RESNET, *FAST, "--out", str(out))


def test_two_epochs_beat_chance_and_load_frozen_gives_the_trained_net(trained) -> None:
    """Eval mode on both sides (BatchNorm running statistics saved with the weights): identical logits."""
    result, lines = trained
    assert lines[-1] == f"final test_acc={result.test_acc:.4f}"
    assert result.test_acc > 3 / CLASSES  # chance is 1 / CLASSES
    cfg = precheck([*DATA, *RESNET])
    frozen = load_frozen(cfg.model, result.path, SHAPE, CLASSES)
    x = torch.randn(16, *SHAPE)
    torch.testing.assert_close(frozen(x), result.net.eval()(x), rtol=0, atol=0)
    assert result.server_rows == 648  # digits: 1437 training rows, 10% validation, then half of the rest per class


@pytest.mark.slow
def test_the_printed_entry_loads_the_pm_in_a_run_on_the_same_server_rows(trained, tmp_path: Path) -> None:
    """A run with a different global model and the printed ``+server.models.pm=...``: the server holds the PM, equal
    output for output, and the run's server split has the rows the PM was trained on."""
    from flx.run import build

    result, lines = trained
    override = lines[1].strip()
    assert override.startswith("+server.models.pm='") and override.endswith("'")
    run = precheck([*DATA, "model=mlp", override.replace("'", ""), f"paths.output_dir={tmp_path}", *QUIET])
    dm, _, _ = build(run)
    frozen = dm.server_resources.models["pm"]
    x = dm.data.x_train[dm.server_rows]
    assert len(x) == result.server_rows
    torch.testing.assert_close(frozen(x), result.net.eval()(x), rtol=0, atol=0)


def test_refuses_without_a_server_split(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "pm.pt"
    assert pm.main(["data=digits", "model=mlp", "--epochs", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("pretrain_pm: error: data.server_fraction=0.0: no server split"), err
    assert not out.exists()


def test_never_overwrites_without_force_and_is_seeded(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A second run refuses and leaves the file as it was; with --force it replaces the file (a new inode), with
    the same tensors: same config seed, same PM."""
    out = tmp_path / "pm.pt"
    argv = [*DATA, "model=mlp", "model.hidden=[16]", "--epochs", "1", "--out", str(out)]
    first, _ = _pretrain(*argv)
    before, inode = out.read_bytes(), out.stat().st_ino
    capsys.readouterr()  # the first run's progress bar
    assert pm.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"pretrain_pm: error: --out='{out}': exists; pass --force to overwrite it"
    assert out.read_bytes() == before
    second, _ = _pretrain(*argv, "--force")
    assert out.stat().st_ino != inode
    saved = torch.load(out, weights_only=True)
    for name, tensor in first.net.state_dict().items():
        assert torch.equal(saved[name], tensor), name
    assert second.test_acc == first.test_acc


def test_crop_flip_is_a_shifted_window_of_the_padded_image_then_a_flip() -> None:
    """Image b: rows dy..dy+H-1 and columns dx..dx+W-1 of the zero-padded image, mirrored when its flip is drawn;
    the draws are the generator's, in the function's order (shifts (2, B, 1), then flips (B,))."""
    x = torch.randn(6, 2, 5, 7)
    out = crop_flip(x, torch.Generator().manual_seed(3), pad=2)
    g = torch.Generator().manual_seed(3)
    shift, flip = torch.randint(0, 5, (2, 6, 1), generator=g), torch.rand(6, generator=g) < 0.5
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for b in range(6):
        dy, dx = int(shift[0, b]), int(shift[1, b])
        window = padded[b, :, dy : dy + 5, dx : dx + 7]
        torch.testing.assert_close(out[b], window.flip(-1) if flip[b] else window, rtol=0, atol=0)


@pytest.mark.slow
def test_the_command_line_refusal_is_one_line_with_status_2(tmp_path: Path) -> None:
    out = tmp_path / "pm.pt"
    cmd = [sys.executable, str(SCRIPT), "data=digits", "data.server_fraction=0", "--out", str(out)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("pretrain_pm: error: data.server_fraction=0: no server split"), lines[0]
    assert not out.exists()
