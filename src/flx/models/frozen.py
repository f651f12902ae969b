"""Frozen models: a net built from a model config and loaded from a local checkpoint, never trained.

The server of AugFL (Yue, Qin, Deng, Ren, Zhang, Zhang, "AugFL: Augmenting Federated Learning with Pretrained
Models", journal extension of MobiHoc 2021) holds a pretrained model :math:`\\theta_p` that only the server step
uses (:math:`G^t = \\nabla_\\theta R_h(\\theta^t, \\theta_p)`, Algorithm 1 line 3.2) and that is never sent to a
client. :func:`load_frozen` gives such a model: built by the same function as the run's global model
(:func:`flx.models.build.net_from_config`), weights from ``checkpoint``, eval mode, no parameter requiring a gradient.
Config: ``server.models.<name>`` (:mod:`flx.resources`).

A checkpoint is either a plain ``state_dict`` (``torch.save(net.state_dict(), path)``) or a Lightning checkpoint of a
flx run (``<run>/checkpoints/*.ckpt``), whose ``state_dict`` holds the global model's tensors as ``net.<name>``. Both
are read with ``weights_only=True``: a checkpoint cannot run code.
"""

from __future__ import annotations

import hashlib
import json
import os
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from flx.errors import bad_value, existing_file
from flx.models.build import net_from_config
from flx.models.pretrain import PretrainParams, fit, save_state_dict

LIGHTNING_PREFIX = "net."
"""Prefix of the global model's tensors in a flx Lightning checkpoint (``FederatedModule.net``)."""


def load_frozen(
    model_cfg: Mapping[str, Any],
    checkpoint: str | Path,
    input_shape: Sequence[int],
    num_classes: int,
    key: str = "checkpoint",
) -> nn.Module:
    """The net of ``model_cfg`` with the weights of ``checkpoint``, in eval mode, every parameter frozen.

    The net stays in eval mode when a parent module calls ``.train()`` (Lightning does so at fit start): BatchNorm
    statistics and dropout of a frozen model never change.

    Args:
        model_cfg: a model config, as ``model=`` (``_target_`` and options; ``binary_head`` is honoured).
        checkpoint: a file holding a ``state_dict`` or a Lightning checkpoint with ``net.``-prefixed weights.
        input_shape: per-sample input shape of the task.
        num_classes: classes of the task.
        key: the config key of ``checkpoint``, named in errors (``server.models.<name>.checkpoint``).

    Raises:
        ConfigError: (one line naming ``key``) no such file, an unreadable file, or tensors that do not fit the net.
    """
    path = str(checkpoint)  # as the config spells it, in errors
    file = existing_file(key, path)
    net = net_from_config(model_cfg, input_shape, num_classes)
    state = read_state_dict(file, key, path)
    check_fits(net, state, key, path)
    net.load_state_dict(state)
    return freeze(net)


def freeze(net: nn.Module) -> nn.Module:
    """``net`` in eval mode for good (a parent's ``.train()`` leaves it in eval mode), no parameter requiring a
    gradient."""
    net.requires_grad_(False)
    net.train = types.MethodType(_eval_only, net)  # this instance only: the class of the net is left alone
    return net.eval()


def cache_fingerprint(
    model_cfg: Mapping[str, Any], x: Tensor, y: Tensor, recipe: Mapping[str, Any], seed: int, num_classes: int
) -> dict[str, Any]:
    """What a net trained by :func:`pretrained_on` depends on, as stored next to its cache file
    (``<cache>.json``): the sha256 of the training rows (``x`` and ``y`` as the store holds them: the data and its
    split), the model config, the recipe, the seed and the classes. Plain JSON types."""
    digest = hashlib.sha256()
    for t in (x, y):
        t = t.detach().cpu().contiguous()
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    plain = json.loads(json.dumps({"model": dict(model_cfg), "recipe": dict(recipe)}, sort_keys=True, default=str))
    return {"data": digest.hexdigest(), **plain, "seed": int(seed), "classes": int(num_classes)}


_MADE_FROM = {"data": "training rows (data, split)", "model": "model config", "recipe": "recipe", "classes": "classes"}


def fingerprint_file(cache: str | Path) -> Path:
    """The file that holds the :func:`cache_fingerprint` of the net cached in ``cache``."""
    return Path(f"{cache}.json")


def check_cache(cache: str | Path | None, fingerprint: Mapping[str, Any], key: str) -> None:
    """Raises one line (naming ``key``) when the net cached in ``cache`` was made from something else than
    ``fingerprint`` describes, or carries no fingerprint; nothing to check when there is no such file yet."""
    if cache is None or not Path(cache).exists():
        return
    try:
        saved = json.loads(fingerprint_file(cache).read_text())
    except (OSError, ValueError):
        why = f"holds a model without a readable fingerprint ({fingerprint_file(cache).name}): cannot tell what made it"
        raise bad_value(key, str(cache), f"{why}; move it away or set {key} to another file") from None
    diff = [k for k in sorted(set(saved) | set(fingerprint)) if saved.get(k) != fingerprint.get(k)]
    if diff:
        why = f"was made from other {' and '.join(_MADE_FROM.get(k, k) for k in diff)} than this run's"
        raise bad_value(key, str(cache), f"{why}; move it away or set {key} to another file")


def pretrained_on(
    model_cfg: Mapping[str, Any],
    x: Tensor,
    y: Tensor,
    recipe: PretrainParams,
    seed: int,
    cache: str | Path | None,
    num_classes: int,
    save: bool = True,
    fingerprint: Mapping[str, Any] | None = None,
) -> nn.Module:
    """A frozen net of ``model_cfg`` trained on ``(x, y)`` (:func:`flx.models.pretrain.fit`, seeded by ``seed``), or
    read from ``cache`` when that file exists; a newly trained net is written there (``save``: rank 0), so a resumed
    run uses the very same model. AugFL's PM when the config gives none: trained on the server rows at the start.
    With ``fingerprint`` (:func:`cache_fingerprint`) it is written to ``<cache>.json`` before the net (a cache file
    always has one); the caller checks an existing cache against it first (:func:`check_cache`)."""
    torch.manual_seed(seed)
    net = net_from_config(model_cfg, x.shape[1:], num_classes).to(device=x.device)
    if x.is_floating_point():
        net = net.to(x.dtype)
    cache = Path(cache) if cache is not None else None
    if cache is not None and cache.exists():
        state = read_state_dict(cache, "cache", str(cache))
        check_fits(net, state, "cache", str(cache))
        net.load_state_dict(state)
        return freeze(net)
    fit(net, x, y, recipe, torch.Generator().manual_seed(seed))
    if save and cache is not None:
        if fingerprint is not None:
            _write_json(fingerprint_file(cache), fingerprint)
        try:
            save_state_dict(net, cache)
        except FileExistsError:  # written meanwhile by another process of the same run: the same model
            pass
    return freeze(net)


def _write_json(path: Path, obj: Mapping[str, Any]) -> None:
    """``obj`` as JSON in ``path``, atomically (a complete temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True, indent=1))
    os.replace(tmp, path)


def _eval_only(self: nn.Module, mode: bool = True) -> nn.Module:
    return nn.Module.train(self, False)


def read_state_dict(file: Path, key: str, path: Any) -> dict[str, Tensor]:
    """The tensors of a plain ``state_dict`` file, or the ``net.*`` tensors of a Lightning checkpoint (unprefixed)."""
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types here (pickle, zip, weights-only refusals): one line for all
        raise bad_value(key, path, f"not a readable checkpoint ({type(e).__name__})") from None
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):  # a Lightning checkpoint
        n = len(LIGHTNING_PREFIX)
        obj = {k[n:]: v for k, v in obj["state_dict"].items() if isinstance(k, str) and k.startswith(LIGHTNING_PREFIX)}
        if not obj:
            raise bad_value(key, path, f"a Lightning checkpoint without '{LIGHTNING_PREFIX}*' tensors (no flx model)")
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, Tensor) for v in obj.values()):
        why = "must hold a state_dict (tensor names -> tensors) or a Lightning checkpoint with a 'state_dict'"
        raise bad_value(key, path, why)
    return dict(obj)


def check_fits(net: nn.Module, state: Mapping[str, Tensor], key: str, path: Any) -> None:
    """Raises a one-line error naming the first tensor of ``net`` (in its order) that ``state`` lacks or shapes
    differently, or else the first tensor of ``state`` that ``net`` does not have."""
    expected = net.state_dict()
    for name, tensor in expected.items():
        if name not in state:
            raise bad_value(key, path, f"has no tensor {name!r} (the model has {len(expected)} tensors)")
        if state[name].shape != tensor.shape:
            got, want = tuple(state[name].shape), tuple(tensor.shape)
            raise bad_value(key, path, f"tensor {name!r} has shape {got} in the checkpoint, {want} in the model")
    extra = [name for name in state if name not in expected]
    if extra:
        raise bad_value(key, path, f"tensor {extra[0]!r} is not in the model ({len(extra)} unexpected tensors)")
