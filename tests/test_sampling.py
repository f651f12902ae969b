r"""The two minibatch streams of ``algo.minibatch`` (flx.sampling.MINIBATCH_STREAMS), by their exact row multisets.

``epochs``: reshuffled passes, so the :math:`\lceil n / B \rceil` steps of one pass hold every row exactly once.
``fresh``: every step :math:`B` distinct rows drawn uniformly without replacement, independently across steps, so a
row's count over :math:`S` steps is :math:`\mathrm{Binomial}(S, B/n)` and two consecutive steps share a
hypergeometric number of rows, mean :math:`B^2/n`; a client with :math:`n < B` rows gets all of them every step.
Both come from the client's generator: a fresh step is ``rows[randperm(n)[:B]]`` of that generator below
``LAZY_MIN_ROWS`` rows.
"""

from __future__ import annotations

import math
import tracemalloc
from collections import Counter
from typing import Any

import pytest
import torch
from helpers import linear, make_fed, run_rounds, toy_data

from flx.context import FederationConfig
from flx.sampling import MINIBATCH_STREAMS, derive_seed, fresh_batches, local_batches

N, B = 128, 50  # the pFedFBE Lasso protocol's client: 128 rows, batch 50


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(n: int = N) -> torch.Tensor:
    return torch.arange(1000, 1000 + n)  # row ids that are not positions


def test_the_precheck_knows_every_stream() -> None:
    """checks.MINIBATCH (torch-free, for the pre-run check; flx.choices) names exactly the streams there are; epochs is
    the platform default."""
    from flx import checks

    assert tuple(MINIBATCH_STREAMS) == checks.MINIBATCH
    assert FederationConfig().minibatch == "epochs"


def test_epochs_one_pass_holds_every_row_exactly_once() -> None:
    """128 rows, B = 50: the 3 steps of a pass are 50, 50, 28 rows, together every row once; so are the next 3."""
    batches = list(local_batches(_rows(), B, 6, _gen()))
    assert [len(b) for b in batches] == [50, 50, 28] * 2
    for first in (0, 3):
        assert sorted(torch.cat(batches[first : first + 3]).tolist()) == _rows().tolist()


def test_fresh_steps_are_b_distinct_rows_of_the_client() -> None:
    """Every step: exactly B rows, all distinct, all the client's; no short batch (steps 3 and 6 are not 28 rows)."""
    batches = list(fresh_batches(_rows(), B, 200, _gen()))
    assert [len(b) for b in batches] == [B] * 200
    assert all(len(set(b.tolist())) == B and set(b.tolist()) <= set(_rows().tolist()) for b in batches)


def test_fresh_steps_are_independent_and_uniform() -> None:
    """S = 4000 steps of B = 50 of n = 128: each row's count is Binomial(S, p = B/n), mean 1562.5, sd 30.8, every
    count within 5 sd; two consecutive steps share a hypergeometric number of rows, mean B^2/n = 19.53, variance
    B p (1 - p) (n - B)/(n - 1) = 7.31, and the mean over the 3999 pairs is within 0.5 of 19.53 (about 6 standard
    errors of its mean), so rows do repeat across consecutive steps, as often as independent draws make them.
    Under epochs the steps of a pass share no row."""
    steps, p = 4000, B / N
    batches = [set(b.tolist()) for b in fresh_batches(_rows(), B, steps, _gen(1))]
    counts = Counter(r for b in batches for r in b)
    mean, sd = steps * p, math.sqrt(steps * p * (1 - p))
    assert set(counts) == set(_rows().tolist())
    assert max(abs(c - mean) for c in counts.values()) < 5 * sd
    overlap = [len(a & b) for a, b in zip(batches, batches[1:])]
    assert sum(overlap) / len(overlap) == pytest.approx(B * B / N, abs=0.5)
    passes = [set(b.tolist()) for b in local_batches(_rows(), B, 3, _gen(1))]
    assert not (passes[0] & passes[1]) and not (passes[1] & passes[2])


def test_fresh_gives_a_small_client_all_its_rows_each_step_in_fresh_orders() -> None:
    """n = 7 < B = 10: every step holds the 7 rows once each, in a new random order (not all 20 orders equal)."""
    batches = list(fresh_batches(_rows(7), 10, 20, _gen(2)))
    assert all(sorted(b.tolist()) == _rows(7).tolist() for b in batches)
    assert len({tuple(b.tolist()) for b in batches}) > 1


def test_fresh_steps_come_from_the_clients_generator() -> None:
    """Below LAZY_MIN_ROWS rows a fresh step is ``rows[randperm(n)[:B]]`` of the client's generator, step after step,
    and the generator ends where those draws leave it; the same seed gives the same stream, another seed another."""
    mine, ref = _gen(5), _gen(5)
    got = list(fresh_batches(_rows(), B, 4, mine))
    for batch in got:
        assert torch.equal(batch, _rows()[torch.randperm(N, generator=ref)[:B]])
    assert torch.equal(torch.rand(3, generator=mine), torch.rand(3, generator=ref))
    again = list(fresh_batches(_rows(), B, 4, _gen(5)))
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    assert not torch.equal(next(fresh_batches(_rows(), B, 1, _gen(6))), got[0])


def test_fresh_costs_its_batches_not_the_clients_size() -> None:
    """A client of 10**9 virtual rows (a range): 5 fresh steps of 10 rows take well under 1 MB (a randperm of the
    client would take 8 GB); each step's rows are distinct and inside the client."""
    rows = range(5 * 10**9, 6 * 10**9)
    tracemalloc.start()
    batches = list(fresh_batches(rows, 10, 5, _gen()))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 2**20 and [len(torch.unique(b)) for b in batches] == [10] * 5
    assert all(bool(((b >= rows.start) & (b < rows.stop)).all()) for b in batches)


def test_min_rows_only_asks_for_that_many_rows() -> None:
    """Fresh batches are never short: with min_rows = 2 (BatchNorm) a 3-row client with B = 2 gets 2 rows every step
    (epochs would leave each pass's 1-row batch out), and a 1-row client is refused as under epochs."""
    assert [len(b) for b in fresh_batches(_rows(3), 2, 6, _gen(), min_rows=2)] == [2] * 6
    assert [len(b) for b in local_batches(_rows(3), 2, 3, _gen(), min_rows=2)] == [2] * 3
    for stream in MINIBATCH_STREAMS.values():
        with pytest.raises(ValueError, match="min_rows=2"):
            next(stream(_rows(1), 2, 1, _gen(), 2))


@pytest.mark.parametrize("minibatch", list(MINIBATCH_STREAMS))
def test_a_fedavg_round_steps_on_the_configured_stream(minibatch: str) -> None:
    """One client (n = 11 rows, B = 4, K = 5), one FedAvg round of plain SGD on cross-entropy, redone by hand on the
    rows of ``MINIBATCH_STREAMS[minibatch]`` with the client's generator seeded by derive_seed(seed, 0, 0): the same
    model to rounding (float64), and under the other stream a different one."""
    seed, lr = 7, 0.2
    data = toy_data([11], dtype=torch.float64)

    def trained(stream: str) -> Any:
        fed = make_fed(linear(dtype=torch.float64), data, clients_per_round=1, local_steps=5, batch_size=4, lr=lr,
                       seed=seed, minibatch=stream)  # fmt: skip
        run_rounds(fed, 1)
        return fed

    fed = trained(minibatch)
    ref = linear(dtype=torch.float64)
    gen = _gen(derive_seed(seed, 0, 0))
    for rows in MINIBATCH_STREAMS[minibatch](data.client_indices[0], 4, 5, gen, 1):
        ref.zero_grad()
        torch.nn.functional.cross_entropy(ref(data.x[rows]), data.y[rows]).backward()
        with torch.no_grad():
            for q in ref.parameters():
                q -= lr * q.grad
    for got, want in zip(fed.net.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    other = trained(next(m for m in MINIBATCH_STREAMS if m != minibatch))
    assert not torch.allclose(next(other.net.parameters()), next(fed.net.parameters()))


FRESH_BY_DEFAULT = ["ditto", "fedavg_personal", "feddualavg", "fedmid", "fedprox_personal", "pfedfbe", "pfedme"]
"""The algorithms whose papers draw a minibatch at every local step (and the pFedFBE protocol's FedAvg and FedProx
baselines); docs/pfedfbe.md#minibatches quotes the passages."""


def test_each_algo_config_defaults_to_its_papers_stream(tmp_path) -> None:
    """Composed as train.py composes them: the pFedFBE paper's algorithm and its baselines default to fresh, every
    other config to the platform's epochs."""
    from flx.config import group_options, precheck

    got = {a: precheck([f"algo={a}", f"paths.output_dir={tmp_path}"]).algo.minibatch for a in group_options("algo")}
    assert {a for a, m in got.items() if m == "fresh"} == set(FRESH_BY_DEFAULT)
    assert set(got.values()) == {"epochs", "fresh"}
