"""The torch-free file locators that the loaders and the pre-run check share (flx.datamodules.files)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import raises_one_line

from flx.datamodules import files

BUNDLED = {"digits", "breast_cancer", "diabetes"}  # inside scikit-learn: no files to find


def test_every_loader_with_files_has_a_locator() -> None:
    assert {name for name, d in files.DATASETS.items() if d.locate is not None} == set(files.DATASETS) - BUNDLED


def test_locate_unwraps_binarize_and_names_the_missing_files(tmp_path: Path) -> None:
    """A binary CIFAR-10 config is checked through its source; present files pass, missing ones are named."""
    loader = {"_target_": "flx.datamodules.binary.binarize", "source": {"_target_": "flx.datamodules.datasets.cifar10"}}
    loader["source"]["root"] = str(tmp_path)
    raises_one_line(files.locate, loader, match="data=cifar10: CIFAR-10 not found")
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in (*files.CIFAR10_TRAIN, "test_batch"):
        (folder / name).write_bytes(b"")
    files.locate(loader)
    (folder / "data_batch_3").unlink()
    message = raises_one_line(files.locate, loader, match="missing data_batch_3")
    assert "data_batch_1" not in message.split("missing")[1]


def test_options_that_choose_the_files_are_checked_first(tmp_path: Path) -> None:
    raises_one_line(files.emnist, str(tmp_path), "nope", match="data.loader.split='nope'")
    raises_one_line(files.medmnist, str(tmp_path), "nope", match="data.loader.name='nope'")
    raises_one_line(files.cifar100, str(tmp_path), "medium", match="data.loader.label='medium'")
    files.locate({"_target_": "flx.datamodules.datasets.digits"})  # bundled: nothing to find


def test_the_module_imports_neither_torch_nor_numpy() -> None:
    code = "import sys, flx.config, flx.datamodules.files; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
