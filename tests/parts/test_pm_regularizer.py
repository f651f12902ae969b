r"""AugFL's server step (Eq. 13) with the PM: :math:`\theta^{t+1} = \text{mean} - \lambda G^t / \sum_i \rho` with
:math:`G^t = \nabla_\theta R_h(\theta^t, \theta_p)` on the server rows, checked against autograd by hand for the logit
KD option and the authors'-code recipe; CRD's heads learn across rounds and resume from the part's ``state_dict``."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from helpers import make_fed, run_rounds, toy_data

from flx.datamodules.datamodule import ClientStore
from flx.losses.distill import logit_kd
from flx.models.nets import MLP
from flx.parts.meta_learning.meta_update import MetaUpdate
from flx.parts.meta_learning.pm_regularizer import PMRegularizer
from flx.resources import ServerResources

RHO, LAM = 2.0, 0.7


def _net(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(input_shape=[5], num_classes=3, hidden=[6]).to(torch.float64)


def _setup(pm_part: PMRegularizer, rounds: int = 0):
    """Clients 0-3 train (support = first half of their rows); client 4's rows are the server split."""
    data = toy_data([7, 9, 6, 8, 12], dtype=torch.float64)
    rows = data.client_indices
    store = ClientStore(data.x, data.y, rows[:4], client_support=[r[: len(r) // 2] for r in rows[:4]])
    pm = _net(7).requires_grad_(False).eval()
    resources = ServerResources(rows[4], {"pm": pm})
    kw = dict(clients_per_round=4, local_steps=0, aggregator="admm_sum", weighting="uniform", lr=1.0)
    fed = make_fed(_net(), store, [MetaUpdate(alpha=0.1, rho=RHO), pm_part], resources=resources, **kw)
    run_rounds(fed, rounds)
    return fed, store, pm, rows[4]


def _mean_after_clients(fed) -> list[torch.Tensor]:
    """The ADMM mean of one round without the PM term: the same run with lam = 0."""
    twin, *_ = _setup(PMRegularizer(lam=0.0))
    with torch.no_grad():
        torch._foreach_copy_(twin.params, fed.params)
    run_rounds(twin, 1)
    return [q.detach().clone() for q in twin.params]


def test_kd_server_step_is_the_mean_minus_lam_grad_over_sum_rho() -> None:
    """One server batch (batch_size >= D_s): G = grad of T^2 KL(p_pm || p_theta) at theta^t, in train mode."""
    fed, store, pm, server_rows = _setup(PMRegularizer(lam=LAM, rh="kd", batch_size=64, kd_temperature=2.0))
    theta = [q.detach().clone() for q in fed.params]
    mean = _mean_after_clients(fed)
    net = copy.deepcopy(fed.net).train()
    x = store.x[server_rows]
    g = torch.autograd.grad(logit_kd(net(x), pm(x), 2.0), list(net.parameters()))
    run_rounds(fed, 1)
    for got, m, gk, t in zip(fed.params, mean, g, theta):
        torch.testing.assert_close(got.detach(), m - LAM * gk / (4 * RHO), rtol=0, atol=1e-12)
        assert not torch.equal(got.detach(), t)


def test_code_gradient_with_no_rh_weight_and_a_tiny_step_is_the_ce_gradient() -> None:
    """The authors' recipe (CE + 0.8 R_h along one epoch of SGD): with rh_weight 0 and a negligible step the mean of
    the minibatch gradients is the cross-entropy gradient at theta^t."""
    part = PMRegularizer(lam=LAM, rh="kd", gradient="code", batch_size=64, rh_weight=0.0, head_lr=1e-300)
    fed, store, _, server_rows = _setup(part)
    mean = _mean_after_clients(fed)
    net = copy.deepcopy(fed.net).train()
    g = torch.autograd.grad(F.cross_entropy(net(store.x[server_rows]), store.y[server_rows]), list(net.parameters()))
    run_rounds(fed, 1)
    for got, m, gk in zip(fed.params, mean, g):
        torch.testing.assert_close(got.detach(), m - LAM * gk / (4 * RHO), rtol=0, atol=1e-12)


def test_crd_heads_learn_and_resume_from_the_state_dict() -> None:
    """CRD on the penultimate features: the heads and banks change every round; a fresh part loaded with the
    state_dict after round 2 continues exactly as the uninterrupted run (global model and CRD state)."""
    crd = {"feat_dim": 4, "num_negatives": 5}
    whole, *_ = _setup(PMRegularizer(lam=LAM, rh="crd", batch_size=4, crd=crd))
    run_rounds(whole, 2)
    state = copy.deepcopy(whole.parts[1].state_dict())
    head0 = state["crd"]["head_s.weight"].clone()
    run_rounds(whole, 1, start=2)
    assert not torch.equal(whole.parts[1].crd.head_s.weight.detach(), head0)

    resumed, *_ = _setup(PMRegularizer(lam=LAM, rh="crd", batch_size=4, crd=crd))
    run_rounds(resumed, 2)  # the same first two rounds (deterministic), then the CRD state from the checkpoint
    resumed.parts[1].load_state_dict(state)
    run_rounds(resumed, 1, start=2)
    assert all(torch.equal(a, b) for a, b in zip(resumed.params, whole.params))
    for k, v in whole.parts[1].state_dict()["crd"].items():
        torch.testing.assert_close(resumed.parts[1].state_dict()["crd"][k], v, rtol=0, atol=0, equal_nan=True)
