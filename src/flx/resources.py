"""Server-side resources: what the server holds and no client ever sees, the server data split and frozen models.

AugFL (Yue, Qin, Deng, Ren, Zhang, Zhang, "AugFL: Augmenting Federated Learning with Pretrained Models") evaluates
its regulariser gradient on a labelled server set :math:`\\mathcal D_s`, disjoint from every client's data, with a
pretrained model :math:`\\theta_p` (Section V; Algorithm 1, line 3.2):

.. math::

    G^t = \\nabla_\\theta R_h(\\theta^t, \\theta_p) \\text{ on } \\mathcal D_s, \\qquad
    \\theta^{t+1} = \\Big[\\sum_i (y_i^t + \\rho_i \\theta_i^t) - \\lambda G^t\\Big] / \\sum_i \\rho_i.

Both stay on the server. Here, from the config:

- ``data.server_fraction`` -> :attr:`ServerResources.rows`: the server split, row ids into the training store the
  clients index (``FederatedDataModule.server_rows``; carved in :mod:`flx.datamodules.protocol`);
- ``server.models.<name>: {model: <a model config>, checkpoint: <path>}`` -> ``models[name]``: a frozen net
  (:func:`flx.models.frozen.load_frozen`: eval mode, no gradients).

Only ``omegaconf`` at import time: :func:`check_server` runs in the pre-run check (:func:`flx.config.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from flx.errors import bad_value, existing_file

if TYPE_CHECKING:
    from torch import Tensor, nn

SERVER_MODELS = "server.models."
"""Prefix of the frozen models' config keys (read by :func:`build_server_resources`, added with ``+``)."""
ENTRY = "must be {model: <a model config, e.g. ${model}>, checkpoint: <a file>}"


@dataclass(frozen=True, eq=False)  # eq would compare tensors elementwise
class ServerResources:
    """What only the server holds.

    Attributes:
        rows: ``(D_s,)`` int64 row ids of the server split into the training store the clients index
            (``FederatedDataModule.clients.x`` / ``.y``, i.e. ``data.x_train`` / ``data.y_train``); empty with
            ``data.server_fraction=0``. Disjoint from every client's rows and from the validation and test splits.
        models: frozen models by their ``server.models`` name, on the CPU, in eval mode, no parameter requiring a
            gradient. A plain dict, so no ``LightningModule`` registers them as its submodules.
    """

    rows: Tensor
    models: dict[str, nn.Module]


def _entries(cfg: DictConfig) -> dict[str, Any]:
    """The ``server.models`` entries that are set (``null`` switches one off)."""
    models = OmegaConf.select(cfg, "server.models")
    if models is None:
        return {}
    if not OmegaConf.is_dict(models):
        raise bad_value("server.models", models, "must map names to {model: <a model config>, checkpoint: <a file>}")
    return {str(name): entry for name, entry in models.items() if entry is not None}


def check_server(cfg: DictConfig) -> None:
    """Every ``server.models.<name>`` has a model config and an existing checkpoint file; else one line."""
    for name, entry in _entries(cfg).items():
        key = f"server.models.{name}"
        if not OmegaConf.is_dict(entry) or set(entry.keys()) != {"model", "checkpoint"}:
            shown = OmegaConf.to_container(entry) if OmegaConf.is_config(entry) else entry
            raise bad_value(key, shown, ENTRY)
        if not OmegaConf.is_dict(entry.model) or "_target_" not in entry.model:
            raise bad_value(f"{key}.model", entry.model, "must be a model config with a _target_ (e.g. ${model})")
        existing_file(f"{key}.checkpoint", entry.checkpoint)


def build_server_resources(cfg: DictConfig, dm: Any) -> ServerResources:
    """The server split of the set-up datamodule ``dm`` and the frozen models of ``server.models``.

    Args:
        cfg: the run config.
        dm: a :class:`~flx.datamodules.datamodule.FederatedDataModule` after ``setup``.
    """
    from flx.models.frozen import load_frozen

    check_server(cfg)
    shape, classes = dm.data.input_shape, dm.data.num_classes
    models = {
        name: load_frozen(entry.model, entry.checkpoint, shape, classes, key=f"{SERVER_MODELS}{name}.checkpoint")
        for name, entry in _entries(cfg).items()
    }
    return ServerResources(dm.server_rows, models)
