r"""Lambda sampling: the distributionally robust server of DRFA, DRFA-Prox, DRFA-GA and AFL.

Deng, Kamani, Mahdavi, "Distributionally Robust Federated Averaging", NeurIPS 2020 (digest
``shared/papers/drfa.md``). The server solves
:math:`\min_w \max_{\lambda \in \Lambda} \sum_i \lambda_i f_i(w) + g(\lambda)` with :math:`\lambda` on the simplex.
Round :math:`s` with :math:`\tau` local steps and cohort size :math:`m`:

1. the cohort :math:`D^{(s)}` is :math:`m` i.i.d. draws from Categorical(:math:`\lambda^{(s)}`), with replacement
   (Alg. 1 line 2; a client drawn twice trains once and counts twice in the unweighted mean, or trains twice under
   ``algo.duplicates=repeat``: the snapshot weight is the run's own, one draw per copy);
2. a snapshot step :math:`j` is drawn uniformly from :math:`\{1..\tau\}`, the same for every client (line 3); each
   client keeps its model after :math:`j` local steps and the server averages them into :math:`w^{(t')}` (line 12);
3. a second set :math:`U` of :math:`m` clients is drawn uniformly without replacement; each evaluates its loss on
   one minibatch at :math:`w^{(t')}` and :math:`v_i = \frac{N}{m} f_i(w^{(t')}; \xi_i)` for :math:`i \in U`, else 0;
4. DRFA: :math:`\lambda \leftarrow \Pi_\Lambda(\lambda + \tau\gamma v)` (line 17); DRFA-Prox
   (``regularizer=kl|chi2``): the proximal step of Alg. 2 line 17 on :math:`y = \lambda + \tau\gamma v` with
   :math:`c = \gamma\tau\rho` (closed forms in :mod:`flx.simplex`); DRFA-GA (``mode=ga``, Alg. 3): all
   :math:`N` clients evaluate their full local loss at the round-start model :math:`\bar w^{(s)}` and
   :math:`\lambda \leftarrow \Pi_\Lambda(\lambda + \gamma(f + \nabla g(\lambda)))`, no :math:`\tau`, no snapshot.

AFL (Mohri et al. 2019) is DRFA with :math:`\tau = 1` (``algo=afl``). The authors' FedTorch code differs from the
paper in ways that are options here (digest §6): ``sampling=uniform_weighted`` (a uniform cohort without
replacement and the aggregate :math:`\bar w - \sum_{i \in D} \lambda_i \frac{N}{m}(\bar w - w_i)`),
``gamma_decay=0.9`` (:math:`\gamma_s = \gamma \cdot 0.9^{s+1}`: the code decays before the first round),
``lambda_floor=1e-3`` (entries at or below it raised to it, then renormalised) and
``lambda_init=num_samples`` (:math:`\lambda^{(0)}_i = n_i / n`). Choices the paper leaves open: :math:`\lambda^{(0)}`
(default uniform), the loss minibatch for :math:`v` (``eval_batch``, default the training batch size, drawn
from a ``(seed, round, client)`` stream, net in eval mode), and the output: the last iterates (no averaging).
The part keeps :math:`\lambda` and its history in its ``state_dict``; at the end of fit it writes
``lambda.json`` next to ``curves.json`` and logs ``lambda/<i>`` every round (and a W&B table when W&B is on).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from typing_extensions import override

from flx import simplex
from flx.aggregation import WeightedMean
from flx.errors import bad_value
from flx.federation import _copy, derive_seed
from flx.hooks import FederatedCallback

if TYPE_CHECKING:
    from flx.context import ClientContext, FederationConfig, RoundContext
    from flx.federation import Federation

_SNAPSHOT_TAG, _EVAL_SET_TAG, _EVAL_BATCH_TAG = 0x51, 0x52, 0x53
MAX_LOGGED_CLIENTS = 100  # lambda/<i> is logged per client up to this many clients (lambda/max always)


@dataclass(frozen=True)
class LambdaParams:
    """``gamma`` (dual step), ``rho`` (regulariser weight), ``eval_batch`` (None: ``algo.batch_size``)."""

    gamma: float = 8e-3
    mode: str = "drfa"
    regularizer: str = "none"
    rho: float = 0.0
    sampling: str = "lambda"
    gamma_decay: float = 1.0
    lambda_floor: float = 0.0
    lambda_init: str = "uniform"
    eval_batch: int | None = None


class LambdaSampling(FederatedCallback):
    """The server's mixing weights ``lambda``: cohort sampling, snapshot model, projected (or prox) dual ascent."""

    def __init__(self, **params: Any) -> None:
        self.params = p = LambdaParams(**params)
        for key, value, allowed in (
            ("mode", p.mode, ("drfa", "ga")),
            ("regularizer", p.regularizer, ("none", "kl", "chi2")),
            ("sampling", p.sampling, ("lambda", "uniform_weighted")),
            ("lambda_init", p.lambda_init, ("uniform", "num_samples")),
        ):
            if value not in allowed:
                raise bad_value(f"algo.{key}", value, f"allowed: {', '.join(allowed)}")
        if not p.gamma > 0:
            raise bad_value("algo.gamma", p.gamma, "the dual step size, > 0")
        if not p.rho >= 0 or (p.regularizer != "none" and not p.rho > 0):
            raise bad_value("algo.rho", p.rho, "> 0 with a regularizer (kl, chi2), >= 0 otherwise")
        if not 0 < p.gamma_decay <= 1:
            raise bad_value("algo.gamma_decay", p.gamma_decay, "in (0, 1]; 1 = constant (paper), 0.9 = FedTorch")
        if not 0 <= p.lambda_floor < 1:
            raise bad_value("algo.lambda_floor", p.lambda_floor, "in [0, 1/N); 0 = none (paper), 1e-3 = FedTorch")
        if p.eval_batch is not None and p.eval_batch < 1:
            raise bad_value("algo.eval_batch", p.eval_batch, ">= 1, or null for algo.batch_size")
        self.lam: Tensor | None = None
        self.history: list[list[float]] = []

    @override
    def check_setup(self, datamodule: Any, cfg: FederationConfig) -> None:
        n = datamodule.num_clients
        if self.params.lambda_floor * n >= 1:
            raise bad_value("algo.lambda_floor", self.params.lambda_floor, f"below 1/N = {1 / n:g}")
        if self.params.mode == "drfa" and cfg.local_epochs is not None:
            raise bad_value("algo.local_epochs", cfg.local_epochs, "DRFA draws t' among tau steps: use null")

    # ------------------------------------------------------------------ lambda
    def _init_lambda(self, fed: Federation) -> None:
        n = fed.num_clients
        if self.params.lambda_init == "uniform":
            self.lam = torch.full((n,), 1.0 / n, dtype=torch.float64)
        else:
            sizes = torch.tensor([fed.num_samples(c) for c in range(n)], dtype=torch.float64)
            self.lam = sizes / sizes.sum()

    def gamma_at(self, round_idx: int) -> float:
        """The dual step of round ``round_idx`` (FedTorch decays it before the first round)."""
        decay = self.params.gamma_decay
        return self.params.gamma * (decay ** (round_idx + 1) if decay != 1 else 1.0)

    @override
    def sample_clients(self, fed: Federation, round_idx: int, rng: np.random.Generator) -> list[int]:
        if self.lam is None:
            self._init_lambda(fed)
        m, n = fed.cfg.clients_per_round, fed.num_clients
        if self.params.sampling == "lambda":
            probs = self.lam.numpy()
            return rng.choice(n, size=m, replace=True, p=probs / probs.sum()).tolist()
        return rng.choice(n, size=m, replace=False).tolist()

    # ------------------------------------------------------------------ server
    @override
    def on_round_start(self, fed: Federation, rnd: RoundContext) -> None:
        self._snap_step = 0
        if self.params.mode == "drfa":
            rng = np.random.default_rng(derive_seed(fed.cfg.seed, rnd.round, _SNAPSHOT_TAG))
            self._snap_step = int(rng.integers(1, fed.cfg.local_steps + 1))  # j = t' - s tau in {1..tau}
            if not hasattr(self, "_snapshots"):
                self._snapshots = WeightedMean(fed.local_state)
            self._snapshots.reset()
        else:  # DRFA-GA: every client's full local loss at the round-start model (Alg. 3 lines 11-12)
            self._full_losses = self.client_losses(fed, range(fed.num_clients), rnd.round, batch=None)

    @torch.no_grad()
    def client_losses(self, fed: Federation, cids: Any, round_idx: int, batch: int | None) -> Tensor:
        """``f_i`` of the net's current model for ``cids`` (``batch`` rows drawn per client, or all), zeros elsewhere.

        Ranks split the clients and sum the vector, so every rank returns the same ``(N,)`` float64 tensor.
        """
        out = torch.zeros(fed.num_clients, dtype=torch.float64, device=fed.params[0].device)
        for k, cid in enumerate(cids):
            if k % fed.world_size != fed.rank:
                continue
            rows = fed.data.client_indices[cid]
            if batch is not None and batch < len(rows):
                g = torch.Generator().manual_seed(derive_seed(fed.cfg.seed, round_idx, cid, _EVAL_BATCH_TAG))
                rows = rows[torch.randperm(len(rows), generator=g)[:batch]]
            out[cid] = fed.eval_loss(rows)
        if fed.world_size > 1 and fed.reduce_sum is not None:
            fed.reduce_sum(out)
        return out.cpu()

    @override
    def on_server_step(self, fed: Federation, rnd: RoundContext, mean: list[Tensor]) -> None:
        if self.params.mode == "drfa":
            self._snapshots.sync(fed.reduce_sum if fed.world_size > 1 else None)
        if self.params.sampling == "uniform_weighted":
            # FedTorch: w <- w - sum_{i in D} lam_i (N/m) (w - w_i) = w + S (mean_lam - w), S = (N/m) sum_D lam_i
            scale = fed.num_clients / len(rnd.cohort) * float(self.lam[list(rnd.cohort)].sum())
            with torch.no_grad():
                for m, w in zip(mean, fed.global_params):
                    m.copy_(w + scale * (m - w))

    @override
    def on_round_end(self, fed: Federation, rnd: RoundContext) -> None:
        p, n, tau, gamma = self.params, fed.num_clients, fed.cfg.local_steps, self.gamma_at(rnd.round)
        if p.mode == "drfa":
            m = fed.cfg.clients_per_round
            rng = np.random.default_rng(derive_seed(fed.cfg.seed, rnd.round, _EVAL_SET_TAG))
            eval_set = sorted(rng.choice(n, size=min(m, n), replace=False).tolist())
            losses = self._at_snapshot(fed, eval_set, rnd.round)
            v = losses * (n / len(eval_set))  # v_i = (N/m) f_i(w^(t'); xi_i) on U, 0 elsewhere (line 16)
            y, c = self.lam + tau * gamma * v, gamma * tau * p.rho
            if p.regularizer == "chi2":
                lam = simplex.prox_chi2(y, c)
            elif p.regularizer == "kl":
                lam = simplex.prox_kl(y, c)
            else:
                lam = simplex.project_simplex(y)
        else:
            grad = self._full_losses + self._reg_grad(self.lam)
            lam = simplex.project_simplex(self.lam + gamma * grad)
        self.lam = simplex.floor_and_renormalise(lam, p.lambda_floor)
        self.history.append(self.lam.tolist())

    def _reg_grad(self, lam: Tensor) -> Tensor:
        """``grad g(lambda)`` for DRFA-GA: ``g = -rho/2 ||lam - 1/N||^2`` or ``g = -rho KL(lam || 1/N)``."""
        p, n = self.params, len(lam)
        if p.regularizer == "chi2":
            return -p.rho * (lam - 1.0 / n)
        if p.regularizer == "kl":
            return -p.rho * (torch.log(n * lam.clamp_min(1e-300)) + 1)
        return torch.zeros_like(lam)

    def _at_snapshot(self, fed: Federation, eval_set: list[int], round_idx: int) -> Tensor:
        """Losses of ``eval_set`` at the averaged snapshot ``w^(t')``; the net gets the new global model back."""
        keep = [t.detach().clone() for t in fed.local_state]
        with torch.no_grad():
            _copy(fed.local_state, [s.to(t.dtype) for s, t in zip(self._snapshots.compute(), fed.local_state)])
        batch = self.params.eval_batch or fed.cfg.batch_size
        losses = self.client_losses(fed, eval_set, round_idx, batch)
        with torch.no_grad():
            _copy(fed.local_state, keep)
        return losses

    # ------------------------------------------------------------------ client
    @override
    def on_client_start(self, fed: Federation, client: ClientContext) -> None:
        client.extras["lambda_weight"] = client.weight  # the snapshot mean is unweighted over draws (line 12)
        if self.params.sampling == "uniform_weighted":
            client.weight = float(self.lam[client.cid])

    @override
    def on_local_step_end(self, fed: Federation, client: ClientContext) -> None:
        if client.step + 1 == self._snap_step:
            client.extras["snapshot"] = [t.detach().clone() for t in fed.local_state]

    @override
    def on_client_end(self, fed: Federation, client: ClientContext) -> None:
        weight = client.extras.pop("lambda_weight")
        if self.params.mode == "drfa":
            self._snapshots.update(client.extras.pop("snapshot"), weight)

    # ------------------------------------------------------------------ logging and checkpoint
    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.lam is None or not trainer.loggers:
            return
        lam = self.lam.float()
        values = {"lambda/max": lam.max(), "lambda/min": lam.min()}
        if len(lam) <= MAX_LOGGED_CLIENTS:
            values |= {f"lambda/{i}": v for i, v in enumerate(lam)}
        pl_module.log_dict(values, on_epoch=True)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or not self.history or trainer.fast_dev_run:
            return
        os.makedirs(trainer.default_root_dir, exist_ok=True)
        with open(os.path.join(trainer.default_root_dir, "lambda.json"), "w") as f:
            json.dump({"round_end": self.history}, f)
        wandb_loggers = [lg for lg in trainer.loggers if type(lg).__name__ == "WandbLogger"]
        if wandb_loggers:
            import wandb

            n = len(self.history[0])
            table = wandb.Table(columns=["round", *[f"lambda_{i}" for i in range(n)]])
            for r, row in enumerate(self.history, start=1):
                table.add_data(r, *row)
            for logger in wandb_loggers:
                logger.experiment.log({"lambda/history": table})

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"lam": self.lam, "history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lam, self.history = state_dict["lam"], list(state_dict["history"])
