"""Plain-PyTorch training of a classifier on one tensor dataset: AugFL's pretrained model (PM).

AugFL (Yue, Qin, Deng, Ren, Zhang, Zhang, "AugFL: Augmenting Federated Learning with Pretrained Models") gives the
server a PM trained on rows no client sees (Section VI-A). :func:`fit` is the teacher recipe of the authors' released
code (github.com/zerui981105/AugFL): SGD with momentum on the classification loss (:mod:`flx.models.heads`), minibatches
reshuffled each epoch, a per-epoch ``step`` or ``cosine`` schedule, optionally CIFAR's crop and flip
(:func:`crop_flip`); every draw comes from the caller's generator. ``scripts/pretrain_pm.py`` and a run that trains its
own PM share it;
:func:`save_state_dict` writes what :func:`flx.models.frozen.load_frozen` reads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm import tqdm

from flx.errors import bad_value
from flx.models import heads

SCHEDULES = ("step", "cosine")
AUGMENTS = ("none", "crop_flip")
STEP_AT = (5 / 8, 3 / 4, 7 / 8)  # the official recipe's 150, 180, 210 of 240 epochs
_BAR = {"desc": "pretrain_pm", "unit": "step", "dynamic_ncols": True, "mininterval": 1}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_epochs(v: object) -> bool:
    return isinstance(v, Sequence) and len(v) > 0 and all(_is_int(m) and m >= 1 for m in v)


_CHECKS = (  # (field, test, what is allowed), in the order the script checked its options
    ("epochs", lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    ("batch_size", lambda v: _is_int(v) and v >= 1, "must be an integer >= 1"),
    ("lr", lambda v: _is_real(v) and v > 0, "must be > 0"),
    ("momentum", lambda v: _is_real(v) and 0 <= v < 1, "must be in [0, 1)"),
    ("weight_decay", lambda v: _is_real(v) and v >= 0, "must be >= 0"),
    ("schedule", lambda v: v in SCHEDULES, f"allowed: {', '.join(SCHEDULES)}"),
    ("milestones", lambda v: v is None or _is_epochs(v), "the epochs of the x0.1 steps, integers >= 1"),
    ("augment", lambda v: v in AUGMENTS, f"allowed: {', '.join(AUGMENTS)}"),
)


@dataclass(frozen=True)
class PretrainParams:
    """The recipe; defaults are the official teacher's (240 epochs, x0.1 after 150, 180, 210: ``milestones`` None).

    ``key_prefix`` is how errors name a field: ``"algo.pm_pretrain."`` gives ``algo.pm_pretrain.batch_size``, and
    ``"--"`` names command-line options, hyphenated (``--batch-size``).
    """

    epochs: int = 240
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    batch_size: int = 64
    schedule: str = "step"
    milestones: tuple[int, ...] | None = None
    augment: str = "none"
    key_prefix: str = field(default="", compare=False, repr=False)

    def key(self, name: str) -> str:
        """The config key (or option) of field ``name``."""
        return self.key_prefix + (name.replace("_", "-") if self.key_prefix == "--" else name)

    def __post_init__(self) -> None:
        for name, ok, allowed in _CHECKS:
            if not ok(getattr(self, name)):
                raise bad_value(self.key(name), getattr(self, name), allowed)
        if self.milestones is not None:  # a list (argparse) or a ListConfig (a run): a hashable tuple here
            object.__setattr__(self, "milestones", tuple(self.milestones))

    @property
    def step_epochs(self) -> tuple[int, ...]:
        """The epochs after which the ``step`` schedule multiplies the learning rate by 0.1."""
        return self.milestones or tuple(round(f * self.epochs) for f in STEP_AT)


def crop_flip(x: Tensor, gen: torch.Generator, pad: int = 4) -> Tensor:
    """Random ``pad``-pixel-shift crops (zero padding) and horizontal flips, one per image: ``(B, C, H, W)``."""
    b, _, h, w = x.shape
    shift = torch.randint(0, 2 * pad + 1, (2, b, 1), generator=gen).to(x.device)
    flip = (torch.rand(b, generator=gen) < 0.5).to(x.device)
    rows = shift[0] + torch.arange(h, device=x.device)  # (B, H): rows of the padded image
    cols = shift[1] + torch.arange(w, device=x.device)  # (B, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    padded = nn.functional.pad(x, (pad, pad, pad, pad))  # (B, C, H + 2 pad, W + 2 pad)
    batch = torch.arange(b, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


def schedule(opt: torch.optim.Optimizer, params: PretrainParams) -> torch.optim.lr_scheduler.LRScheduler:
    """The per-epoch learning-rate schedule."""
    if params.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=params.epochs)
    return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(params.step_epochs), gamma=0.1)


def fit(
    net: nn.Module, x: Tensor, y: Tensor, params: PretrainParams, generator: torch.Generator, progress: bool = True
) -> None:
    """``params.epochs`` epochs of minibatch SGD on the classification loss of ``(x, y)`` (on ``x``'s device).

    ``generator`` (CPU) draws the shuffles and the augmentation; ``progress`` shows a tqdm bar (stderr).
    """
    p = params
    opt = torch.optim.SGD(net.parameters(), lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
    sched = schedule(opt, p)
    steps = math.ceil(len(y) / p.batch_size)
    net.train()
    with tqdm(total=p.epochs * steps, disable=not progress, **_BAR) as bar:
        for epoch in range(p.epochs):
            total = torch.zeros((), device=x.device)
            for idx in torch.randperm(len(y), generator=generator).to(x.device).split(p.batch_size):
                if len(idx) < 2:  # BatchNorm cannot normalise a single row in train mode
                    continue
                xb = crop_flip(x[idx], generator) if p.augment == "crop_flip" else x[idx]
                loss = heads.classification_loss(net(xb), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += loss.detach() * len(idx)
                bar.update()
            bar.set_postfix(epoch=epoch + 1, loss=f"{total.item() / len(y):.4f}", lr=f"{sched.get_last_lr()[0]:.3g}")
            sched.step()


@torch.no_grad()
def accuracy(net: nn.Module, x: Tensor, y: Tensor, batch_size: int) -> float:
    """Accuracy of ``net`` in eval mode on ``(x, y)``, in batches."""
    net.eval()
    correct = sum(int((heads.predict(net(xb)) == yb).sum()) for xb, yb in zip(x.split(batch_size), y.split(batch_size)))
    return correct / max(len(y), 1)


def save_state_dict(net: nn.Module, path: Path, force: bool = False) -> None:
    """Writes the net's state_dict (CPU tensors) to ``path`` atomically (a complete temporary file, then a name).

    Raises FileExistsError, writing nothing, when ``path`` exists and ``force`` is False.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({k: v.detach().cpu() for k, v in net.state_dict().items()}, tmp)
        if force:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, path: Path) -> None:
    """Gives ``tmp``'s file the name ``path`` unless that exists: a hard link is atomic and never replaces."""
    try:
        os.link(tmp, path)
    except OSError as e:  # on a file system without hard links: check, then rename
        if isinstance(e, FileExistsError) or path.exists():
            raise FileExistsError(f"{path} exists") from None
        os.replace(tmp, path)
