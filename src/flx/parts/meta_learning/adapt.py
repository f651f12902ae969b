r"""Fast adaptation at evaluation: a client's personalised model is ``steps`` gradient steps from the global model on
its support rows.

The evaluation of federated meta-learning (AugFL, Yue et al., Algorithm 1 step 4 and §VI-A; Per-FedAvg, Fallah,
Mokhtari, Ozdaglar, NeurIPS 2020) and FedAvg's local fine-tuning
baseline: from the global (meta-)model :math:`\theta`, client :math:`i`'s model is

.. math::
    \phi_i^{(0)} = \theta, \qquad \phi_i^{(k+1)} = \phi_i^{(k)} - \alpha \nabla L_i(\phi_i^{(k)}; S_i),
    \quad k < K,

full batch on its support set :math:`S_i` (``fed.data.support_rows``: a few-shot client's support set, a held-out
client's rows; every row of a client without a support/query split), and it is measured on the client's evaluation
rows (the held-out clients' query sets with ``partition=few_shot``). ``steps`` is :math:`K` (1 in the paper), ``lr`` is
:math:`\alpha` (AugFL: its inner step). Gradients are taken in the net's train mode (``fed.grad_at``: BatchNorm with the
batch statistics, its running statistics untouched); the evaluation then runs in eval mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from flx.errors import bad_value, check_fields, count
from flx.hooks import PERSONAL_HEADLINE, FederatedCallback
from flx.traits import PartTraits

if TYPE_CHECKING:
    from collections.abc import Iterator

    from flx.context import FederationView


@dataclass(frozen=True)
class AdaptParams:
    """``steps`` (:math:`K`), ``lr`` (:math:`\\alpha`)."""

    steps: int = 1
    lr: float = 0.03
    also_steps: tuple[int, ...] = ()  # more step counts, each logged as {split}/adapted<k>_<metric>_*


class Adapt(FederatedCallback):
    """``personalize``: ``steps`` full-batch gradient steps of size ``lr`` on the client's support rows; each count of
    ``also_steps`` is evaluated too and logged as ``{split}/adapted<k>_<metric>_{mean,worst,p10}``."""

    traits = PartTraits(uploads={}, headline=PERSONAL_HEADLINE)

    def __init__(self, **params: Any) -> None:
        self.params = p = AdaptParams(**params)
        check_fields(
            p, "algo.", {"steps": "algo.adapt_steps", "lr": "algo.adapt_lr", "also_steps": "algo.adapt_also_steps"}
        )
        count("algo.adapt_steps", p.steps, 0)  # 0: the global model
        if not p.lr > 0:
            raise bad_value("algo.adapt_lr", p.lr, "> 0")
        if not isinstance(p.also_steps, Sequence) or isinstance(p.also_steps, str):
            raise bad_value("algo.adapt_also_steps", p.also_steps, "must be a list of step counts, e.g. [5]")
        for k in p.also_steps:
            count("algo.adapt_also_steps", k, 0)
        object.__setattr__(p, "also_steps", tuple(p.also_steps))
        self._steps = p.steps
        self.traits = dataclasses.replace(self.traits, metrics=tuple(f"{{split}}/adapted{k}_*" for k in p.also_steps))

    @override
    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._log_more(pl_module, "val")

    @override
    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._log_more(pl_module, "test")

    def _log_more(self, pl_module: Any, stage: str) -> None:
        """The personalised metrics after each of ``also_steps`` steps (the main ones use ``steps``)."""
        for k in self.params.also_steps:
            self._steps = k
            try:
                pl_module.log_personal_metrics(stage, f"adapted{k}")
            finally:
                self._steps = self.params.steps

    @override
    def personalize(self, fed: FederationView, cid: int) -> Any:
        rows = fed.data.support_rows(cid)
        return self._adapted(fed, rows) if len(rows) and self._steps else None

    @contextmanager
    def _adapted(self, fed: FederationView, rows: torch.Tensor) -> Iterator[None]:
        """The net as :math:`\\phi_i^{(K)}`; the federation restores :math:`\\theta` on exit."""
        was_training = fed.net.training
        fed.net.train()
        phi = [q.detach() for q in fed.params]
        for _ in range(self._steps):
            phi = list(torch._foreach_add(phi, fed.grad_at(phi, rows), alpha=-self.params.lr))
        fed.net.train(was_training)
        with torch.no_grad():
            torch._foreach_copy_(fed.params, phi)
        yield
