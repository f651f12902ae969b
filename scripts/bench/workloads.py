"""The benchmark workloads: one FedAvg setting, expressed once as flx overrides and once for the plain loop."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Workload:
    """One FedAvg setting, run by flx and by the plain loop.

    Attributes:
        key: short name (``a``, ``b``, ``c``).
        title: what it is, for the table.
        overrides: flx command-line overrides (data, model, partition, algo) without the round count.
        rounds: rounds per measurement (a few seconds each).
        quick_rounds: rounds per measurement with ``--quick``.
        repeats: timed runs per side.
        check_rounds: rounds of the untimed flx-vs-plain equivalence run (same cohorts and batches).
        target: the acceptance bound on the flx / plain time ratio.
    """

    key: str
    title: str
    overrides: tuple[str, ...]
    rounds: int
    quick_rounds: int
    repeats: int
    check_rounds: int
    target: float


WORKLOADS: dict[str, Workload] = {
    "a": Workload(
        key="a",
        title="cnn synthetic 3x32x32, 1000 clients x 50, 50/round, B=10, 1 epoch",
        overrides=(
            "data=synthetic",
            "data.loader.num_samples=50000",
            "data.loader.input_shape=[3,32,32]",
            "model=cnn",
            "partition=iid",
            "partition.num_clients=1000",
            "algo.clients_per_round=50",
            "algo.batch_size=10",
            "algo.local_epochs=1",
        ),
        rounds=2,
        quick_rounds=1,
        repeats=5,
        check_rounds=1,
        target=1.05,
    ),
    "b": Workload(
        key="b",
        title="logreg digits, 100 clients, 20/round, B=32, 5 steps",
        overrides=(
            "data=digits",
            "model=logreg",
            "partition=iid",
            "partition.num_clients=100",
            "algo.clients_per_round=20",
            "algo.batch_size=32",
            "algo.local_steps=5",
        ),
        rounds=100,
        quick_rounds=20,
        repeats=5,
        check_rounds=20,
        target=1.3,
    ),
}

# the overhead-bound setting of the peers' comparison (pfl-research's and flx's defaults against the plain loop): (b)
# with minibatches of 10, rounds of ~20 ms, where what flx does around the clients (logging, progress, checkpoints)
# shows most
WORKLOADS["c"] = replace(
    WORKLOADS["b"],
    key="c",
    title="logreg digits, 100 clients, 20/round, B=10, 5 steps",
    overrides=tuple("algo.batch_size=10" if o == "algo.batch_size=32" else o for o in WORKLOADS["b"].overrides),
    target=1.15,
)

# measured by some sections only (``threads.py``); ``plain_process.py`` runs any of these too
MAKE_TRAIN = Workload(
    key="mlp",
    title="mlp 200-200 digits, 20 clients, 10/round, B=32, 10 steps (make train's setting, iid)",
    overrides=(
        "data=digits",
        "model=mlp",
        "partition=iid",
        "partition.num_clients=20",
        "algo.clients_per_round=10",
        "algo.batch_size=32",
        "algo.local_steps=10",
    ),
    rounds=100,
    quick_rounds=30,
    repeats=3,
    check_rounds=5,
    target=1.05,
)
EVERY: dict[str, Workload] = {**WORKLOADS, MAKE_TRAIN.key: MAKE_TRAIN}
