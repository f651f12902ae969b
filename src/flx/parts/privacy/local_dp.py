r"""Record-level differential privacy inside every client: DP-SGD local steps, with a per-client ledger.

Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep Learning with Differential Privacy", CCS 2016
(arXiv:1607.00133), Algorithm 1, run as each client's local steps. The privacy unit is one **row** (a record) of a
client; what is protected is everything the client sends, its model update, a function of its noised gradients
alone. Client :math:`i` with :math:`n_i` rows, batch size :math:`B` (``algo.batch_size``), clip :math:`C`, noise
multiplier :math:`\sigma`; at every local step :math:`k`:

1. the minibatch is drawn by this part (``privacy.sampling``): ``poisson``, every row independently with probability
   :math:`q_i = \min(1, B / n_i)` (the batch size varies around :math:`B`), or ``fixed``, :math:`\min(B, n_i)` rows
   without replacement (``algo.minibatch=fresh``'s draw);
2. each row's gradient :math:`g_j = \nabla_w \ell(w; x_j, y_j)` (the task's loss on the row alone,
   :func:`flx.autodiff.row_grads`: ``torch.func``) is clipped to L2 norm :math:`C` over all trainable parameters
   (``clip_mode=flat``), or each of its :math:`L` trainable tensors to :math:`C / \sqrt{L}` (``per_layer``: the
   whole still within :math:`C`, so the noise and the ledger are the same);
3. :math:`\tilde g = \big(\sum_j g_j \min(1, C / \lVert g_j \rVert) + \mathcal N(0, \sigma^2 C^2 I)\big) / (q_i n_i)`,
   the fixed denominator (the expected batch size, :math:`\min(B, n_i)`), is the step's gradient. Parts whose step
   hooks read only the models (FedProx's proximal term, a prox operator: ``steps="data_free"``) then act on it as
   usual, and the configured SGD steps. The noise is drawn from a generator seeded by ``(seed, round, client,
   copy)`` on the net's device, so the stacked clients (``algo.vectorize``) draw what the sequential ones do, 2
   processes give the run of 1 and a resumed run the uninterrupted one; a real deployment would use a secure source.

The ledger: a client's steps are events of the library's accountant, ``PoissonSampledDpEvent(q_i,
GaussianDpEvent(sigma))`` (add or remove one row) or ``SampledWithoutReplacementDpEvent(n_i, B,
GaussianDpEvent(sigma / 2))`` (replace one row; :mod:`flx.privacy`), one per step, composed over every step the
client has taken in every round it joined (no amplification by the cohort sampling is claimed). ``privacy/epsilon``
is the largest over the clients: the guarantee of the worst-off row. ``target_epsilon`` without ``noise_multiplier``
calibrates :math:`\sigma` before round 1 for a client that trains once in each of the ``algo.rounds`` rounds. Either
way, with ``target_epsilon`` every round is checked before it runs, with its real draws (a client drawn twice under
``algo.duplicates=repeat`` trains twice): the run stops before a round in which some client would exceed it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from flx import privacy
from flx.aggregation import numel
from flx.autodiff import row_grads
from flx.clipping import LinearRows, NotRowwise, clipped_sum
from flx.errors import ConfigError, bad_value
from flx.parts.privacy.dp_budget import Budgeted, BudgetParams
from flx.sampling import derive_seed, fresh_rows
from flx.traits import PartTraits
from flx.vectorized import foldable

if TYPE_CHECKING:
    from flx.context import ClientContext, Cohort, FederationConfig, FederationView, Round
    from flx.hooks import Build

_NOISE_TAG = 0x4453  # "DS": a client's noise stream, derive_seed(seed, round, client, copy, tag)
_NOISE = "local_dp/noise"  # client.extras: the client's noise generator
_LOSS_TAG = 0x444C  # "DL": a released loss's rows and noise, derive_seed(seed, round, client, tag)


@dataclass(frozen=True)
class LocalParams(BudgetParams):
    """The ``privacy.*`` keys of ``privacy=local`` (``configs/privacy/local.yaml``)."""

    clip: float = 1.0
    loss_clip: float = 5.0
    runs_per_round: int = 1


class LocalDP(Budgeted):
    """DP-SGD local steps (per-row clipping, Gaussian noise, the fixed denominator) and the clients' ledger."""

    traits = PartTraits(
        uploads={},
        vectorizable=True,  # cohort_grad: the stacked clients' rows at once
        provides=("loss_release",),  # release_loss: a client's loss released as a step releases a gradient
        protects=("uploads", "steps"),
        metrics=("privacy/epsilon",),
    )

    def __init__(self, **params: Any) -> None:
        self.params: LocalParams = LocalParams(**params)
        p = self.params
        p.check("one row's gradient")
        if not p.loss_clip > 0:
            raise bad_value("privacy.loss_clip", p.loss_clip, "the bound a row's released loss is clipped to, > 0")
        runs = p.runs_per_round  # an integer (check_fields)
        if not 1 <= runs <= privacy.MAX_RUNS_PER_ROUND:
            allowed = f"an integer from 1 to {privacy.MAX_RUNS_PER_ROUND} (the runs a round calibration plans a client)"
            raise bad_value("privacy.runs_per_round", runs, allowed)
        self.sigma: float | None = p.noise_multiplier
        self.per_layer = p.clip_mode == "per_layer"
        self.batch_size = 0  # B
        self.sizes: dict[int, int] = {}  # n_i of the clients that train
        self.plan: dict[int, int] = {}  # K_i: a client's local steps in one round
        self.steps: dict[int, int] = {}  # the ledger: the steps (and loss releases) each client has made
        self.releases = 0  # loss releases a client may make in one round (DRFA's lambda step: 1)
        self.rounds = 0
        self.rounds_planned = 0  # algo.rounds: what target_epsilon is calibrated for
        self._rows: Any = None  # flx.autodiff.row_grads, and its vmap over stacked clients
        self._stacked_rows: Any = None
        self._linear: LinearRows | None = None  # per-row clipping without per-row gradients, where the net allows

    # ------------------------------------------------------------------ setup
    @override
    def check(self, build: Build) -> None:
        sizes = build.sizes()
        largest = max(sizes.values(), default=0)
        if largest and self.params.delta >= 1 / largest:
            allowed = f"below 1 / (the largest client's rows) = {1 / largest:g}"
            raise bad_value("privacy.delta", self.params.delta, allowed)
        self._setup(sizes, build.cfg)
        layer = next((m for m in build.net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
        if layer is not None:
            raise ConfigError(
                f"privacy=local: the net has {type(layer).__name__} layers, which mix the rows of a batch (a row has "
                "no gradient of its own); use a net without BatchNorm, or privacy=central"
            )
        self._calibrate()

    def _setup(self, sizes: dict[int, int], cfg: FederationConfig) -> None:
        """The clients' sizes and step counts."""
        self.batch_size, self.sizes = cfg.batch_size, {i: n for i, n in sizes.items() if n > 0}
        epochs, b = cfg.local_epochs, cfg.batch_size
        self.plan = {i: cfg.local_steps if epochs is None else epochs * -(-n // b) for i, n in self.sizes.items()}
        self.rounds_planned = cfg.rounds

    def _calibrate(self) -> None:
        """The loss releases a client may make in a round (one if a linked part sends losses, ``loss_release``);
        the noise multiplier calibrated to ``target_epsilon`` when none is set: the smallest :math:`\\sigma` with
        which every client stays within it after ``algo.rounds`` rounds of :meth:`_per_round` events. Planning for the
        most draws a client could get (all ``m`` of every round, with repeats) would drown any model in noise, so the
        default plans one run a round; the budget's round check holds the target whatever the draws."""
        p = self.params
        consumers = self.linked("loss_release")
        self.releases = int(any(c.kind == "loss" for q in consumers for c in q.traits.channels().values()))
        cases = {(self._mechanism(i, 1.0), self._per_round(i) * self.rounds_planned) for i in self.sizes}
        worst = sorted(cases, key=lambda c: (-c[0].q, -c[1]))
        if self.sigma is not None:  # the ledger's largest ask, before any write
            for mech, steps in worst[:1]:
                privacy.accounted(
                    dataclasses.replace(mech, noise_multiplier=self.sigma), steps, p.delta, p.accountant, "steps"
                )
            return
        sigma = 0.0
        for mech, steps in worst:  # the next client needs more noise only if it spends more at the current sigma
            current = dataclasses.replace(mech, noise_multiplier=sigma)
            if not sigma or privacy.epsilon(current, steps, p.delta, p.accountant) > p.budget():
                try:
                    sigma = max(sigma, privacy.calibrate(p.budget(), mech, steps, p.delta, p.accountant))
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        self.sigma = sigma

    @property
    def _sigma(self) -> float:
        """:math:`\\sigma`, given or calibrated (:meth:`_calibrate`, at ``check``)."""
        if self.sigma is None:
            raise RuntimeError("LocalDP: sigma is calibrated at check (flx.composition.check)")
        return self.sigma

    def _mechanism(self, cid: int, sigma: float | None = None) -> privacy.Mechanism:
        """Client ``cid``'s step: a sample of expected size :math:`\\min(B, n_i)` from its :math:`n_i` rows."""
        n = self.sizes[cid]
        sigma = self._sigma if sigma is None else sigma
        return privacy.Mechanism(self.params.sampling, float(sigma), n, min(self.batch_size, n))

    @override
    def on_attach(self, fed: FederationView) -> None:
        self._rows = row_grads(fed.net, fed.loss_fn)
        self._stacked_rows = torch.func.vmap(self._rows, in_dims=(0, 0, 0), randomness="different")
        per_row = getattr(getattr(fed.loss_fn, "__self__", None), "loss_rows", None)  # the task's per-row loss
        self._linear = LinearRows(fed.net, per_row) if per_row is not None and foldable(fed.net) else None

    # ------------------------------------------------------------------ the ledger
    @override
    def on_round_start(self, fed: FederationView, rnd: Round) -> None:
        """Every rank books the cohort's steps (the round plan is the same on all of them)."""
        runs = self._runs(fed, rnd)
        for cid in rnd.cohort:
            if cid in self.sizes:
                self.steps[cid] = self.steps.get(cid, 0) + self.plan[cid] * runs[cid]

    def client_epsilon(self, cid: int, steps: int | None = None) -> float:
        """Client ``cid``'s :math:`\\varepsilon` at ``privacy.delta`` after ``steps`` steps (default: its ledger)."""
        p = self.params
        steps = self.steps.get(cid, 0) if steps is None else steps
        return privacy.epsilon(self._mechanism(cid), steps, p.delta, p.accountant)

    def spent(self) -> float:
        """:math:`\\varepsilon` of the worst-off row: the largest over the clients that have trained."""
        return self._worst(self.steps)[0]

    def after(self, fed: FederationView, rnd: Round) -> tuple[float, str]:
        """The largest :math:`\\varepsilon` a client reaches once round ``rnd`` has run: the cohort's clients with
        their steps times the runs they were drawn for (``algo.duplicates=repeat``: each draw is a run), every client
        with the loss releases it may make; and that client."""
        runs = self._runs(fed, rnd)
        steps = {i: self.steps.get(i, 0) + self.plan[i] * runs.get(i, 0) + self.releases for i in self.sizes}
        epsilon, cid = self._worst(steps)
        verb = "could" if self.releases else "would"  # a release: if the client is asked (DRFA's set U)
        return epsilon, f"{verb} spend {{eps}} for client {cid}"

    @staticmethod
    def _runs(fed: FederationView, rnd: Round) -> dict[int, int]:
        """How many times each client of ``rnd``'s cohort trains: its draws, or once (``algo.duplicates``)."""
        return dict(rnd.draws) if fed.cfg.duplicates == "repeat" else dict.fromkeys(rnd.cohort, 1)

    def _worst(self, steps: dict[int, int]) -> tuple[float, int]:
        """The largest :math:`\\varepsilon` of the clients after ``steps`` (client: its steps), and that client (ties:
        the larger id). Only the clients no other one dominates are asked, since a call costs the accountant ~10 ms
        and a round would ask every client: epsilon grows with the steps and, under Poisson sampling (one
        :math:`\\sigma`), with :math:`q_i`, so a client with a :math:`q_i` and steps both at most another's cannot
        be worse off; with ``fixed`` only clients of the same :math:`(n_i, B)` are compared."""
        p = self.params
        most: dict[privacy.Mechanism | None, int] = {}  # per comparable group: the most steps among those ranked above
        front = []
        for cid in sorted(steps, key=lambda c: (-self._mechanism(c).q, -steps[c], -c)):
            mech = self._mechanism(cid)
            group = None if p.sampling == "poisson" else mech
            if most.get(group, -1) >= steps[cid]:
                continue
            most[group] = steps[cid]
            front.append((mech, steps[cid], cid))
        return max(((privacy.epsilon(m, k, p.delta, p.accountant), c) for m, k, c in front), default=(0.0, -1))

    def _per_round(self, cid: int) -> int:
        """The events calibration plans client ``cid`` to add to its ledger in each round: its steps in
        ``privacy.runs_per_round`` runs, and its loss releases. A client drawn more often than that
        (``algo.duplicates=repeat`` trains it once per draw) meets the round check, which counts its real draws."""
        return self.plan[cid] * self.params.runs_per_round + self.releases

    # ------------------------------------------------------------------ released losses
    @torch.no_grad()
    def release_loss(self, fed: FederationView, cid: int, state: dict[str, Tensor], round_idx: int) -> float:
        """Client ``cid``'s loss at ``state`` released as a DP-SGD step releases a gradient: rows drawn as a step's
        batch (from a ``(seed, round, client)`` stream), each row's loss clipped to ``[0, L]``
        (``privacy.loss_clip``), the sum noised with :math:`\\mathcal N(0, \\sigma^2 L^2)` and divided by
        :math:`\\min(B, n_i)`: the same event as one step (sensitivity :math:`L`, noise :math:`\\sigma L`), booked in
        the client's ledger."""
        n = self.sizes.get(cid, 0)
        if not n:
            return 0.0
        gen = torch.Generator().manual_seed(derive_seed(fed.cfg.seed, round_idx, cid, _LOSS_TAG))
        rows = self._draw(fed.data.client_indices[cid], gen)
        total = 0.0
        if len(rows):
            x, y = fed.batch(rows)
            with fed.step_context():
                losses = torch.func.vmap(lambda xj, yj: fed.loss_fn(_call(fed.net, state, xj), yj[None]))(x, y)
            total = float(losses.double().clamp(0.0, self.params.loss_clip).sum())
        z = float(torch.randn((), generator=gen, dtype=torch.float64))
        self.steps[cid] = self.steps.get(cid, 0) + 1
        return (total + z * self._sigma * self.params.loss_clip) / min(self.batch_size, n)

    # ------------------------------------------------------------------ the local steps
    @override
    def on_client_start(self, fed: FederationView, client: ClientContext) -> None:
        device = fed.params[0].device
        seed = derive_seed(fed.cfg.seed, client.round.round, client.cid, client.copy, _NOISE_TAG)
        client.extras[_NOISE] = torch.Generator(device).manual_seed(seed)

    @override
    def sample_batch(self, fed: FederationView, client: ClientContext) -> Tensor:
        return self._draw(fed.data.client_indices[client.cid], client.generator)

    def _draw(self, rows: Tensor, gen: torch.Generator) -> Tensor:
        """A step's batch of ``rows``: Poisson with rate :math:`\\min(1, B / n_i)`, or :math:`\\min(B, n_i)` rows
        without replacement (``privacy.sampling``); drawn on the host, as the other streams are."""
        if self.params.sampling == "fixed":
            return fresh_rows(rows, self.batch_size, gen)
        keep = torch.rand(len(rows), generator=gen) < min(1.0, self.batch_size / len(rows))
        return rows[keep.to(rows.device)]

    @override
    def local_grad(self, fed: FederationView, client: ClientContext) -> Tensor:
        if client.batch is None:
            raise RuntimeError("LocalDP.local_grad: the step's batch is set before local_grad")
        x, y = client.batch
        params = tuple(p.detach() for p in fed.params)
        if len(y):
            summed, losses = self._clipped_rows(params, x, y)
            loss = losses.mean()
        else:  # an empty Poisson draw: the step is noise alone
            summed, loss = [torch.zeros_like(p) for p in params], params[0].new_zeros(())
        grads = self._noised(summed, [client], 0)
        for p, g in zip(fed.params, grads):
            p.grad = g
        return loss

    @override
    def cohort_grad(self, fed: FederationView, cohort: Cohort) -> tuple[Tensor, list[Tensor]]:
        params = tuple(p.detach().contiguous() for p in cohort.params)  # a folded net stores weights transposed
        m, rows = len(cohort.clients), cohort.rows
        if rows is None:
            raise RuntimeError("LocalDP.cohort_grad: the step's rows are set before cohort_grad")
        if rows.shape[1] and self._linear is not None:  # client by client, each without per-row gradients
            x, y = fed.data.x[rows], fed.data.y[rows]
            done = [
                self._clipped_rows(tuple(p[i] for p in params), x[i, :s], y[i, :s]) for i, s in enumerate(cohort.sizes)
            ]
            summed = [torch.stack(g) for g in zip(*(d[0] for d in done))]
            loss = torch.stack([d[1].mean() if len(d[1]) else d[1].new_zeros(()) for d in done])
        elif rows.shape[1]:
            sizes = torch.tensor(cohort.sizes).to(params[0].device, non_blocking=True)
            grads, losses = self._stacked_rows(params, fed.data.x[rows], fed.data.y[rows])  # (m, B, ...), (m, B)
            mask = torch.arange(rows.shape[1], device=sizes.device) < sizes[:, None]  # padding rows count for nothing
            summed = clipped_sum(list(grads), self.params.clip, 2, mask, self.per_layer)
            loss = (losses * mask).sum(1) / sizes.clamp_min(1).to(losses.dtype)
        else:
            summed, loss = [torch.zeros_like(p) for p in params], params[0].new_zeros(m)
        return loss, self._noised(summed, cohort.clients, 1)

    def _clipped_rows(self, params: tuple[Tensor, ...], x: Tensor, y: Tensor) -> tuple[list[Tensor], Tensor]:
        """One client's :math:`\\sum_j \\mathrm{clip}(g_j)` over its rows ``x, y`` and their losses ``(B,)``: from the
        linear layers' activations for a net of row-wise linear layers (:class:`LinearRows`), else from per-row
        gradients (:func:`flx.autodiff.row_grads`)."""
        clip, per_layer = self.params.clip, self.per_layer
        if not len(y):
            return [torch.zeros_like(p) for p in params], params[0].new_zeros(0)
        if self._linear is not None:
            try:
                return self._linear.clipped_sum(params, x, y, clip, per_layer)
            except NotRowwise:  # a layer saw sequences: per-row gradients from now on
                self._linear = None
        grads, losses = self._rows(params, x, y)
        return clipped_sum(list(grads), clip, 1, per_layer=per_layer), losses

    def _noised(self, summed: list[Tensor], clients: list[ClientContext], stacked: int) -> list[Tensor]:
        """``(sum + N(0, sigma^2 C^2 I)) / min(B, n_i)`` for each client; ``summed`` has a leading client dimension
        when ``stacked``. Each client draws from its own generator, tensor by tensor."""
        std = self._sigma * self.params.clip
        denominators = [float(min(self.batch_size, self.sizes[c.cid])) for c in clients]
        if stacked:  # one (m,) tensor, made on the host once a step (docs/loop.md#devices)
            per_client = torch.tensor(denominators, dtype=summed[0].dtype).to(summed[0].device, non_blocking=True)
        out = []
        for s in summed:
            shape = s.shape[stacked:]
            z = [torch.randn(shape, generator=c.extras[_NOISE], device=s.device, dtype=s.dtype) for c in clients]
            if stacked:
                out.append((s + torch.stack(z) * std) / per_client.view(-1, *[1] * len(shape)))
            else:
                out.append((s + z[0] * std) / denominators[0])
        return out

    # ------------------------------------------------------------------ budget, logging, checkpoint
    @override
    def state_dict(self) -> dict[str, Any]:
        ledger = {"rounds": self.rounds, "rounds_run": self.rounds_run, "epsilon": self.spent()}
        return {"sigma": self.sigma, "steps": dict(self.steps), **ledger}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resumes the ledger: every client's steps and the noise multiplier (epsilon is recomputed from them)."""
        self.sigma, self.rounds = float(state_dict["sigma"]), int(state_dict["rounds"])
        self.steps = {int(k): int(v) for k, v in state_dict["steps"].items()}
        self.rounds_run = int(state_dict.get("rounds_run", self.rounds))  # a checkpoint of before the key: as many

    # ------------------------------------------------------------------ divergence
    @override
    def divergence_cause(self, fed: FederationView, step: int) -> str | None:
        """The noise, when it dominates the round's mean update: each client's gradient gets noise of std
        :math:`\\sigma C / B_i` per coordinate per step (:math:`B_i = \\min(B, n_i)`), L2 norm
        :math:`\\sigma C \\sqrt d / B_i`; in the mean update its norm is about :meth:`noise_norm`. The measured norm
        ``fed.update_norm(step)`` holds the noise too (:math:`U^2 \\approx S^2 + E^2`), so the noise dominates when
        :math:`2 E^2 > U^2`; else None (the optimizer is the cause)."""
        update, rnd = fed.update_norm(step), fed.rnd
        if update is None or rnd is None or not self.sizes:
            return None
        d = numel(fed.params)
        weights = {c: rnd.weights[c] * rnd.draws[c] for c in rnd.cohort if c in self.sizes}
        noise = self.noise_norm(d, fed.cfg.lr, {c: fed.client_steps(c) for c in weights}, weights)
        if not 2 * noise**2 > update**2:
            return None
        p, b = self.params, self.batch_size
        budget = (
            f"raise privacy.target_epsilon (now {p.target_epsilon:g})"
            if p.noise_multiplier is None
            else f"lower privacy.noise_multiplier (now {p.noise_multiplier:g})"
        )
        sigma = self._sigma
        return (
            f"the DP noise dominates the update: each client's gradient gets noise of std {sigma * p.clip / b:.3g}"
            f" per coordinate per step (sigma {sigma:.3g} x clip {p.clip:g} / B {b}), norm "
            f"{sigma * p.clip * d**0.5 / b:.3g} over d = {d}, ~{noise:.3g} in the round's mean update of norm "
            f"{update:.3g}; {budget}, lower privacy.clip (now {p.clip:g}) or raise algo.batch_size (now {b})"
        )

    def noise_norm(self, d: int, lr: float, steps: dict[int, int], weights: dict[int, float]) -> float:
        """The expected L2 norm of the noise in a round's mean update of ``d`` trainable entries, plain local SGD of
        step size ``lr``: client :math:`i` (aggregation weight :math:`p_i`, normalised) adds
        :math:`\\eta \\sum_k z_k \\sigma C / B_i` over its :math:`K_i` steps, so
        :math:`E = \\eta \\sigma C \\sqrt{d \\sum_i p_i^2 K_i / B_i^2}`."""
        total = sum(weights.values())
        spread = sum((w / total) ** 2 * steps[c] / min(self.batch_size, self.sizes[c]) ** 2 for c, w in weights.items())
        return lr * self._sigma * self.params.clip * (d * spread) ** 0.5


def _call(net: nn.Module, state: dict[str, Tensor], x: Tensor) -> Tensor:
    """The net at ``state`` on one row ``x``, as a batch of one."""
    return torch.func.functional_call(net, state, (x[None],))
