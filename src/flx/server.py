"""Server optimizer: an optimizer step on the pseudo-gradient, so FedAvgM / FedAdam / FedAdagrad / FedYogi are a
config swap.

Reddi, Charles, Zaheer, Garrett, Rush, Konecny, Kumar, McMahan, "Adaptive Federated Optimization", ICLR 2021
(arXiv:2003.00295), Algorithm 2 (FedAdagrad, FedYogi, FedAdam); Hsu, Qi, Brown, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification", 2019 (arXiv:1909.06335; FedAvgM).

.. math::
    \\Delta_t = \\bar w_t^{\\text{clients}} - w_t \\quad\\text{(the paper's sign: the mean client update)}

    \\text{sgd:}\\quad v_t = \\beta v_{t-1} + \\Delta_t,\\qquad w_{t+1} = w_t + \\eta_s v_t

    \\text{adam:}\\quad m_t = \\beta_1 m_{t-1} + (1-\\beta_1)\\Delta_t,\\quad
    v_t = \\beta_2 v_{t-1} + (1-\\beta_2)\\Delta_t^2,\\quad
    w_{t+1} = w_t + \\eta_s \\frac{m_t}{\\sqrt{v_t} + \\tau}

    \\text{adagrad:}\\quad v_t = v_{t-1} + \\Delta_t^2,\\qquad
    \\text{yogi:}\\quad v_t = v_{t-1} - (1-\\beta_2)\\Delta_t^2 \\operatorname{sign}(v_{t-1} - \\Delta_t^2)

with ``m_t`` and the step as for adam. As in the paper, the adaptive steps have no bias correction (unlike
``torch.optim.Adam``); ``eps`` is ``tau``. Algorithm 2 starts from ``m_{-1} = 0`` and ``v_{-1} >= tau^2``:
``initial_accumulator`` is ``v_{-1}``, by default (None) ``tau^2`` for adagrad and yogi and 0 for adam (flx's FedAdam
has started from 0 since its first version; set ``initial_accumulator`` to ``eps**2`` for the paper's).
With ``sgd``, ``lr=1``, ``momentum=0`` the step is plain FedAvg, done as an exact copy of the client mean
(``w + (m - w)`` is not ``m`` in floating point). ``weight_decay`` adds ``-wd * w`` to ``Delta``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class ServerOptConfig:
    """Server optimizer parameters (``algo.server.*``): ``eta_s`` = lr, ``beta`` = momentum, ``tau`` = eps."""

    name: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-3
    weight_decay: float = 0.0
    initial_accumulator: float | None = None  # v_{-1} of the adaptive steps; None: tau^2 (adagrad, yogi), 0 (adam)

    def initial_v(self) -> float:
        """The adaptive steps' ``v_{-1}``: ``initial_accumulator``, or its default for ``name``."""
        if self.initial_accumulator is not None:
            return float(self.initial_accumulator)
        return 0.0 if self.name == "adam" else self.eps**2


@dataclass(frozen=True)
class StepMoves:
    """What one server step measured, as tensors read on the host only when a divergence is reported: ``server`` =
    ``||w_{t+1} - w_t||``, ``clients`` = ``||Delta_t||`` (the mean update), ``adaptive`` = ``eta_s ||m_t||`` (the
    adaptive steps: FedAdam, FedAdagrad, FedYogi; None for SGD)."""

    server: Tensor | float = 1.0
    clients: Tensor | float = 1.0
    adaptive: Tensor | None = None

    @property
    def amplification(self) -> float:
        """How far the step moved the global model, relative to the clients' mean update: ``server / clients``
        (``inf`` when the clients did not move and the server did). Above 1, the server step, not the clients, drove
        the model (:func:`flx.faults.optimizer_cause`)."""
        server, clients = float(self.server), float(self.clients)
        if clients == 0.0:
            return 1.0 if server == 0.0 else math.inf
        return server / clients

    @property
    def denominator(self) -> float:
        """The adaptive step's effective denominator, ``eta_s ||m_t|| / ||w_{t+1} - w_t||``: the size of
        :math:`\\sqrt{v_t} + \\tau` as the step saw it (exact when it is the same in every coordinate). Near ``tau``
        the second moment is ~0 against it and the step is ~ ``eta_s m_t / tau``. Not a number for SGD and for a
        step of length 0."""
        server = float(self.server)
        return float(self.adaptive) / server if self.adaptive is not None and server > 0 else math.nan


class ServerOptimizer:
    """Applies the server update to the global parameters in place.

    Args:
        params: the global parameter tensors (persistent across rounds).
        cfg: the server optimizer configuration; ``cfg.name`` is one of :data:`flx.choices.SERVER_OPTIMIZERS`, as
            the pre-run check (:func:`flx.checks.validate`, run by :func:`flx.run.train` too) has made sure.
    """

    def __init__(self, params: list[Tensor], cfg: ServerOptConfig) -> None:
        self.params, self.cfg = params, cfg
        self.exact_mean = cfg.name == "sgd" and cfg.lr == 1.0 and cfg.momentum == 0.0 and cfg.weight_decay == 0.0
        self.state: dict[str, Any] = {"step": 0}
        self.moves = StepMoves()  # the last step's; a new value every step (a caller may keep earlier ones)

    @property
    def amplification(self) -> float:
        """The last step's :attr:`StepMoves.amplification` (1 for plain averaging and before the first step)."""
        return self.moves.amplification

    def _moment(self, name: str, start: float = 0.0) -> list[Tensor]:
        if name not in self.state:
            self.state[name] = [torch.full_like(p, start) for p in self.params]
        return self.state[name]

    @torch.no_grad()
    def step(self, mean: list[Tensor]) -> None:
        """``mean``: the aggregated client models, aligned with ``params``."""
        self.state["step"] += 1
        if self.exact_mean:
            torch._foreach_copy_(self.params, [m.to(p.dtype) for p, m in zip(self.params, mean)])
            return
        delta = torch._foreach_sub([m.to(p.dtype) for p, m in zip(self.params, mean)], self.params)
        clients = _norm(delta)
        if self.cfg.weight_decay:
            torch._foreach_add_(delta, self.params, alpha=-self.cfg.weight_decay)
        if self.cfg.name == "sgd":
            self.moves = StepMoves(self._sgd(delta), clients)
        else:
            self.moves = StepMoves(self._adaptive(delta), clients, self.cfg.lr * _norm(self.state["m"]))

    def _sgd(self, delta: list[Tensor]) -> Tensor:
        """The SGD(M) step; returns its length ``eta_s ||v_t||``."""
        if self.cfg.momentum:
            v = self._moment("v")
            torch._foreach_mul_(v, self.cfg.momentum)
            torch._foreach_add_(v, delta)
            delta = v
        torch._foreach_add_(self.params, delta, alpha=self.cfg.lr)
        return self.cfg.lr * _norm(delta)

    def _adaptive(self, delta: list[Tensor]) -> Tensor:
        """The FedAdam / FedAdagrad / FedYogi step; returns its length ``eta_s ||m_t / (sqrt(v_t) + tau)||``."""
        (b1, b2), m, v = self.cfg.betas, self._moment("m"), self._moment("v", self.cfg.initial_v())
        torch._foreach_lerp_(m, delta, 1.0 - b1)  # m = b1 m + (1 - b1) delta
        if self.cfg.name == "adam":
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, delta, delta, value=1.0 - b2)
        elif self.cfg.name == "adagrad":
            torch._foreach_addcmul_(v, delta, delta)
        else:  # yogi: v -= (1 - b2) delta^2 sign(v - delta^2)
            square = torch._foreach_mul(delta, delta)
            sign = torch._foreach_sub(v, square)
            for s in sign:
                s.sign_()
            torch._foreach_mul_(square, sign)
            torch._foreach_add_(v, square, alpha=-(1.0 - b2))
        denom = torch._foreach_add(torch._foreach_sqrt(v), self.cfg.eps)
        torch._foreach_addcdiv_(self.params, m, denom, value=self.cfg.lr)
        torch._foreach_reciprocal_(denom)  # the step's direction, in place of denom (no new buffers): m / denom
        torch._foreach_mul_(denom, m)
        return self.cfg.lr * _norm(denom)

    def state_dict(self) -> dict[str, Any]:
        state = {k: ([t.clone() for t in v] if isinstance(v, list) else v) for k, v in self.state.items()}
        return state | {"amplification": self.amplification}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self.moves = StepMoves(float(state.get("amplification", 1.0)))
        self.state = {"step": int(state.get("step", 0))}
        for k, v in state.items():
            if isinstance(v, list):
                self.state[k] = [t.to(p.device, p.dtype) for t, p in zip(v, self.params)]


def _norm(tensors: list[Tensor]) -> Tensor:
    """The Euclidean norm of a list of tensors, as one 0-dim tensor (no host sync)."""
    if not tensors:
        return torch.zeros(())
    norms = torch._foreach_norm(tensors)
    dtype = norms[0].dtype
    for n in norms[1:]:
        dtype = torch.promote_types(dtype, n.dtype)
    return torch.linalg.vector_norm(torch.stack([n.to(dtype) for n in norms]))
