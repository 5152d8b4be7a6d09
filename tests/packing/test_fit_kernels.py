"""The first-fit and best-fit kernels and their shared room index, against plain references.

The kernels place runs of equal sizes a bin at a time, open full bins in bulk and keep bins in a
bitset index over rooms; each shortcut must give exactly what the item-by-item definitions give,
including with a cap on the bin count and at capacities that end on either side of a 256-room
block boundary.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_packing.packing.fit import (
    best_fit_decreasing,
    first_fit_decreasing,
    group_by_bin,
    room_index,
)


def naive_fit(sizes: list[int], capacity: int, max_bins: int | None, best: bool) -> list[int]:
    """Bin of each item (largest first), item by item: the first bin with room, or the one with
    the least room that fits (earliest on ties); a new bin while under the cap, else -1."""
    rooms: list[int] = []
    out = []
    for s in sizes:
        fits = [(room, b) for b, room in enumerate(rooms) if room >= s]
        if fits:
            b = min(fits)[1] if best else fits[0][1]
        elif max_bins is None or len(rooms) < max_bins:
            rooms.append(capacity)
            b = len(rooms) - 1
        else:
            out.append(-1)
            continue
        rooms[b] -= s
        out.append(b)
    return out


def _instances(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for k in range(count):
        capacity = int(rng.choice([1, 3, 255, 256, 257, 511, 4096, 65536]))
        n = int(rng.integers(1, 250))
        if k % 3 == 0:  # a handful of distinct sizes: long runs, bulk-opened bins
            pool = rng.integers(1, capacity + 1, size=int(rng.integers(1, 5)))
            sizes = rng.choice(pool, size=n)
        elif k % 3 == 1:  # small items: many items per bin, rooms spread over blocks
            sizes = np.minimum(rng.geometric(4 / capacity if capacity > 4 else 0.9, size=n),
                               capacity)
        else:
            sizes = rng.integers(1, capacity + 1, size=n)
        sizes = np.sort(sizes)[::-1].astype(np.int64)
        max_bins = None if k % 4 == 0 else int(rng.integers(0, n + 1))
        yield sizes, capacity, max_bins


@pytest.mark.parametrize("best", [False, True], ids=["ffd", "bfd"])
def test_kernels_match_the_item_by_item_definitions(best: bool) -> None:
    kernel = best_fit_decreasing if best else first_fit_decreasing
    for sizes, capacity, max_bins in _instances(seed=3, count=300):
        bin_of, n_bins = kernel(sizes, capacity, max_bins)
        expected = naive_fit(sizes.tolist(), capacity, max_bins, best)
        assert bin_of.tolist() == expected, (capacity, max_bins, sizes.tolist())
        assert n_bins == max(expected, default=-1) + 1


def test_room_index_takes_the_tightest_room_then_the_earliest_bin() -> None:
    index = room_index(1000)
    for room, b in [(700, 4), (300, 9), (300, 2), (999, 1), (256, 5), (255, 6)]:
        index.add(room, b)
    # Smallest room >= s, in s's own 256-block, in a later block, or none at all.
    assert index.push_pop(-1, -1, 256) == 5
    assert index.push_pop(-1, -1, 256) == 2  # room 300: bins 9 and 2, the earliest first
    assert index.push_pop(-1, -1, 256) == 9
    assert index.push_pop(-1, -1, 701) == 1
    assert index.push_pop(-1, -1, 701) == -1
    # The bin handed to push_pop is filed before the query, so it can come straight back.
    assert index.push_pop(800, 3, 750) == 3
    assert index.push_pop(-1, -1, 1) == 6


def test_room_index_drains_every_room_at_or_above_a_size() -> None:
    index = room_index(4096)
    for room, b in [(10, 0), (500, 1), (500, 7), (4096, 2), (499, 3)]:
        index.add(room, b)
    index.add_new(600, 8, 3)  # bins 8, 9, 10 with room 600
    heap: list[int] = []
    assert index.drain_from(500, heap) == 499  # what is left below 500 starts at 499
    assert sorted(heap) == [1, 2, 7, 8, 9, 10]
    assert heap[0] == 1  # a valid min-heap
    assert index.drain_from(11, heap) == 10
    assert index.drain_from(1, heap) == -1
    assert sorted(heap) == [0, 1, 2, 3, 7, 8, 9, 10]


def test_bins_opened_in_bulk_keep_their_room_heap_in_order() -> None:
    index = room_index(100)
    index.add(40, 5)
    index.add_new(40, 6, 3)  # newer than bin 5: appended behind it
    assert [index.push_pop(-1, -1, 40) for _ in range(5)] == [5, 6, 7, 8, -1]


@pytest.mark.parametrize("n_bins", [3, 65_536, 70_000])
def test_group_by_bin_lists_each_bins_items_in_order(n_bins: int) -> None:
    # Bin ids up to 65,535 are sorted as 16-bit keys; more bins than that must not wrap.
    rng = np.random.default_rng(n_bins)
    bin_of = rng.integers(-1, n_bins, size=5_000)
    bin_of[:2] = [n_bins - 1, 0]
    expected: list[list[int]] = [[] for _ in range(n_bins)]
    for item, b in enumerate(bin_of.tolist()):
        if b >= 0:
            expected[b].append(item)
    assert group_by_bin(bin_of, n_bins) == expected
