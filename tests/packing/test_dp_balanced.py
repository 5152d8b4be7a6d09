"""Megatron-LM's dp_balanced packing as a reference planner: each rule on a worked example."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.dp_balanced import (
    next_fit,
    plan_step,
    plan_stream,
    round_robin_ranks,
    split_to_multiple,
)


def test_next_fit_packs_in_arrival_order_and_never_goes_back():
    # Capacity 10. 6 opens bin 0; 5 does not fit (11), opens bin 1; 3 joins it (8); 4 does not
    # (12), opens bin 2, although bin 0 has room for it: a closed bin is never revisited.
    # First fit would put 4 into bin 0 and 2 after it, in 3 bins as well, but not these.
    assert next_fit([6, 5, 3, 4, 2, 10, 1], 10) == [[0], [1, 2], [3, 4], [5], [6]]
    # A bin may fill exactly to the capacity.
    assert next_fit([6, 4, 5], 10) == [[0, 1], [2]]
    # An example above the capacity gets a bin of its own.
    assert next_fit([3, 12, 3], 10) == [[0], [1], [2]]
    assert next_fit([], 10) == []


def test_single_samples_split_off_the_last_bins_until_the_count_divides_by_dp():
    # 3 bins at dp 4: the last sample of the last multi-sample bin (2, holding 4 and 5) moves into
    # a new bin right after it.
    bins, split, placeholders = split_to_multiple([[0, 1], [2, 3], [4, 5]], 4)
    assert bins == [[0, 1], [2, 3], [4], [5]] and (split, placeholders) == (1, 0)
    # Two splits: bin 2 holds one sample after the first, so the second takes bin 1's last.
    bins, split, _ = split_to_multiple([[0, 1, 2], [3, 4], [5]], 5)
    assert bins == [[0, 1], [2], [3], [4], [5]] and split == 2
    # A bin of three gives up samples from its end, one at a time.
    bins, split, _ = split_to_multiple([[0], [1, 2, 3]], 4)
    assert bins == [[0], [1], [2], [3]] and split == 2
    # Already a multiple: unchanged.
    assert split_to_multiple([[0, 1], [2]], 2) == ([[0, 1], [2]], 0, 0)


def test_too_few_samples_to_split_get_placeholder_bins():
    bins, split, placeholders = split_to_multiple([[0, 1], [2]], 4)
    assert bins == [[0], [1], [2], []] and (split, placeholders) == (1, 1)
    assert split_to_multiple([], 2) == ([[], []], 0, 2)


def test_bin_k_goes_to_rank_k_mod_dp():
    assert round_robin_ranks(6, 3) == [[0, 3], [1, 4], [2, 5]]
    step = plan_step([6, 5, 3, 4, 2, 10, 1], 10, 2)
    # Next-fit makes 5 bins; one split makes 6: bin 2 (samples 3 and 4), the last holding two,
    # gives up sample 4 into a bin of its own after it.
    assert step.bins == [[0], [1, 2], [3], [4], [5], [6]]
    assert step.rank_bins == [[0, 2, 4], [1, 3, 5]]
    assert (step.packed_bins, step.split, step.placeholders, step.extra_bins) == (5, 1, 0, 1)


def test_a_stream_is_cut_into_steps_of_exactly_b():
    steps = plan_stream([5] * 10, 4, 10, 2, steps=5)
    assert [start for start, _ in steps] == [0, 4, 8]
    assert [len([p for b in s.bins for p in b]) for _, s in steps] == [4, 4, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 120), min_size=0, max_size=60), st.integers(1, 100),
       st.integers(1, 9))
def test_every_sample_once_in_order_and_the_count_a_multiple_of_dp(sizes, capacity, dp):
    step = plan_step(sizes, capacity, dp)
    assert len(step.bins) % dp == 0 and len(step.bins) >= dp
    assert [p for b in step.bins for p in b] == list(range(len(sizes)))  # arrival order kept
    assert all(sum(sizes[p] for p in b) <= capacity or len(b) == 1 for b in step.bins)
    assert sorted(k for r in step.rank_bins for k in r) == list(range(len(step.bins)))
    assert all(len(r) == len(step.bins) // dp for r in step.rank_bins)
    if step.placeholders:
        assert all(len(b) <= 1 for b in step.bins)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_step([1], 10, 0)
