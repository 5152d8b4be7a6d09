"""The pure token-budget splitter: worked examples, properties, order restoration, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.microbatch import (
    example_lengths,
    make_token_balanced_microbatches,
    padded_tokens,
    restore_input_order,
    sort_by_length,
)


# --------------------------------------------------------------------------- worked examples
def test_greedy_rule_descending_lengths():
    lengths = [100, 90, 50, 40, 10]
    # 100+90: 2x100 = 200 fits; + 50: 3x100 = 300 > 200 -> new; 50,40,10: 3x50 = 150 fits
    assert make_token_balanced_microbatches([0, 1, 2, 3, 4], lengths, 200) == [[0, 1], [2, 3, 4]]


def test_greedy_rule_ascending_lengths_uses_the_growing_max():
    lengths = [10, 40, 50, 90, 100]
    # 10,40,50: 3x50 = 150; + 90: 4x90 = 360 > 200 -> new; 90,100: 2x100 = 200 fits
    assert make_token_balanced_microbatches([0, 1, 2, 3, 4], lengths, 200) == [[0, 1, 2], [3, 4]]


def test_exact_budget_is_allowed_one_more_token_is_not():
    assert make_token_balanced_microbatches([0, 1], [50, 50], 100) == [[0, 1]]
    assert make_token_balanced_microbatches([0, 1], [50, 51], 100) == [[0], [1]]


def test_oversize_example_gets_its_own_microbatch_and_is_kept():
    lengths = [10, 500, 10, 10]
    assert make_token_balanced_microbatches([0, 1, 2, 3], lengths, 100) == [[0], [1], [2, 3]]
    assert make_token_balanced_microbatches([1, 0], lengths, 100) == [[1], [0]]


def test_accepts_token_ids_and_walks_the_given_order():
    ids = [np.arange(30), np.arange(5), [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    assert make_token_balanced_microbatches([0, 2, 1], ids, 40) == [[0], [2, 1]]
    assert make_token_balanced_microbatches([2, 1, 0], ids, 40) == [[2, 1], [0]]


def test_balanced_shrinks_the_largest_microbatch_with_the_same_count():
    lengths = [300, 90, 50, 40, 10]
    greedy = make_token_balanced_microbatches(range(5), lengths, 200)
    balanced = make_token_balanced_microbatches(range(5), lengths, 200, method="balanced")
    assert greedy == [[0], [1, 2], [3, 4]]  # costs 300 (oversize), 180, 80
    assert balanced == [[0], [1], [2, 3, 4]]  # costs 300 (oversize), 90, 150
    assert len(balanced) == len(greedy)


def test_sort_by_length_is_stable_and_longest_first():
    assert sort_by_length([0, 1, 2, 3], [5, 9, 5, 9]) == [1, 3, 0, 2]
    assert sort_by_length([0, 1, 2, 3], [5, 9, 5, 9], descending=False) == [0, 2, 1, 3]


# --------------------------------------------------------------------------- properties
lengths_strategy = st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(min_value=1, max_value=5000),
       method=st.sampled_from(["greedy", "balanced"]), shuffle_seed=st.integers(0, 10**6))
def test_every_index_once_in_order_and_within_budget(lengths, budget, method, shuffle_seed):
    order = np.random.default_rng(shuffle_seed).permutation(len(lengths)).tolist()
    order = sort_by_length(order, lengths) if shuffle_seed % 2 else order
    groups = make_token_balanced_microbatches(order, lengths, budget, method=method)
    assert [i for group in groups for i in group] == order  # exactly once, walk order kept
    assert all(groups)
    array = np.asarray(lengths)
    for group in groups:
        cost = padded_tokens(group, array)
        assert cost <= budget or (len(group) == 1 and lengths[group[0]] > budget)


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(min_value=1, max_value=5000))
def test_balanced_never_needs_more_microbatches_and_never_raises_the_peak(lengths, budget):
    order = sort_by_length(range(len(lengths)), lengths)
    greedy = make_token_balanced_microbatches(order, lengths, budget)
    balanced = make_token_balanced_microbatches(order, lengths, budget, method="balanced")
    assert len(balanced) <= len(greedy)
    array = np.asarray(lengths)

    def peak(groups):
        fitting = [padded_tokens(g, array) for g in groups if padded_tokens(g, array) <= budget]
        return max(fitting, default=0)

    assert peak(balanced) <= peak(greedy)


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_strategy, budget=st.integers(min_value=1, max_value=5000))
def test_greedy_is_minimal_against_brute_force_lower_bound(lengths, budget):
    """No split into fewer groups can respect the budget: check by an exact DP."""
    order = sort_by_length(range(len(lengths)), lengths)
    greedy = make_token_balanced_microbatches(order, lengths, budget)
    run = [lengths[i] for i in order]
    n = len(run)
    best = [0] + [10**9] * n
    for end in range(1, n + 1):
        for start in range(end):
            segment = run[start:end]
            if len(segment) * max(segment) <= budget or len(segment) == 1:
                best[end] = min(best[end], best[start] + 1)
    assert len(greedy) == best[n]


# --------------------------------------------------------------------------- order restoration
def test_restore_input_order_undoes_the_sort():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 200, size=40)
    inputs = rng.permutation(100)[:40].tolist()  # dataset indices, in input order
    table = {index: length for index, length in zip(inputs, lengths, strict=True)}
    lookup = np.zeros(100, dtype=np.int64)
    for index, length in table.items():
        lookup[index] = length
    order = sort_by_length(inputs, lookup)
    schedule = make_token_balanced_microbatches(order, lookup, 300)
    schedule_with_dummy = schedule + [None]
    # a fake forward pass: per-example "log-prob" = -(index), one row per example
    outputs = [[-float(i) for i in group] for group in schedule] + [None]
    restored = restore_input_order(inputs, schedule_with_dummy, outputs)
    assert restored == [-float(i) for i in inputs]


def test_restore_input_order_rejects_missing_or_extra_outputs():
    with pytest.raises(ValueError, match="no output"):
        restore_input_order([1, 2, 3], [[1, 2]], [["a", "b"]])
    with pytest.raises(ValueError, match="2 examples but 1 outputs"):
        restore_input_order([1, 2], [[1, 2]], [["a"]])
    with pytest.raises(ValueError, match="not an input"):
        restore_input_order([1, 2], [[1, 7]], [["a", "b"]])


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("budget", [0, -5, 1.5, None, True])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="max_tokens"):
        make_token_balanced_microbatches([0], [10], budget)


def test_empty_batch():
    with pytest.raises(ValueError, match="empty batch"):
        make_token_balanced_microbatches([], [10, 20], 100)


def test_index_out_of_range_and_duplicates():
    with pytest.raises(ValueError, match="out of range"):
        make_token_balanced_microbatches([0, 2], [10, 20], 100)
    with pytest.raises(ValueError, match="out of range"):
        make_token_balanced_microbatches([-1], [10, 20], 100)
    with pytest.raises(ValueError, match="twice"):
        make_token_balanced_microbatches([1, 1], [10, 20], 100)


def test_bad_lengths_and_method():
    with pytest.raises(ValueError, match="negative"):
        example_lengths([5, -1])
    with pytest.raises(ValueError, match="expected token ids"):
        example_lengths([5, 2.5])
    with pytest.raises(ValueError, match="method"):
        make_token_balanced_microbatches([0], [10], 100, method="dp")

