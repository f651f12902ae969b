"""Replayable per-round conditions: link rates switch by a Markov chain, background load is uniform on
``(load_min, 1]``, and every value is a function of ``(trace_seed, device, round)`` only."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from flx.systems.params import SystemParams
from flx.systems.simulator import LatencySimulator
from flx.systems.traces import CHUNK, Traces

DEVICES, ROUNDS = 20, 300


def table(traces: Traces, order: list[tuple[int, int]]) -> dict[tuple[int, int], tuple[float, float]]:
    return {(d, r): (traces.link_rate(d, r), traces.load(d, r)) for d, r in order}


def grid() -> list[tuple[int, int]]:
    return [(d, r) for d in range(DEVICES) for r in range(ROUNDS)]


def test_same_seed_same_trace_in_any_query_order() -> None:
    """A run that queries round 250 first (a resumed run) sees what a run that went round by round saw."""
    forward = table(Traces(SystemParams()), grid())
    shuffled = grid()
    random.Random(1).shuffle(shuffled)
    assert table(Traces(SystemParams()), shuffled) == forward
    other = table(Traces(SystemParams(trace_seed=1)), grid())
    assert other != forward


def test_two_algorithms_see_identical_conditions() -> None:
    """The trace ignores what a run does: its batch size and local steps, its cohorts (which devices it asks about),
    and the global numpy / torch / random streams it draws from."""
    fedavg = LatencySimulator(batch_size=32, local_steps=10)
    drfa = LatencySimulator(batch_size=8, local_steps=3)
    seen_fedavg = {(d, r): (fedavg.link_rate(d, r), fedavg.load(d, r)) for d, r in grid()}
    seen_drfa = {}
    for d, r in reversed(grid()):
        np.random.rand(3), torch.rand(2), random.random()  # an algorithm's own draws
        seen_drfa[d, r] = (drfa.link_rate(d, r), drfa.load(d, r))
    assert seen_drfa == seen_fedavg


def test_markov_switching_stays_in_the_rates_and_switches_with_probability_p() -> None:
    """Over ``N`` transitions the switch count is Binomial(N, p): within 5 standard deviations of ``N p``; a switch
    lands uniformly on one of the other ``n - 1`` rates (from each rate, each other rate ~ p / (n - 1))."""
    p, rounds = 0.3, 2000
    traces = Traces(SystemParams(switch_prob=p))
    rates = {80e6, 20e6, 10e6}
    switches, moves = 0, {}
    for d in range(DEVICES):
        chain = [traces.link_rate(d, r) for r in range(rounds)]
        assert set(chain) <= rates
        for a, b in zip(chain[:-1], chain[1:]):
            switches += a != b
            if a != b:
                moves[a, b] = moves.get((a, b), 0) + 1
    n = DEVICES * (rounds - 1)
    assert abs(switches - n * p) < 5 * math.sqrt(n * p * (1 - p))
    for a in rates:
        out = [moves.get((a, b), 0) for b in rates - {a}]
        total = sum(out)
        assert abs(out[0] - total / 2) < 5 * math.sqrt(total / 4), (a, out)


@pytest.mark.parametrize(("p", "switches"), [(0.0, 0), (1.0, DEVICES * (ROUNDS - 1))])
def test_switch_probability_extremes(p: float, switches: int) -> None:
    traces = Traces(SystemParams(switch_prob=p))
    chains = [[traces.link_index(d, r) for r in range(ROUNDS)] for d in range(DEVICES)]
    assert sum(a != b for c in chains for a, b in zip(c[:-1], c[1:])) == switches
    assert [c[0] for c in chains] == [traces.initial_link(d) for d in range(DEVICES)]


def test_load_is_uniform_on_its_interval() -> None:
    """``u = 1 - (1 - u_min) U``: in ``(u_min, 1]``, mean ``(1 + u_min) / 2``; ``u_min = 1`` is no load."""
    u_min = 0.4
    traces = Traces(SystemParams(load_min=u_min))
    loads = np.array([traces.load(d, r) for d, r in grid()])
    assert loads.min() > u_min and loads.max() <= 1.0
    assert abs(loads.mean() - (1 + u_min) / 2) < 5 * (1 - u_min) / math.sqrt(12 * loads.size)
    no_load = Traces(SystemParams(load_min=1.0))
    assert {no_load.load(d, r) for d, r in grid()} == {1.0}


def test_static_dynamics_keep_the_initial_link_and_no_load() -> None:
    traces = Traces(SystemParams(dynamics="static", switch_prob=1.0))
    for d, r in grid():
        assert traces.link_index(d, r) == traces.initial_link(d)
        assert traces.load(d, r) == 1.0


def test_chunks_join_without_a_seam() -> None:
    """The chain continues across the generator chunks (a switch at the boundary is a normal transition)."""
    traces = Traces(SystemParams(switch_prob=1.0))
    chain = [traces.link_index(0, r) for r in range(3 * CHUNK)]
    assert all(a != b for a, b in zip(chain[:-1], chain[1:]))
