"""The modeled step time: the slowest rank's summed s + s^2 / k, with worked examples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.step_time import assign_work, rank_times, step_times


def test_a_worked_step():
    # k = 100: a sequence of 100 tokens costs 100 + 100 = 200; of 50, 50 + 25 = 75.
    bins = [[100], [50, 50], [50], []]
    ranks = [[0, 3], [1, 2]]
    assert rank_times(bins, ranks, 100.0).tolist() == [200.0, 225.0]
    times = step_times([(bins, ranks), ([[100], [100]], [[0], [1]])], 100.0)
    assert times.slowest.tolist() == [225.0, 200.0]
    assert times.mean_rank.tolist() == [212.5, 200.0]
    assert times.cv == pytest.approx(12.5 / 212.5)
    assert times.imbalance == pytest.approx(212.5 / 206.25)


def test_equal_tokens_are_unequal_work():
    # Both ranks hold 200 tokens; one as a single sequence, whose attention costs more.
    times = rank_times([[200], [100, 100]], [[0], [1]], 100.0)
    assert times[0] > times[1]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 5000), min_size=0, max_size=4), min_size=1, max_size=24),
       st.integers(1, 6))
def test_step_time_is_the_slowest_rank_and_no_less_than_the_mean(bins, dp):
    while len(bins) % dp:
        bins.append([])
    _, ranks = assign_work(bins, dp, 5000, "karmarkar_karp")
    times = rank_times(bins, ranks)
    total = sum(s + s * s / 24576.0 for b in bins for s in b)
    assert times.sum() == pytest.approx(total)
    run = step_times([(bins, ranks)])
    assert run.slowest[0] == pytest.approx(times.max())
    assert run.imbalance >= 1.0 - 1e-12
    assert run.cv == 0.0  # one step: no spread across steps
    assert np.isclose(run.mean_rank[0], total / dp)


def test_a_reference_plan_is_handed_out_as_the_sampler_would():
    # k huge: costs are the lengths. Whole bins leave rank 0 at 9 and rank 1 at 1; rebalanced,
    # the 4 moves into bin 1 (same bins per rank, within the capacity 10): 5 and 5.
    bins = [[5, 4], [1]]
    whole, ranks = assign_work(bins, 2, 10, "karmarkar_karp", 1e12)
    assert whole == bins and ranks == [[0], [1]]
    moved, moved_ranks = assign_work(bins, 2, 10, "rebalanced", 1e12)
    assert moved == [[5], [1, 4]] and moved_ranks == ranks
    assert rank_times(moved, ranks, 1e12).tolist() == pytest.approx([5.0, 5.0])
    # Round robin keeps bin i on rank i % dp.
    assert assign_work([[1], [2], [3], [4]], 2, 10, "round_robin")[1] == [[0, 2], [1, 3]]
