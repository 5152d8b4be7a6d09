"""`split_to_count` splits by the LPT rule: items by size descending, ties by id ascending."""

from __future__ import annotations

from heapq import heapify, heappop, heappush

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.rebin import split_to_count


def reference_split(bins, sizes, target):
    """The rule written out plainly (a Python key per item), to pin the faster sort to it."""
    bins = [list(b) for b in bins]
    heap = [(-sum(sizes[i] for i in b), idx) for idx, b in enumerate(bins) if len(b) >= 2]
    heapify(heap)
    while len(bins) < target and heap:
        _, idx = heappop(heap)
        first, second, load_first, load_second = [], [], 0, 0
        for i in sorted(bins[idx], key=lambda i: (-sizes[i], i)):
            if load_first <= load_second:
                first.append(i)
                load_first += sizes[i]
            else:
                second.append(i)
                load_second += sizes[i]
        bins[idx] = sorted(first)
        bins.append(sorted(second))
        if len(first) >= 2:
            heappush(heap, (-load_first, idx))
        if len(second) >= 2:
            heappush(heap, (-load_second, len(bins) - 1))
    return bins


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 5, 5, 10, 10, 20]) | st.integers(1, 50), min_size=1,
                max_size=40), st.data())
def test_splits_follow_size_then_id_whatever_the_order_inside_a_bin(sizes, data):
    ids = data.draw(st.permutations(range(len(sizes))))  # unsorted bins: ties must go by id
    cut = sorted(data.draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=5)))
    bins = [list(ids[a:b]) for a, b in zip([0, *cut], [*cut, len(ids)], strict=True) if a < b]
    target = len(bins) + data.draw(st.integers(0, 12))
    assert split_to_count(bins, sizes, target) == reference_split(bins, sizes, target)


def test_a_worked_split():
    # Sizes 5, 5, 3, 3 in one bin: 5 (id 0) left, 5 (id 1) right, 3 (id 2) left, 3 (id 3) right.
    assert split_to_count([[3, 1, 2, 0]], [5, 5, 3, 3], 2) == [[0, 2], [1, 3]]
