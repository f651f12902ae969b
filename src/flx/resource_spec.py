"""The ``server.*`` config keys of the server-side resources, checked before the run (torch-free).

:mod:`flx.resources` builds what these keys name; :func:`flx.checks.validate` runs :func:`check_server`.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from flx.errors import bad_value, existing_file

SERVER_MODELS = "server.models."
"""Prefix of the frozen models' config keys (read by :func:`build_server_resources`, added with ``+``)."""
ENTRY = "must be {model: <a model config, e.g. ${model}>, checkpoint: <a file>}"


def server_models(cfg: DictConfig) -> dict[str, Any]:
    """The ``server.models`` entries that are set (``null`` switches one off)."""
    models = OmegaConf.select(cfg, "server.models")
    if models is None:
        return {}
    if not OmegaConf.is_dict(models):
        raise bad_value("server.models", models, "must map names to {model: <a model config>, checkpoint: <a file>}")
    return {str(name): entry for name, entry in models.items() if entry is not None}


def check_server(cfg: DictConfig) -> None:
    """Every ``server.models.<name>`` has a model config and an existing checkpoint file; else one line."""
    for name, entry in server_models(cfg).items():
        key = f"server.models.{name}"
        if not OmegaConf.is_dict(entry) or set(entry.keys()) != {"model", "checkpoint"}:
            shown = OmegaConf.to_container(entry) if OmegaConf.is_config(entry) else entry
            raise bad_value(key, shown, ENTRY)
        if not OmegaConf.is_dict(entry.model) or "_target_" not in entry.model:
            raise bad_value(f"{key}.model", entry.model, "must be a model config with a _target_ (e.g. ${model})")
        existing_file(f"{key}.checkpoint", entry.checkpoint)
