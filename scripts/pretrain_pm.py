"""Pretrain AugFL's pretrained model (PM) on the server split, the rows no client sees, and save its state_dict.

    python scripts/pretrain_pm.py data=cifar100 model=resnet32x4 data.server_fraction=0.2 --augment crop_flip \\
        --epochs 240 --out pm/resnet32x4_cifar100.pt
    python train.py data=cifar100 model=resnet8x4 data.server_fraction=0.2 \\
        '+server.models.pm={model: {_target_: flx.models.resnet_cifar.ResNetCIFAR, depth: 32}, checkpoint: pm/...pt}'

AugFL (Yue, Qin, Deng, Ren, Zhang, Zhang, "AugFL: Augmenting Federated Learning with Pretrained Models") gives the
server a PM "trained on 10,000 images ... not overlapping with the client data" (Section VI-A; the paper does not say
whether those are the server's knowledge-transfer rows; ours: they are). The arguments that are not options are Hydra
overrides composed exactly as ``train.py`` composes them (:func:`flx.config.precheck`), and the data are built as a run
builds them (``FederatedDataModule`` with the run's data protocol): ``data=cifar100 data.server_fraction=0.2`` gives the
PM the very rows, scaled the same way (standardised with the client-side rows' statistics), that a run with those keys
keeps on the server. The file is ``torch.save(net.state_dict())`` of the net of ``model=``, read by
``server.models.<name>: {model: <that model config>, checkpoint: <file>}`` (:func:`flx.models.frozen.load_frozen`); the
script prints that entry.

Training is plain PyTorch (:func:`flx.models.pretrain.fit`, which a run that trains its own PM shares): SGD with
momentum on the task's loss (softmax cross-entropy), minibatches shuffled each epoch, ``--schedule step`` (x0.1 at 5/8,
3/4 and 7/8 of the epochs, or ``--milestones``) or ``cosine`` (per epoch), seeded by the config's ``seed``. The defaults
are the teacher recipe of the authors' released code (github.com/zerui981105/AugFL, ``train_teacher_model.py``: SGD, lr
0.05, momentum 0.9, weight decay 5e-4, batch 64, 240 epochs, decay at 150/180/210); its random crop (padding 4) and
horizontal flip are ``--augment crop_flip`` (off by default: flips are wrong for digits and letters). At the end the
PM's accuracy on the test split (eval mode) is printed as ``final test_acc=<value>``.

Refusals, one line on stderr and exit status 2: no server split (``data.server_fraction=0`` and no ``server`` rows in
a ``data.split_file``), an existing ``--out`` without ``--force``, a task that is not classification, any config error
``train.py`` would report.
"""

# ruff: noqa: E402  (flx is imported from this checkout's src/, put on sys.path first)
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from flx.config import precheck
from flx.datamodules.datamodule import FederatedDataModule
from flx.datamodules.protocol import data_protocol
from flx.errors import ConfigError, bad_value
from flx.models.build import net_from_config
from flx.models.pretrain import AUGMENTS, SCHEDULES, PretrainParams, accuracy, fit, save_state_dict
from flx.run import build_datamodule, build_task
from flx.tasks import Classification
from flx.threads import resolve as resolve_threads


@dataclass(frozen=True)
class Result:
    """What a run of the script made: the trained net (eval mode), its test accuracy, the saved file."""

    net: nn.Module
    test_acc: float
    path: Path
    server_rows: int


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (data=..., model=..., ...)")
    parser.add_argument("--out", required=True, type=Path, help="the state_dict file to write")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    parser.add_argument("--epochs", type=int, default=240)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--schedule", choices=SCHEDULES, default="step")
    parser.add_argument("--milestones", type=int, nargs="+", help="epochs of the x0.1 steps (default: 5/8, 3/4, 7/8)")
    parser.add_argument("--augment", choices=AUGMENTS, default="none", help="crop_flip: CIFAR's crop and flip")
    parser.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda, cuda:1, ...")
    return parser.parse_intermixed_args(argv)


def check_options(args: argparse.Namespace) -> PretrainParams:
    """The training options (checked by :class:`PretrainParams`) and the output file, before anything is loaded."""
    params = PretrainParams(
        epochs=args.epochs,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        batch_size=args.batch_size,
        schedule=args.schedule,
        milestones=args.milestones,
        augment=args.augment,
        key_prefix="--",
    )
    if args.out.is_dir():
        raise bad_value("--out", str(args.out), "is a folder; name the file to write")
    if args.out.exists() and not args.force:
        raise bad_value("--out", str(args.out), "exists; pass --force to overwrite it")
    return params


def compose(overrides: list[str]) -> DictConfig:
    """The run config of ``overrides`` (as ``train.py``), refused unless it has a server split to train on."""
    cfg = precheck(overrides)
    if cfg is None:  # only Hydra's own flags (-m, --cfg) make precheck step aside; argparse has taken every option
        raise ConfigError(f"cannot compose {overrides}: Hydra flags are not supported here")
    protocol = data_protocol(cfg)
    if not protocol.split_file and not protocol.server_fraction:
        why = "no server split to pretrain on (the PM must not see client rows); set it in (0, 1), e.g. 0.2"
        raise bad_value("data.server_fraction", protocol.server_fraction, why)
    return cfg


def server_data(cfg: DictConfig) -> tuple[FederatedDataModule, Tensor]:
    """The run's datamodule (set up as :func:`flx.run.build` sets it up) and its server rows ``(D_s,)``."""
    dm = build_datamodule(cfg)
    if not len(dm.server_rows):
        raise bad_value(
            "data.split_file", cfg.data.get("split_file"), "lists no 'server' rows: no server split to pretrain on"
        )
    return dm, dm.server_rows


def build_net(cfg: DictConfig, dm: FederatedDataModule) -> nn.Module:
    """The net of ``model=`` for the data, as a run builds it (``task=classification`` only)."""
    if not isinstance(build_task(cfg, dm.data), Classification):
        raise bad_value("task._target_", cfg.task.get("_target_"), "the PM script trains classifiers only")
    return net_from_config(cfg.model, dm.data.input_shape, dm.data.num_classes)


def save(net: nn.Module, out: Path, force: bool) -> None:
    """Writes the net's state_dict atomically; never replaces a file that appeared meanwhile."""
    try:
        save_state_dict(net, out, force)
    except FileExistsError:
        raise bad_value("--out", str(out), "appeared while training; pass --force to overwrite it") from None


def entry(model: DictConfig, out: Path) -> str:
    """The ``+server.models.pm=...`` override that loads the file with this model config."""

    def flow(v: Any) -> str:  # YAML flow style, which Hydra's override grammar reads
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {flow(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(flow(x) for x in v) + "]"
        if v is None or isinstance(v, bool):
            return json.dumps(v)
        return str(v) if re.fullmatch(r"[\w./:+-]+", str(v)) else json.dumps(str(v))

    model_cfg = OmegaConf.to_container(model, resolve=True)
    return f"+server.models.pm='{flow({'model': model_cfg, 'checkpoint': str(out.resolve())})}'"


def device_of(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise bad_value("--device", name, "expected auto, cpu, cuda or cuda:<index>") from None


def pretrain(args: argparse.Namespace) -> Result:
    """Composes the config, trains the PM on the server rows, saves it and measures it on the test split."""
    params = check_options(args)
    device = device_of(args.device)
    cfg = compose(args.overrides)
    threads = resolve_threads(cfg.get("num_threads"), cfg.trainer)  # auto: this process's cores
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)  # the net's initialisation, as a run seeds it
    gen = torch.Generator().manual_seed(cfg.seed)  # shuffles and augmentation
    dm, rows = server_data(cfg)
    net = build_net(cfg, dm).to(device)
    x, y = dm.data.x_train[rows].to(device), dm.data.y_train[rows].to(device)
    fit(net, x, y, params, gen)
    acc = accuracy(net, dm.data.x_test.to(device), dm.data.y_test.to(device), cfg.data.eval_batch_size)
    save(net, args.out, args.force)
    print(f"saved {args.out} (trained on {len(rows)} server rows); load it in a run with", flush=True)
    print(f"  {entry(cfg.model, args.out)}", flush=True)
    print(f"final test_acc={acc:.4f}", flush=True)
    return Result(net.cpu().eval(), acc, args.out, len(rows))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        pretrain(args)
    except ConfigError as err:
        print(f"pretrain_pm: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
