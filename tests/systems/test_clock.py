"""The simulated clock inside the round protocol (no Lightning): ``T_r = max`` over the round's clients at the widths
parts record with ``rnd.set_width``, ``clock = sum_r T_r``, saved and restored with ``Federation.state_dict``."""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from helpers import linear, run_rounds, toy_data

from flx.federation import Federation, FederationConfig, FederationSpec
from flx.hooks import FederatedCallback
from flx.parts.proximal.prox import Prox
from flx.systems.clock import SimClock
from flx.systems.simulator import LatencySimulator

SIZES = [12, 9, 0, 15, 7, 11]  # client 2 has no rows: skipped, so it costs no time
WIDTHS = (1.0, 0.5, 0.25, 0.125, 0.0625)


def make(system: LatencySimulator | None, parts=(), **cfg) -> Federation:
    settings = {"clients_per_round": 4, "local_steps": 2, "batch_size": 4, "seed": 3, **cfg}
    return Federation(
        FederationSpec(FederationConfig(**settings), system=system), linear(), toy_data(SIZES), F.cross_entropy, parts
    )


class Scheduler(FederatedCallback):
    """Test part: gives client ``i`` width ``WIDTHS[(i + round) % 5]`` at round start; records what the round saw."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, tuple[int, ...], dict[int, float], float]] = []
        self.seen: dict[tuple[int, int], float] = {}

    def on_round_start(self, fed, rnd) -> None:
        for c in rnd.cohort:
            rnd.set_width(c, WIDTHS[(c + rnd.round) % 5])

    def on_client_start(self, fed, client) -> None:
        self.seen[client.round.round, client.cid] = client.round.width(client.cid)
        with pytest.raises(RuntimeError, match="on_round_start"):
            client.round.set_width(client.cid, 0.5)  # a client hook runs on one rank only

    def on_round_end(self, fed, rnd) -> None:
        widths = {c: rnd.width(c) for c in rnd.cohort}
        self.rounds.append((rnd.round, rnd.cohort, widths, fed.clock.round_time))


def test_round_time_is_the_max_over_the_trained_cohort_and_the_clock_their_sum() -> None:
    sim = LatencySimulator(batch_size=4, local_steps=2)
    part = Scheduler()
    fed = make(sim, [part], clients_per_round=6)
    run_rounds(fed, 4)
    total = 0.0
    for r, cohort, widths, round_time in part.rounds:
        trained = [c for c in cohort if SIZES[c] > 0]
        assert widths == {c: WIDTHS[(c + r) % 5] for c in cohort}
        assert round_time == max(sim.device_time(c, r, widths[c], 2) for c in trained)
        assert all(part.seen[r, c] == widths[c] for c in trained)
        total += round_time
    assert fed.clock.elapsed == total > 0


def test_a_skipped_client_costs_no_time() -> None:
    """Client 2 has no rows: at full width it would be the slowest by far, but it never trains."""

    class Narrow(FederatedCallback):
        def on_round_start(self, fed, rnd) -> None:
            for c in rnd.cohort:
                rnd.set_width(c, 1.0 if c == 2 else 0.0625)

    sim = LatencySimulator(batch_size=4, local_steps=2)
    fed = make(sim, [Narrow()], clients_per_round=6)
    run_rounds(fed, 1)
    assert fed.faults.skipped == (2,)
    assert fed.clock.round_time == max(sim.device_time(c, 0, 0.0625, 2) for c in (0, 1, 3, 4, 5))
    assert fed.clock.round_time < sim.device_time(2, 0, 1.0, 2)


def test_widths_default_to_the_full_model_each_round() -> None:
    sim = LatencySimulator(batch_size=4, local_steps=2)
    fed = make(sim)
    run_rounds(fed, 2)
    cohort = [c for c in fed.rnd.cohort if SIZES[c] > 0]
    assert fed.clock.round_time == max(sim.device_time(c, 1, 1.0, 2) for c in cohort)
    assert fed.rnd.width(cohort[0]) == 1.0


def test_local_epochs_price_each_client_by_its_own_steps() -> None:
    """``K_i = local_epochs * ceil(n_i / B)``: the federation passes each client's own count."""
    sim = LatencySimulator(batch_size=4, local_steps=2)
    fed = make(sim, local_epochs=1, clients_per_round=6)
    run_rounds(fed, 1)
    expected = max(sim.device_time(c, 0, 1.0, -(-n // 4)) for c, n in enumerate(SIZES) if n > 0)
    assert fed.clock.round_time == expected


def test_set_width_checks_the_ratio() -> None:
    class Bad(FederatedCallback):
        def __init__(self, ratio: float) -> None:
            self.ratio = ratio

        def on_round_start(self, fed, rnd) -> None:
            rnd.set_width(rnd.cohort[0], self.ratio)

    for ratio, match in ((0.0, "in \\(0, 1\\]"), (1.5, "in \\(0, 1\\]"), (0.3, "not profiled")):
        with pytest.raises(ValueError, match=match):
            run_rounds(make(LatencySimulator(4, 2), [Bad(ratio)]), 1)
    run_rounds(make(None, [Bad(0.3)]), 1)  # without a simulator any ratio in (0, 1] is recorded


def test_resume_continues_the_clock() -> None:
    """4 rounds straight == 2 rounds, ``state_dict``, a fresh federation loads it, 2 more rounds (bitwise)."""
    sim = lambda: LatencySimulator(batch_size=4, local_steps=2)  # noqa: E731
    straight = make(sim())
    run_rounds(straight, 4)
    first = make(sim())
    run_rounds(first, 2)
    state = first.state_dict()
    assert state["sim_clock"] == {"elapsed": first.clock.elapsed, "round_time": first.clock.round_time}
    resumed = make(sim())
    resumed.load_state_dict(state)
    assert resumed.clock.elapsed == first.clock.elapsed
    run_rounds(resumed, 2, start=2)
    assert resumed.clock.elapsed == straight.clock.elapsed
    assert "sim_clock" not in make(None).state_dict()


def test_fedavg_and_fedprox_runs_see_the_same_clock() -> None:
    """The trace does not depend on the algorithm: same seed, same cohorts, same widths -> the same clock."""
    fedavg, fedprox = make(LatencySimulator(4, 2)), make(LatencySimulator(4, 2), [Prox(mu=0.5)])
    times = []
    for fed in (fedavg, fedprox):
        per_round = []
        for r in range(3):
            run_rounds(fed, 1, start=r)
            per_round.append(fed.clock.round_time)
        times.append(per_round)
    assert times[0] == times[1] and fedavg.clock.elapsed == fedprox.clock.elapsed


def test_clock_state_roundtrip() -> None:
    clock = SimClock(LatencySimulator(4, 2))
    clock.advance(0, {0: 1.0, 1: 0.5})
    other = SimClock(LatencySimulator(4, 2))
    other.load_state_dict(clock.state_dict())
    assert (other.elapsed, other.round_time) == (clock.elapsed, clock.round_time) == (clock.round_time,) * 2
