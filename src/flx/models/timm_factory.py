"""Builds timm image models, optionally initialised from local weights (never from the network).

:func:`timm_net` is the Hydra ``_target_`` for any architecture in timm's registry; ``pretrained`` is always
``False`` so timm never downloads anything. Pretrained weights come only from ``pretrained_path``, a local
state-dict file loaded by :func:`load_local_weights`, which drops tensors whose shapes do not fit (usually the
classifier head when ``num_classes`` differs) and fails loudly if any other weight is missing.
"""

from __future__ import annotations

import difflib
import logging
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flx.errors import ConfigError, bad_value
from flx.models.nets import as_shape, check_num_classes

__all__ = ["LoadReport", "head_prefixes", "load_local_weights", "timm_net"]

log = logging.getLogger(__name__)

_PATH_KEY = "model.pretrained_path"
# Keys under which training scripts commonly nest the weights (Lightning, timm, plain torch scripts).
_WRAPPER_KEYS = ("state_dict", "model_state_dict", "model", "module")
# BatchNorm step counters: older or converted checkpoints often omit them and they do not affect outputs.
_OPTIONAL_SUFFIXES = ("num_batches_tracked",)


@dataclass
class LoadReport:
    """What :func:`load_local_weights` did with a checkpoint.

    Attributes:
        path: absolute path of the checkpoint.
        loaded: model keys filled from the checkpoint.
        dropped: checkpoint keys skipped because their shape differs from the model's, as
            ``key -> (checkpoint shape, model shape)``.
        missing: model keys the checkpoint did not fill (on success, only head or optional keys).
        unexpected: checkpoint keys the model does not have.
    """

    path: Path
    loaded: list[str] = field(default_factory=list)
    dropped: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def timm_net(
    *,
    input_shape: Sequence[int],
    num_classes: int,
    name: str = "resnet18",
    pretrained_path: str | Path | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Creates a timm model with a fresh ``num_classes`` head and ``in_chans = input_shape[0]``.

    Args:
        input_shape: per-sample image shape ``(C, H, W)``.
        num_classes: number of output logits.
        name: timm architecture name, e.g. ``"resnet18"`` (see ``timm.list_models()``).
        pretrained_path: optional local ``.pth``/``.pt``/``.bin``/``.safetensors`` state dict to start from.
        **kwargs: extra keyword arguments for ``timm.create_model`` (e.g. ``drop_rate``, ``img_size``).

    Returns:
        A module mapping ``(B, C, H, W)`` to logits ``(B, num_classes)``.

    Raises:
        ConfigError: unknown architecture, non-image input, rejected options, or unusable weights.
    """
    import timm  # imported here so that importing flx.models stays fast

    shape = as_shape(input_shape)
    n_classes = check_num_classes(num_classes)
    if len(shape) != 3:
        raise ConfigError(f"model=timm needs image inputs (C, H, W); got input_shape={shape}")
    if not isinstance(name, str) or not timm.is_model(name):
        raise ConfigError(f"model.name={name!r} is not a timm model{_suggestion(str(name))}")
    if "pretrained" in kwargs:
        raise bad_value("model.pretrained", kwargs["pretrained"], f"downloads are disabled; use {_PATH_KEY}")

    weights = None if pretrained_path is None else _existing_file(pretrained_path)  # fail before building

    options = {k: _to_plain(v) for k, v in kwargs.items()}
    try:
        model = timm.create_model(name, pretrained=False, num_classes=n_classes, in_chans=shape[0], **options)
    except TypeError as err:
        if not options:
            raise
        raise ConfigError(f"model.name={name!r} rejected options {sorted(options)}: {_first_line(err)}") from err
    if weights is not None:
        load_local_weights(model, weights, head=head_prefixes(model))
    return model


def head_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Returns the module names of a model's classifier head(s), e.g. ``("fc",)`` for a timm ResNet.

    Uses timm's ``pretrained_cfg["classifier"]`` when present, else the module returned by
    ``model.get_classifier()``; returns ``()`` when neither is available.
    """
    cfg = getattr(model, "pretrained_cfg", None) or {}
    classifier = cfg.get("classifier") if isinstance(cfg, Mapping) else None
    if isinstance(classifier, str):
        return (classifier,)
    if isinstance(classifier, (list, tuple)):
        return tuple(str(c) for c in classifier)
    get_classifier = getattr(model, "get_classifier", None)
    if callable(get_classifier):
        head = get_classifier()
        return tuple(n for n, m in model.named_modules() if m is head and n)
    return ()


def load_local_weights(model: nn.Module, path: str | Path, head: Sequence[str] = ()) -> LoadReport:
    """Loads a local state dict into ``model`` in place, skipping tensors whose shapes do not fit.

    The file may hold a bare state dict or one nested under a common container key (``state_dict``,
    ``model_state_dict``, ``model``, ``module``); a shared key prefix such as ``net.`` or ``module.`` is
    stripped when the keys do not match the model otherwise. Shape mismatches are dropped and logged as a
    warning. Missing keys are only allowed under the ``head`` module names (and BatchNorm step counters).

    Args:
        model: the module to fill.
        path: ``.pth``/``.pt``/``.bin`` file (read with ``torch.load(weights_only=True)``) or ``.safetensors``.
        head: module names whose parameters may stay freshly initialised, e.g. ``("fc",)``.

    Returns:
        A :class:`LoadReport` listing loaded, dropped, missing and unexpected keys.

    Raises:
        ConfigError: the file is missing or unreadable, or a non-head weight is missing or mismatched.
    """
    report = LoadReport(path=_existing_file(path))
    target = model.state_dict()
    state = _strip_prefix(_read_state_dict(report.path), set(target))

    usable: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key not in target:
            report.unexpected.append(key)
        elif tensor.shape != target[key].shape:
            report.dropped[key] = (tuple(tensor.shape), tuple(target[key].shape))
        else:
            usable[key] = tensor
    report.missing = [k for k in target if k not in usable]
    _log_skipped(report)
    _check_required(report, head)  # before loading, so a failed load leaves the model untouched

    model.load_state_dict(usable, strict=False)
    report.loaded = sorted(usable)
    return report


def _log_skipped(report: LoadReport) -> None:
    """Logs a warning for checkpoint tensors that were dropped (shape mismatch) or ignored (unknown key)."""
    if report.dropped:
        shapes = ", ".join(f"{k} {list(a)}->{list(b)}" for k, (a, b) in report.dropped.items())
        n = len(report.dropped)
        log.warning(
            "%s=%s: dropped %d keys with mismatched shapes (file->model): %s", _PATH_KEY, report.path, n, shapes
        )
    if report.unexpected:
        n = len(report.unexpected)
        log.warning(
            "%s=%s: ignored %d keys the model lacks: %s", _PATH_KEY, report.path, n, _preview(report.unexpected)
        )


def _check_required(report: LoadReport, head: Sequence[str]) -> None:
    """Raises ConfigError if the checkpoint leaves a non-head weight of the model unfilled."""
    required = [k for k in report.missing if not _is_head(k, head) and not k.endswith(_OPTIONAL_SUFFIXES)]
    if not required:
        return
    described = [
        f"{k} {list(report.dropped[k][0])}->{list(report.dropped[k][1])}" if k in report.dropped else k
        for k in required
    ]
    raise ConfigError(
        f"{_PATH_KEY}={str(report.path)!r}: checkpoint does not fit the model, {len(required)} non-head weights "
        f"missing or of another shape (file->model): {_preview(described)}"
    )


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Reads a state dict from ``path`` and unwraps common containers; keeps only tensor entries."""
    try:
        if path.suffix == ".safetensors":
            obj: Any = _load_safetensors(path)
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except Exception as err:  # pickle, zip and safetensors errors have no common base class
        raise ConfigError(f"{_PATH_KEY}={str(path)!r}: cannot read weights ({_first_line(err)})") from err

    for _ in range(len(_WRAPPER_KEYS)):
        inner = next(
            (obj[k] for k in _WRAPPER_KEYS if isinstance(obj, Mapping) and isinstance(obj.get(k), Mapping)), None
        )
        if inner is None:
            break
        obj = inner
    tensors = {str(k): v for k, v in obj.items() if isinstance(v, torch.Tensor)} if isinstance(obj, Mapping) else {}
    if not tensors:
        raise ConfigError(f"{_PATH_KEY}={str(path)!r}: file holds no state dict (a mapping of names to tensors)")
    return tensors


def _existing_file(path: str | Path) -> Path:
    """Returns ``path`` made absolute, or raises ConfigError naming that absolute path if no file is there."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ConfigError(f"{_PATH_KEY}={str(resolved)!r}: no such file")
    return resolved


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Reads a ``.safetensors`` file, or raises ConfigError when the package is not installed."""
    if find_spec("safetensors") is None:
        raise ConfigError(f"{_PATH_KEY}={str(path)!r}: reading .safetensors needs `pip install safetensors`")
    from safetensors.torch import load_file

    return load_file(str(path), device="cpu")


def _strip_prefix(state: dict[str, torch.Tensor], model_keys: set[str]) -> dict[str, torch.Tensor]:
    """Strips a wrapping module name (``net.``, ``module.``, ``_orig_mod.``) when no key matches as is.

    Tries up to three levels, each time keeping the keys under the most common first name; returns ``state``
    unchanged if stripping never produces a match.
    """
    current = state
    for _ in range(3):
        if any(k in model_keys for k in current):
            if current is not state:
                log.info("%s: stripped a key prefix to match the model (%d keys kept)", _PATH_KEY, len(current))
            return current
        firsts = Counter(k.split(".", 1)[0] for k in current if "." in k)
        if not firsts:
            break
        prefix = firsts.most_common(1)[0][0] + "."
        current = {k[len(prefix) :]: v for k, v in current.items() if k.startswith(prefix)}
    return current if any(k in model_keys for k in current) else state


def _is_head(key: str, head: Sequence[str]) -> bool:
    """True if ``key`` is a parameter or buffer of one of the ``head`` modules."""
    return any(key == h or key.startswith(h + ".") for h in head)


def _suggestion(name: str, limit: int = 5) -> str:
    """Returns ``"; did you mean a, b?"`` with up to ``limit`` timm names close to ``name``, or a pointer."""
    import timm

    base = name.split(".", 1)[0].lower()  # drop a pretrained tag such as ".a1_in1k"
    letters = re.match(r"[a-z]+", base)  # e.g. "resnet" for "resnet181"
    pool = timm.list_models(f"*{letters.group(0)}*") if letters else []
    close = difflib.get_close_matches(base, pool or timm.list_models(), n=limit, cutoff=0.5) or pool[:limit]
    if close:
        return f"; did you mean {', '.join(close)}?"
    return "; see timm.list_models() for the allowed names"


def _to_plain(value: Any) -> Any:
    """Converts OmegaConf containers (Hydra passes lists as ``ListConfig``) to plain Python objects."""
    if find_spec("omegaconf") is None:
        return value
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _preview(keys: Sequence[str], limit: int = 5) -> str:
    """Joins the first ``limit`` keys, adding ``...`` when there are more."""
    head = ", ".join(keys[:limit])
    return head + (f", ... (+{len(keys) - limit})" if len(keys) > limit else "")


def _first_line(err: BaseException) -> str:
    """Returns the exception type and the first line of its message, so ConfigErrors stay one line."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
