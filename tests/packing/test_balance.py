"""DP rank assignment: equal counts, KK never worse than round robin, a worked example."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.balance import (
    DEFAULT_ATTENTION_COST_CONSTANT,
    assign_bins_to_ranks,
    bin_costs,
    imbalance,
    sequence_cost,
)


def test_sequence_and_bin_costs() -> None:
    assert DEFAULT_ATTENTION_COST_CONSTANT == 24576.0
    assert sequence_cost([24576]).tolist() == [2 * 24576.0]
    assert sequence_cost([100, 200], attention_constant=100).tolist() == [200.0, 600.0]
    costs = bin_costs([[0, 1], [], [2]], [100, 200, 300], attention_constant=100)
    assert costs.tolist() == [800.0, 0.0, 1200.0]
    # Same tokens, different work: one long sequence costs more than four short ones.
    one = bin_costs([[0]], [4096])[0]
    four = bin_costs([[0, 1, 2, 3]], [1024] * 4)[0]
    assert one > four


def test_worked_example() -> None:
    # Costs 8, 7, 6, 5, 4, 3 over 2 ranks. Rows (by cost): (8, 7), (6, 5), (4, 3), spreads
    # 1, 1, 1. Merge rows 0 and 1 (ties: lower row): {8+5, 7+6} = {13, 13}, spread 0.
    # Merge row 2 (spread 1) with it: heavy 4 with the lighter 13 ({7, 6}), 3 with {8, 5}:
    # {7, 6, 4} = 17 and {8, 5, 3} = 16.
    costs = [8, 7, 6, 5, 4, 3]
    ranks = assign_bins_to_ranks(costs, 2)
    assert ranks == [[0, 3, 5], [1, 2, 4]]
    assert imbalance(costs, ranks) == pytest.approx(17 / 16.5)
    assert assign_bins_to_ranks(costs, 2, method="round_robin") == [[0, 2, 4], [1, 3, 5]]
    assert imbalance(costs, [[0, 2, 4], [1, 3, 5]]) == pytest.approx(18 / 16.5)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 12),
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=96, max_size=96),
)
def test_kk_equal_counts_and_no_worse_than_round_robin(dp, per_rank, pool) -> None:
    costs = pool[: dp * per_rank]
    ranks = assign_bins_to_ranks(costs, dp)
    assert len(ranks) == dp
    assert all(len(r) == per_rank for r in ranks)
    assert sorted(i for r in ranks for i in r) == list(range(len(costs)))
    rr = assign_bins_to_ranks(costs, dp, method="round_robin")
    assert imbalance(costs, ranks) <= imbalance(costs, rr) + 1e-12
    assert assign_bins_to_ranks(costs, dp) == ranks  # deterministic


def test_kk_beats_round_robin_on_sorted_costs() -> None:
    rng = np.random.default_rng(0)
    costs = np.sort(rng.random(64))[::-1]  # sorted costs hurt round robin
    kk = imbalance(costs, assign_bins_to_ranks(costs, 8))
    rr = imbalance(costs, assign_bins_to_ranks(costs, 8, method="round_robin"))
    assert kk < rr
    assert kk < 1.01


def test_balance_errors() -> None:
    with pytest.raises(ValueError, match="multiple of dp_size"):
        assign_bins_to_ranks([1.0, 2.0, 3.0], 2)
    with pytest.raises(ValueError, match="karmarkar_karp, round_robin"):
        assign_bins_to_ranks([1.0, 2.0], 2, method="greedy")
    with pytest.raises(ValueError, match="dp_size"):
        assign_bins_to_ranks([1.0], 0)
    assert imbalance([0.0, 0.0], [[0], [1]]) == 1.0
    assert assign_bins_to_ranks([], 4) == [[], [], [], []]
