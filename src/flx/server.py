"""Server optimizer: an optimizer step on the pseudo-gradient, so FedAvgM / FedAdam are a config swap.

Reddi et al., "Adaptive Federated Optimization", ICLR 2021 (Algorithm 2).

.. math::
    \\Delta^t = w^t - \\bar w^{t}_{\\text{clients}}, \\qquad w^{t+1} = \\mathrm{Opt}(w^t, \\Delta^t;\\ \\eta_s)

With ``sgd``, ``lr=1``, ``momentum=0`` this is plain FedAvg, done as an exact copy of the client mean
(``w - (w - m)`` is not ``m`` in floating point). ``adam`` gives FedAdam; its ``eps`` is the paper's
adaptivity ``tau`` (1e-3 in the paper's experiments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flx.errors import bad_value


@dataclass(frozen=True)
class ServerOptConfig:
    """Server optimizer parameters (``algo.server.*``)."""

    name: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-3
    weight_decay: float = 0.0


class ServerOptimizer:
    """Applies the server update to the global parameters in place.

    Args:
        params: the global parameter tensors (persistent across rounds; optimizer state is keyed on them).
        cfg: the server optimizer configuration.
    """

    def __init__(self, params: list[Tensor], cfg: ServerOptConfig) -> None:
        self.params, self.cfg = params, cfg
        self.exact_mean = cfg.name == "sgd" and cfg.lr == 1.0 and cfg.momentum == 0.0 and cfg.weight_decay == 0.0
        self.opt = self._build(params, cfg)

    @staticmethod
    def _build(params: list[Tensor], cfg: ServerOptConfig) -> torch.optim.Optimizer | None:
        if cfg.name == "sgd":
            return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        if cfg.name == "adam":
            betas = (float(cfg.betas[0]), float(cfg.betas[1]))
            return torch.optim.Adam(params, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        raise bad_value("algo.server.name", cfg.name, "allowed: sgd, adam")

    @torch.no_grad()
    def step(self, mean: list[Tensor]) -> None:
        """``mean``: the aggregated client models, aligned with ``params``."""
        if self.exact_mean:
            torch._foreach_copy_(self.params, [m.to(p.dtype) for p, m in zip(self.params, mean)])
            return
        for p, m in zip(self.params, mean):
            p.grad = p - m.to(p.dtype)  # pseudo-gradient
        self.opt.step()
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.opt.load_state_dict(state)
