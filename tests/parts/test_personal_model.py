r"""The personalised model of FedAvg (the global model) and of FedProx (the client's last local model).

FedProx's local update on the full batch is :math:`w_{k+1} = w_k - \eta(\nabla f(w_k) + \mu(w_k - w^t))`
(``least_squares`` gives :math:`\nabla f`); with ``model=local`` client :math:`i`'s personalised model is its
:math:`w_K` from the last round it trained.
"""

from __future__ import annotations

import torch
from helpers import linear, make_fed, raises_one_line, run_rounds
from least_squares import f64, flat, grad, mse, regression, xt

from flx.datamodules.client_eval import ClientRows
from flx.parts.personalisation.personal_model import PersonalModel
from flx.parts.proximal.prox import Prox


def test_global_model_is_fedavgs_personalised_model() -> None:
    """evaluate_clients with model=global gives each client's loss under the global model."""
    data = regression([5, 6, 7])
    fed = make_fed(linear(3, 1, dtype=f64), data, [PersonalModel("global")], loss_fn=mse, clients_per_round=2)
    run_rounds(fed, 1)
    w = flat(fed.params)
    evaluation = ClientRows(data.x, data.y, data.client_indices)
    got = fed.evaluate_clients(evaluation, mse)
    expected = torch.stack([((xt(x) @ w - y.reshape(-1)) ** 2).mean() for x, y in evaluation])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-14)


def test_local_model_is_fedprox_local_solution_from_the_clients_last_round() -> None:
    mu, eta, k = 0.7, 0.2, 3
    data = regression([6, 8, 5])
    kw = dict(clients_per_round=2, local_steps=k, batch_size=64, lr=eta, seed=1)
    fed = make_fed(linear(3, 1, dtype=f64), data, [Prox(mu), PersonalModel("local")], loss_fn=mse, **kw)
    w0 = flat(fed.params)
    rnd = fed.begin_round(0)
    for cid in rnd.shard:
        fed.train_client(cid)
    fed.end_round()
    w1 = flat(fed.params)
    for cid in range(3):
        expected = w1  # a client not in round 0's cohort: the global model
        if cid in rnd.cohort:
            x, y, expected = data.x[data.client_indices[cid]], data.y[data.client_indices[cid]], w0.clone()
            for _ in range(k):
                expected = expected - eta * (grad(x, y, expected) + mu * (expected - w0))
        with fed.personalize(cid):
            torch.testing.assert_close(flat(fed.params), expected, rtol=0, atol=1e-12)
        assert torch.equal(flat(fed.params), w1)


def test_unknown_model_stops_with_one_line() -> None:
    raises_one_line(PersonalModel, "finetune", match="algo.personal_model")
