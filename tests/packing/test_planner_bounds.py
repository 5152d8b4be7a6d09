"""The segment bound at its seam: a true lower bound of every packer's bin count.

The strategies favour examples of exactly C/2, C/3 and C/4 (and one above or below them),
where counting an example as crowded or not decides whether the bound stays below the packers:
two examples of C/2 share a bin, so they must not count as "more than half".
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.factory import make_seq_packer
from megatron_packing.packing.planner.bounds import BoundJudge, SegmentBound, aligns

from ._helpers import optimal_bins

ALGORITHMS = ("mffd", "ffd", "bfd")
FAST = settings(max_examples=80, deadline=None)


@st.composite
def streams(draw, max_items: int = 40):
    """(capacity, lengths): capacities divisible by 12, lengths near C/t for t = 1..4."""
    capacity = 12 * draw(st.integers(1, 40))
    fractions = [capacity, capacity // 2, capacity // 3, capacity // 4]
    near = st.sampled_from(fractions).flatmap(
        lambda f: st.sampled_from([f, f, f, max(1, f - 1), min(capacity, f + 1)]))
    item = near | st.integers(1, capacity)
    lengths = draw(st.lists(item, min_size=1, max_size=max_items))
    return capacity, np.asarray(lengths, dtype=np.int64)


@FAST
@given(streams(), st.sampled_from(ALGORITHMS), st.data())
def test_the_bound_never_exceeds_any_packers_bin_count(stream, algorithm, data):
    capacity, lengths = stream
    packer = make_seq_packer(algorithm, bin_capacity=capacity)
    bound = SegmentBound(lengths, capacity)
    start = data.draw(st.integers(0, len(lengths) - 1))
    end = data.draw(st.integers(start + 1, len(lengths)))
    lower = int(bound(np.array([start]), np.array([end]))[0])
    assert lower <= len(packer.pack(lengths[start:end])), (lower, lengths[start:end].tolist())
    # Every prefix at once (as the search reads them).
    prefixes = bound.prefixes(len(lengths))
    assert prefixes[0] == 0
    for k in range(1, len(lengths) + 1):
        assert prefixes[k] <= len(packer.pack(lengths[:k]))


@settings(max_examples=60, deadline=None)
@given(streams(max_items=9))
def test_the_bound_never_exceeds_the_fewest_bins_possible(stream):
    capacity, lengths = stream
    bound = SegmentBound(lengths, capacity)
    assert int(bound.prefixes(len(lengths))[-1]) <= optimal_bins(lengths.tolist(), capacity)


@pytest.mark.parametrize("fraction, count, expected", [
    (2, 6, 3),  # six of C/2 fill three bins: the bound is 3, not 6
    (3, 6, 2),  # six of C/3: two bins
    (4, 8, 2),  # eight of C/4: two bins
])
def test_examples_of_exactly_c_over_t_are_not_crowded(fraction, count, expected):
    capacity = 3072  # divisible by 2, 3 and 4
    lengths = np.full(count, capacity // fraction, dtype=np.int64)
    bound = SegmentBound(lengths, capacity)
    assert int(bound.prefixes(count)[-1]) == expected
    for algorithm in ALGORITHMS:
        assert len(make_seq_packer(algorithm, bin_capacity=capacity).pack(lengths)) == expected


def test_worked_bounds():
    capacity = 100
    # Three examples above half the capacity need three bins, whatever the tokens say.
    bound = SegmentBound(np.array([51, 51, 51, 1]), capacity)
    assert bound(np.array([0]), np.array([4])).tolist() == [3]
    # Five above a third: no bin holds three of them, so ceil(5 / 2) = 3.
    bound = SegmentBound(np.array([34, 34, 34, 34, 34]), capacity)
    assert bound(np.array([0]), np.array([5])).tolist() == [3]
    # Tokens: 250 over 100 is 3 bins; an oversize example (above C) adds its own bin.
    bound = SegmentBound(np.array([25] * 10 + [150]), capacity)
    assert bound(np.array([0, 0]), np.array([10, 11])).tolist() == [3, 4]


def test_the_judge_remembers_a_grid_without_changing_it():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4096, size=300)
    bound = SegmentBound(lengths, 4096)
    grids: OrderedDict = OrderedDict()
    judge = BoundJudge(bound, 4, grids)
    starts, ends = np.arange(0, 30)[:, None], np.arange(100, 140)[None, :]
    expected = aligns(bound(starts, ends), 4)
    assert (judge(starts, ends) == expected).all() and len(grids) == 1
    assert (judge(starts, ends) == expected).all() and len(grids) == 1  # the remembered grid
    small = judge(np.arange(3)[:, None], np.arange(10, 13)[None, :])  # 9 cells: not remembered
    assert len(grids) == 1 and small.shape == (3, 3)
