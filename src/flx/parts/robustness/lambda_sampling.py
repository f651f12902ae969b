r"""Lambda sampling: the distributionally robust server of DRFA, DRFA-Prox, DRFA-GA and AFL.

Deng, Kamani, Mahdavi, "Distributionally Robust Federated Averaging", NeurIPS 2020. The server solves
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

AFL (Mohri et al. 2019) is DRFA with :math:`\tau = 1` (``algo=afl``). The authors' released code (FedTorch,
github.com/MLOPTPSU/FedTorch, cited in the paper's Sec. 6) differs from the paper in ways that are options here:
``sampling=uniform_weighted`` (a uniform cohort without replacement and the aggregate :math:`\bar w - \sum_{i \in D}
\lambda_i \frac{N}{m}(\bar w - w_i)`),
``gamma_decay=0.9`` (:math:`\gamma_s = \gamma \cdot 0.9^{s+1}`: the code decays before the first round),
``lambda_floor=1e-3`` (entries at or below it raised to it, then renormalised) and
``lambda_init=num_samples`` (:math:`\lambda^{(0)}_i = n_i / n`). Choices the paper leaves open: :math:`\lambda^{(0)}`
(default uniform), the loss minibatch for :math:`v` (``eval_batch``, default the training batch size, drawn
from a ``(seed, round, client)`` stream, net in eval mode), and the output: the last iterates (no averaging).
A round is one collective: the snapshot sum and DRFA-GA's losses are registered statistics (``fed.register_stat``)
that ride in the round's all-reduce, and every rank evaluates all of :math:`U` at :math:`w^{(t')}` (which exists
only after that reduce), so :math:`v` needs none.
The part keeps :math:`\lambda` and its history in its ``state_dict``; at the end of fit it writes
``lambda.json`` next to ``curves.json`` and logs ``lambda/<i>`` every round; with W&B, the line plot ``lambda/plot``
(lambda per client over the rounds, the first ``MAX_PLOTTED_CLIENTS`` clients, and the max and min;
:mod:`flx.parts.robustness.lambda_report`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from typing_extensions import override

from flx import simplex
from flx.autodiff import loss_at
from flx.errors import bad_value, check_fields
from flx.evaluation import client_losses
from flx.hooks import FederatedCallback
from flx.parts.robustness import lambda_report
from flx.sampling import derive_seed
from flx.traits import Channel, PartTraits

if TYPE_CHECKING:
    from flx.context import ClientContext, Cohort, FederationView, Round
    from flx.hooks import Build
    from flx.traits import ReleasesLoss

_SNAPSHOT_TAG, _EVAL_SET_TAG, _EVAL_BATCH_TAG = 0x51, 0x52, 0x53
# registered statistics: the snapshot sum (shaped like fed.local_state) then its weight; DRFA-GA's (N,) full losses
_SNAPSHOT, _FULL_LOSSES = "lambda/snapshot", "lambda/full_losses"


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

    traits = PartTraits(
        uploads={  # DRFA; DRFA-GA's (set in __init__) is its full loss
            "lambda/losses": Channel("its losses at the snapshot model (DRFA's lambda step)", "loss"),
            _SNAPSHOT: Channel("its model at the snapshot step t' (DRFA's averaged snapshot)", "iterate"),
        },
        steps="data_free",  # the snapshot is a copy of the local model (under local DP-SGD, already private)
        vectorizable=True,  # algo.vectorize: the snapshot w^(t') is taken from the stacked clients (on_cohort_step_end)
        uses=("loss_release",),  # a part that releases the clients' losses (local DP) computes them
        headline=("client_acc_worst", "client_mse_worst"),  # the worst client: what DRFA optimises
        metrics=("lambda/*",),
    )

    def __init__(self, **params: Any) -> None:
        self.params = p = LambdaParams(**params)
        check_fields(p, "algo.")
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
        self._snap_step = 0  # the round's j = t' - s tau (DRFA)
        self._names: list[str] = []  # fed.local_state's names in the net, to evaluate the snapshot functionally
        if p.mode == "ga":  # every client's full loss at the round start, computed on the server's side
            uploads = {_FULL_LOSSES: Channel("its full local loss (DRFA-GA's lambda step)")}
            self.traits = dataclasses.replace(self.traits, uploads=uploads)

    @override
    def check(self, build: Build) -> None:
        cfg, n = build.cfg, build.clients.num_train_clients
        if self.params.lambda_floor * n >= 1:
            raise bad_value("algo.lambda_floor", self.params.lambda_floor, f"below 1/N = {1 / n:g}")
        if self.params.mode == "drfa" and cfg.local_epochs is not None:
            raise bad_value("algo.local_epochs", cfg.local_epochs, "DRFA draws t' among tau steps: use null")

    @override
    def on_attach(self, fed: FederationView) -> None:
        self._init_lambda(fed)  # a resumed run's checkpoint replaces it (load_state_dict, after on_attach)
        # statistics in the model's dtype (an fp32 model keeps an fp32 round buffer): the snapshot mean is a model,
        # computed as the primal mean is; DRFA-GA's losses come from an fp32 forward pass anyway
        dtype = fed.params[0].dtype
        if self.params.mode == "drfa":
            net = fed.net
            params = [n for n, q in net.named_parameters() if q.requires_grad]
            self._names = params + [n for n, b in net.named_buffers() if b.is_floating_point()]
            fed.register_stat(_SNAPSHOT, [*fed.local_state, torch.zeros(1, dtype=dtype)])
        else:
            fed.register_stat(_FULL_LOSSES, torch.zeros(fed.num_clients, dtype=dtype))

    # ------------------------------------------------------------------ lambda
    def _init_lambda(self, fed: FederationView) -> None:
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
    def sample_clients(self, fed: FederationView, round_idx: int, rng: np.random.Generator) -> list[int]:
        m, n = fed.cfg.clients_per_round, fed.num_clients
        if self.params.sampling == "lambda":
            probs = self._lam.numpy()
            return rng.choice(n, size=m, replace=True, p=probs / probs.sum()).tolist()
        return rng.choice(n, size=m, replace=False).tolist()

    # ------------------------------------------------------------------ server
    @override
    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        if self.params.mode == "drfa":
            rng = np.random.default_rng(derive_seed(fed.cfg.seed, rnd.round, _SNAPSHOT_TAG))
            self._snap_step = int(rng.integers(1, fed.cfg.local_steps + 1))  # j = t' - s tau in {1..tau}
        else:  # DRFA-GA: every client's full local loss at the round-start model (Alg. 3 lines 11-12): this rank's
            # share (client i on rank i mod N); the round's all-reduce sums the shares before on_round_end
            losses = fed.stat(_FULL_LOSSES)
            assert isinstance(losses, Tensor)  # registered as one tensor
            for cid, loss in client_losses(fed, range(fed.rank, fed.num_clients, fed.world_size)).items():
                losses[cid] = loss  # batched over the clients: one forward pass covers many clients' rows

    @override
    def on_server_step(self, fed: FederationView, rnd: Round, mean: list[Tensor]) -> None:
        if self.params.sampling == "uniform_weighted":
            # FedTorch: w <- w - sum_{i in D} lam_i (N/m) (w - w_i) = w + S (mean_lam - w), S = (N/m) sum_D lam_i
            scale = fed.num_clients / len(rnd.cohort) * float(self._lam[list(rnd.cohort)].sum())
            with torch.no_grad():
                for m, w in zip(mean, fed.global_params):
                    m.copy_(w + scale * (m - w))

    @override
    def on_round_end(self, fed: FederationView, rnd: Round) -> None:
        p, n, tau, gamma = self.params, fed.num_clients, fed.cfg.local_steps, self.gamma_at(rnd.round)
        if p.mode == "drfa":
            *sums, weight = fed.stat(_SNAPSHOT)
            if float(weight) <= 0:  # no client trained this round (all skipped): no w^(t'), lambda stays
                self.history.append(self._lam.tolist())
                return
            m = fed.cfg.clients_per_round
            rng = np.random.default_rng(derive_seed(fed.cfg.seed, rnd.round, _EVAL_SET_TAG))
            eval_set = sorted(rng.choice(n, size=min(m, n), replace=False).tolist())
            losses = self._at_snapshot(fed, list(torch._foreach_div(sums, weight[0])), eval_set, rnd.round)
            v = losses * (n / len(eval_set))  # v_i = (N/m) f_i(w^(t'); xi_i) on U, 0 elsewhere (line 16)
            y, c = self._lam + tau * gamma * v, gamma * tau * p.rho
            if p.regularizer == "chi2":
                lam = simplex.prox_chi2(y, c)
            elif p.regularizer == "kl":
                lam = simplex.prox_kl(y, c)
            else:
                lam = simplex.project_simplex(y)
        else:
            full = fed.stat(_FULL_LOSSES)
            assert isinstance(full, Tensor)  # registered as one tensor
            grad = full.double().cpu() + self._reg_grad(self._lam)
            lam = simplex.project_simplex(self._lam + gamma * grad)
        self.lam = simplex.floor_and_renormalise(lam, p.lambda_floor)
        self.history.append(self.lam.tolist())

    @property
    def _lam(self) -> Tensor:
        """:math:`\\lambda`, which ``on_attach`` sets (or a checkpoint loads)."""
        if self.lam is None:
            raise RuntimeError("LambdaSampling: lambda is set in on_attach")
        return self.lam

    def _reg_grad(self, lam: Tensor) -> Tensor:
        """``grad g(lambda)`` for DRFA-GA: ``g = -rho/2 ||lam - 1/N||^2`` or ``g = -rho KL(lam || 1/N)``."""
        p, n = self.params, len(lam)
        if p.regularizer == "chi2":
            return -p.rho * (lam - 1.0 / n)
        if p.regularizer == "kl":
            return -p.rho * (torch.log(n * lam.clamp_min(1e-300)) + 1)
        return torch.zeros_like(lam)

    @torch.no_grad()
    def _at_snapshot(self, fed: FederationView, snapshot: list[Tensor], eval_set: list[int], round_idx: int) -> Tensor:
        """``(N,)`` float64: ``f_i(w^(t'); xi_i)`` for ``i`` in ``eval_set``, zeros elsewhere; ``snapshot`` is
        ``w^(t')``, shaped like ``fed.local_state``.

        Every rank evaluates all of ``U`` (one minibatch per client, drawn from a ``(seed, round, client)`` stream), so
        the losses need no collective: they exist only after the round's all-reduce. The net is not modified: the
        snapshot enters through ``torch.func.functional_call``, in eval mode (no dropout, BatchNorm uses the
        snapshot's running statistics), under the step context.
        """
        values = {name: s.to(t.dtype) for name, s, t in zip(self._names, snapshot, fed.local_state)}
        batch = self.params.eval_batch or fed.cfg.batch_size
        out = torch.zeros(fed.num_clients, dtype=torch.float64)
        was_training = fed.net.training
        fed.net.eval()
        # a part that provides the release (local DP): the clients release noised losses
        releaser = next((cast("ReleasesLoss", q) for q in self.linked("loss_release")), None)
        try:
            for cid in eval_set:
                if releaser is not None:
                    out[cid] = releaser.release_loss(fed, cid, values, round_idx)
                    continue
                rows = fed.data.client_indices[cid]
                if batch < len(rows):
                    g = torch.Generator().manual_seed(derive_seed(fed.cfg.seed, round_idx, cid, _EVAL_BATCH_TAG))
                    rows = rows[torch.randperm(len(rows), generator=g)[:batch].to(rows.device)]  # drawn on the host
                with fed.step_context():  # summed in float64, as fed.eval_loss
                    out[cid] = float(loss_at(fed.net, values, [fed.batch(r) for r in rows.split(4096)], fed.loss_fn))
        finally:
            fed.net.train(was_training)
        return out

    # ------------------------------------------------------------------ client
    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        client.extras["lambda_weight"] = client.weight  # the snapshot mean is unweighted over draws (line 12)
        if self.params.sampling == "uniform_weighted":
            client.weight = float(self._lam[client.cid])

    @override
    def on_local_step_end(self, fed: FederationView, client: ClientContext) -> None:
        if client.step + 1 == self._snap_step:
            client.extras["snapshot"] = [t.detach().clone() for t in fed.local_state]

    @override
    @torch.no_grad()
    def on_cohort_step_end(self, fed: FederationView, cohort: Cohort) -> None:
        if cohort.step + 1 == self._snap_step:  # algo.vectorize: every client's w^(t') at once
            saved = dataclasses.replace(cohort, params=[w.clone() for w in cohort.params])
            for i, client in enumerate(cohort.clients):
                client.extras["snapshot"] = saved.local_state(fed, i)

    @override
    @torch.no_grad()
    def on_client_end(self, fed: FederationView, client: ClientContext) -> None:
        weight = client.extras.pop("lambda_weight")
        if self.params.mode == "drfa":  # this rank's share of sum_i p_i w_i^(t') and of sum_i p_i (line 12)
            *sums, total = fed.stat(_SNAPSHOT)
            torch._foreach_add_(sums, client.extras.pop("snapshot"), alpha=weight)
            total += weight

    # ------------------------------------------------------------------ logging and checkpoint
    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.lam is not None and trainer.loggers:
            lambda_report.log_lambda(trainer, pl_module, self.lam)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.history and not trainer.fast_dev_run:  # type: ignore[attr-defined]  # set by lightning trainer/setup.py, undeclared
            lambda_report.write_history(trainer, self.history)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"lam": self.lam, "history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lam, self.history = state_dict["lam"], list(state_dict["history"])
