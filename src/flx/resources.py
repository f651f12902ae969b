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

The config checks are in :mod:`flx.resource_spec` (torch-free, run by the pre-run check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from flx.resource_spec import SERVER_MODELS, check_server, server_models

if TYPE_CHECKING:
    from torch import Tensor, nn


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
        for name, entry in server_models(cfg).items()
    }
    return ServerResources(dm.server_rows, models)
