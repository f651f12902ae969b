"""The plain-PyTorch side of the whole-process benchmark: one Python process that does what ``python train.py`` does
for a workload, by hand: import torch, load and split the data, partition it over the clients, build the model, run
the FedAvg rounds (``plain.fedavg``), report the test accuracy (in batches of 1024, as flx's test).

Usage (from ``run.py``): ``python scripts/bench/plain_process.py --workload b --rounds 100 --threads 1 --out m.json``.
It writes ``{"train_start", "train_end", "test_acc"}`` (epoch seconds) to ``--out``. The workload's settings are
read from the same flx overrides as the flx side (``workloads.py``); only the model class comes from flx
(``flx.models.nets``: torch only, no Lightning).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import numpy as np
import torch
from plain import FedAvgSpec, OwnRandomness, fedavg
from workloads import EVERY

from flx.models import nets


def settings(overrides: tuple[str, ...]) -> dict[str, str]:
    """``key=value`` overrides as a dict."""
    return dict(o.split("=", 1) for o in overrides)


def load(s: dict[str, str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """Train and test inputs and labels: digits (stratified 80/20, z-scored with the train rows' statistics, as
    flx's ``data=digits``) or synthetic Gaussian inputs of ``data.loader.input_shape``."""
    if s["data"] == "digits":
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        bunch = load_digits()
        x_tr, x_te, y_tr, y_te = train_test_split(
            bunch.images[:, None].astype(np.float32), bunch.target, test_size=0.2, stratify=bunch.target, random_state=0
        )
        mean, std = x_tr.mean((0, 2, 3), keepdims=True), x_tr.std((0, 2, 3), keepdims=True)
        x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
        return torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_te), torch.from_numpy(y_te), (1, 8, 8)
    shape = tuple(json.loads(s["data.loader.input_shape"]))
    n, test = int(s["data.loader.num_samples"]), 1000  # flx's data=synthetic: num_samples, then test_samples
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n + test, *shape, generator=g), torch.randint(0, 10, (n + test,), generator=g)
    return x[:n], y[:n], x[n:], y[n:], shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, choices=list(EVERY))
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0: torch's default")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    s = settings(EVERY[args.workload].overrides)
    x, y, x_test, y_test, shape = load(s)
    val = int(0.1 * len(x))  # the validation carve flx makes (its rows train nobody)
    x, y = x[val:], y[val:]
    num_clients = int(s["partition.num_clients"])
    clients = list(torch.from_numpy(np.random.default_rng(0).permutation(len(x))).tensor_split(num_clients))
    net_class = {"logreg": nets.LogisticRegression, "mlp": nets.MLP, "cnn": nets.CNN}[s["model"]]
    net = net_class(input_shape=shape, num_classes=10)
    spec = FedAvgSpec(
        rounds=args.rounds,
        clients_per_round=int(s["algo.clients_per_round"]),
        batch_size=int(s["algo.batch_size"]),
        lr=0.05,  # algo.lr of configs/algo/fedavg.yaml, the default
        local_steps=int(s.get("algo.local_steps", 10)),
        local_epochs=int(s["algo.local_epochs"]) if "algo.local_epochs" in s else None,
        seed=0,
    )
    importlib.import_module("torch._dynamo")  # torch.optim imports it at its first step, flx at start-up: start-up

    marks = {"train_start": time.time()}
    fedavg(net, x, y, clients, spec, OwnRandomness(spec.seed))
    marks["train_end"] = time.time()
    with torch.no_grad():
        net.eval()
        hits = sum(int((net(xb).argmax(1) == yb).sum()) for xb, yb in zip(x_test.split(1024), y_test.split(1024)))
        marks["test_acc"] = hits / len(y_test)  # in batches of 1024, flx's data.eval_batch_size
    with open(args.out, "w") as f:
        json.dump(marks, f)


if __name__ == "__main__":
    main()
