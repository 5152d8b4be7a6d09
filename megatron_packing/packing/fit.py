"""First-fit and best-fit kernels over integer item sizes sorted in non-increasing order.

Both kernels take a numpy array of sizes (sorted largest first, none above the capacity), the
bin capacity and an optional cap on the number of bins. They return ``(bin_of, n_bins)`` where
``bin_of[i]`` is the bin of the ``i``-th sorted item (``-1`` when ``max_bins`` stopped it from
being placed). Bins are numbered in the order they are opened.

Speed comes from three facts.

* Sizes are integers, so equal sizes form runs. A bin with room ``r`` takes ``min(k, r // s)``
  items of a run of ``k`` items of size ``s`` at once, under first fit and best fit alike: it is
  left with less than ``s`` (or the run is used up), so no other item of the run could have gone
  there. New bins are opened a run at a time too: all but the last take ``capacity // s`` items
  and are left with the same room, ``capacity % s``.
* Both kernels keep bins in one structure, :class:`RoomIndex`, which files bins by remaining
  room and finds the smallest room >= s with a constant number of big-integer bit operations.
  Best fit asks it at every placement. First fit keeps the bins that can take the current size
  in a min-heap of bin ids (the first fit is its top) and parks the others in the index until
  the sizes shrink to their room.
* A bin whose room is below the smallest size is never filed again: it can take nothing more.

Both run in O(n log n). Ties: first fit takes the earliest-opened bin by definition; best fit
takes, among the bins with the smallest room that fits, the earliest-opened one.
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappop, heappush
from typing import NamedTuple

import numpy as np

# Rooms are grouped in blocks of 2**_BLOCK consecutive values. Each block is one Python int
# with a bit per room (256 bits), and one more int has a bit per non-empty block: a capacity of
# 65,536 has 257 blocks, so the shifts and lowest-set-bit lookups below work on a few machine
# words instead of one int as wide as the capacity.
_BLOCK = 8
_LOW = (1 << _BLOCK) - 1  # mask of a room's offset inside its block


class RoomIndex(NamedTuple):
    """Bins filed by remaining room; finds the smallest room >= s in O(1) big-int operations.

    Made by :func:`room_index`. The operations share the index's state as closure variables:
    CPython reads and writes those faster than instance attributes, and best fit calls
    ``push_pop`` once per placement.
    """

    add: Callable[[int, int], None]
    """``add(room, b)``: file bin ``b`` under ``room``."""
    add_new: Callable[[int, int, int], None]
    """``add_new(room, first, count)``: file bins ``first .. first + count - 1`` under ``room``.
    They must be newer (larger ids) than every bin filed: appended in order, they keep the
    room's min-heap valid without sifting."""
    push_pop: Callable[[int, int, int], int]
    """``push_pop(room, b, s)``: file bin ``b`` under ``room`` (nothing when ``room`` < 0), then
    remove and return the earliest-opened bin among those with the smallest room >= ``s``, or
    -1 when no bin has room for ``s``. Like ``heapq.heappushpop``: best fit puts back the bin
    it just filled and takes the next in one call."""
    drain_from: Callable[[int, list[int]], int]
    """``drain_from(s, heap)``: move every bin with room >= ``s`` onto the min-heap ``heap``;
    return the largest room left (below ``s``), or -1 when the index is now empty."""


def room_index(capacity: int) -> RoomIndex:
    """An empty :class:`RoomIndex` for rooms between 0 and ``capacity``.

    ``fine[blk]`` has bit ``r & 255`` set when some bin has room exactly ``r``, for the rooms of
    block ``blk = r >> 8``; ``coarse`` has bit ``blk`` set when ``fine[blk]`` is non-zero. The
    bins of one room form a min-heap of ids, so the earliest-opened comes out first.
    """
    buckets: dict[int, list[int]] = {}  # room -> min-heap of bin ids
    fine = [0] * ((capacity >> _BLOCK) + 1)
    coarse = 0

    def add(room: int, b: int) -> None:
        nonlocal coarse
        bucket = buckets.get(room)
        if bucket:
            heappush(bucket, b)
            return
        buckets[room] = [b]
        blk = room >> _BLOCK
        if not fine[blk]:
            coarse |= 1 << blk
        fine[blk] |= 1 << (room & _LOW)

    def add_new(room: int, first: int, count: int) -> None:
        nonlocal coarse
        bucket = buckets.get(room)
        if bucket:
            bucket.extend(range(first, first + count))
            return
        buckets[room] = list(range(first, first + count))
        blk = room >> _BLOCK
        if not fine[blk]:
            coarse |= 1 << blk
        fine[blk] |= 1 << (room & _LOW)

    def push_pop(room: int, b: int, s: int) -> int:
        nonlocal coarse
        if room >= 0:  # add(room, b), inlined: this runs once per best-fit placement
            bucket = buckets.get(room)
            if bucket:
                heappush(bucket, b)
            else:
                buckets[room] = [b]
                blk = room >> _BLOCK
                if not fine[blk]:
                    coarse |= 1 << blk
                fine[blk] |= 1 << (room & _LOW)
        blk = s >> _BLOCK
        # The rooms of s's own block that are >= s, shifted down to start at s. x & -x keeps
        # only the lowest set bit of x (two's complement), so its bit_length - 1 is how far
        # above s the smallest of those rooms lies.
        above = fine[blk] >> (s & _LOW)
        if above:
            room = s + (above & -above).bit_length() - 1
        else:
            # None there: the first non-empty block above s's block, then its lowest room.
            upper = coarse >> (blk + 1)
            if not upper:
                return -1
            blk += (upper & -upper).bit_length()
            bits = fine[blk]
            room = (blk << _BLOCK) + (bits & -bits).bit_length() - 1
        bucket = buckets[room]
        b = heappop(bucket)
        if not bucket:  # the room's last bin: clear its bit, and the block's if now empty
            del buckets[room]
            fine[blk] ^= 1 << (room & _LOW)
            if not fine[blk]:
                coarse ^= 1 << blk
        return b

    def drain_from(s: int, heap: list[int]) -> int:
        nonlocal coarse
        while coarse:
            # The largest room held: the highest set bit of the highest non-empty block.
            blk = coarse.bit_length() - 1
            bits = fine[blk]
            room = (blk << _BLOCK) + bits.bit_length() - 1
            if room < s:
                return room
            for b in buckets.pop(room):
                heappush(heap, b)
            bits ^= 1 << (room & _LOW)
            fine[blk] = bits
            if not bits:
                coarse ^= 1 << blk
        return -1

    return RoomIndex(add, add_new, push_pop, drain_from)


def _runs(sizes: np.ndarray) -> tuple[list[int], list[int]]:
    """Values and lengths of the runs of equal sizes."""
    n = len(sizes)
    starts = np.flatnonzero(np.concatenate(([True], sizes[1:] != sizes[:-1])))
    counts = np.diff(np.append(starts, n))
    return sizes[starts].tolist(), counts.tolist()


def _finish(bin_ids: list[int], counts: list[int]) -> np.ndarray:
    """``bin_of`` per sorted item from the placements: ``counts[j]`` items went to ``bin_ids[j]``."""
    # fromiter with a known count converts a list of ints faster than asarray.
    return np.repeat(np.fromiter(bin_ids, np.int64, len(bin_ids)),
                     np.fromiter(counts, np.int64, len(counts)))


def first_fit_decreasing(
    sizes: np.ndarray, capacity: int, max_bins: int | None = None
) -> tuple[np.ndarray, int]:
    """First fit over sizes sorted largest first.

    Because sizes only decrease, a bin is *eligible* (room >= current size) from the moment
    the size drops to its room until an item brings its room below the size. Eligible bins
    sit in a min-heap of bin ids, so the first fit is the heap's top. The others wait in a
    :class:`RoomIndex`; when a run of a smaller size starts, those with room >= it join the heap.
    """
    n = len(sizes)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    limit = n if max_bins is None else min(n, max_bins)
    smallest = int(sizes[-1])  # a bin with less room than this never takes another item
    eligible: list[int] = []
    waiting = room_index(capacity)
    wait = waiting.add
    top_waiting = -1  # the largest room waiting (-1: none); no wake-up while sizes are above it
    rooms: list[int] = []  # room of each bin, by id
    out_bins: list[int] = []
    out_counts: list[int] = []

    values, run_lengths = _runs(sizes)
    for s, k in zip(values, run_lengths, strict=True):
        if top_waiting >= s:
            top_waiting = waiting.drain_from(s, eligible)
        while k:
            if eligible:
                b = eligible[0]
                room = rooms[b]
                m = room // s
                if m > k:
                    m = k
                k -= m
                out_bins.append(b)
                out_counts.append(m)
                room -= m * s
                rooms[b] = room
                if room < s:
                    heappop(eligible)
                    if room >= smallest:
                        wait(room, b)
                        if room > top_waiting:
                            top_waiting = room
            elif len(rooms) < limit:
                per = capacity // s  # items of size s an empty bin holds
                if k >= 2 * per:  # several full bins, all left with capacity % s < s
                    first = len(rooms)
                    full = min(k // per, limit - first)
                    room = capacity - per * s
                    out_bins.extend(range(first, first + full))
                    out_counts.extend([per] * full)
                    rooms.extend([room] * full)
                    k -= full * per
                    if room >= smallest:
                        waiting.add_new(room, first, full)
                        if room > top_waiting:
                            top_waiting = room
                while k and len(rooms) < limit:
                    m = per if per < k else k
                    k -= m
                    b = len(rooms)
                    out_bins.append(b)
                    out_counts.append(m)
                    room = capacity - m * s
                    rooms.append(room)
                    if room >= s:
                        heappush(eligible, b)
                    elif room >= smallest:
                        wait(room, b)
                        if room > top_waiting:
                            top_waiting = room
            else:
                out_bins.append(-1)
                out_counts.append(k)
                k = 0
    return _finish(out_bins, out_counts), len(rooms)


def best_fit_decreasing(
    sizes: np.ndarray, capacity: int, max_bins: int | None = None
) -> tuple[np.ndarray, int]:
    """Best fit over sizes sorted largest first: every placement takes, from a
    :class:`RoomIndex`, the earliest-opened bin among those with the smallest room >= the size.
    """
    n = len(sizes)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    limit = n if max_bins is None else min(n, max_bins)
    smallest = int(sizes[-1])  # a bin with less room than this never takes another item
    index = room_index(capacity)
    add, push_pop = index.add, index.push_pop
    rooms: list[int] = []  # room of each bin, by id
    n_bins = 0
    out_bins: list[int] = []
    out_counts: list[int] = []
    # The bin last filled is filed back by the next push_pop (one call instead of two).
    back_room = back_bin = -1
    top = -1  # no room held (nor the bin to file back) is above this: skip hopeless queries

    values, run_lengths = _runs(sizes)
    for s, k in zip(values, run_lengths, strict=True):
        while k:
            if s <= top:
                b = push_pop(back_room, back_bin, s)
                back_room = -1
                if b >= 0:
                    room = rooms[b]
                    m = room // s
                    if m > k:
                        m = k
                    k -= m
                    out_bins.append(b)
                    out_counts.append(m)
                    room -= m * s
                    rooms[b] = room
                    if room >= smallest:
                        back_room, back_bin = room, b
                    continue
                top = s - 1  # every room held is below s
            if n_bins < limit:
                per = capacity // s  # items of size s an empty bin holds
                if k >= 2 * per:  # several full bins, all left with capacity % s
                    first = n_bins
                    full = min(k // per, limit - first)
                    n_bins += full
                    room = capacity - per * s
                    out_bins.extend(range(first, first + full))
                    out_counts.extend([per] * full)
                    rooms.extend([room] * full)
                    k -= full * per
                    if room >= smallest:
                        index.add_new(room, first, full)
                        if room > top:
                            top = room
                while k and n_bins < limit:
                    m = per if per < k else k
                    k -= m
                    b = n_bins
                    n_bins += 1
                    out_bins.append(b)
                    out_counts.append(m)
                    room = capacity - m * s
                    rooms.append(room)
                    if room >= smallest:
                        if back_room >= 0:
                            add(back_room, back_bin)
                        back_room, back_bin = room, b
                        if room > top:
                            top = room
            else:
                out_bins.append(-1)
                out_counts.append(k)
                k = 0
    return _finish(out_bins, out_counts), n_bins


def group_by_bin(bin_of: np.ndarray, n_bins: int) -> list[list[int]]:
    """Item indices of each bin ``0..n_bins-1``, ascending; items with ``bin_of < 0`` are left out."""
    keep = np.flatnonzero(bin_of >= 0)
    ids = bin_of[keep]
    # numpy's stable sort is a radix sort for 16-bit keys (linear time): use it when the bin
    # ids fit. Stable either way, so the order within each bin stays ascending.
    keys = ids.astype(np.uint16) if n_bins <= 1 << 16 else ids
    order = keep[np.argsort(keys, kind="stable")].tolist()
    ends = np.cumsum(np.bincount(ids, minlength=n_bins)).tolist()
    out = []
    start = 0
    for end in ends:
        out.append(order[start:end])
        start = end
    return out


def worst_fit_decreasing(sizes: np.ndarray, capacity: int, num_bins: int) -> tuple[np.ndarray, int]:
    """Each item (largest first) into the bin with the most room among ``num_bins`` bins.

    Spreads load evenly; used when a fixed bin count must be met. Ties go to the lowest bin.
    """
    n = len(sizes)
    bin_of = np.full(n, -1, dtype=np.int64)
    if n == 0 or num_bins <= 0:
        return bin_of, 0
    heap = [(-capacity, b) for b in range(num_bins)]
    out = bin_of.tolist()
    for i, s in enumerate(sizes.tolist()):
        neg_room, b = heap[0]
        if -neg_room >= s:
            out[i] = b
            heappop(heap)
            heappush(heap, (neg_room + s, b))
    return np.asarray(out, dtype=np.int64), num_bins
