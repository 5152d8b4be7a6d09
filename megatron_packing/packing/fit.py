"""First-fit and best-fit kernels over integer item sizes sorted in non-increasing order.

Both kernels take a numpy array of sizes (already sorted, largest first), the bin capacity
and an optional cap on the number of bins. They return ``(bin_of, n_bins)`` where
``bin_of[i]`` is the bin of the ``i``-th sorted item (``-1`` when ``max_bins`` stopped it from
being placed). Bins are numbered in the order they are opened.

Speed comes from two facts. Sizes are integers, so equal sizes form runs: a run of ``k``
items of size ``s`` is placed a whole bin at a time (a bin with room ``r`` takes
``min(k, r // s)`` items at once, both under first fit and best fit), and new bins are
opened in bulk. And every query is logarithmic or constant: first fit keeps the bins that
can take the current size in a min-heap of bin ids (the first fit is its top); best fit
keeps one heap of bin ids per remaining room and a two-level bitset over rooms (the
smallest room >= s is a lowest-set-bit lookup). Both run in O(n log n).
Ties: first fit takes the earliest-opened bin by definition; best fit takes, among bins with
the same smallest room, the earliest-opened one.
"""

from __future__ import annotations

from heapq import heappop, heappush

import numpy as np


def _runs(sizes: np.ndarray) -> tuple[list[int], list[int]]:
    """Values and lengths of the runs of equal sizes."""
    n = len(sizes)
    starts = np.flatnonzero(np.concatenate(([True], sizes[1:] != sizes[:-1])))
    counts = np.diff(np.append(starts, n))
    return sizes[starts].tolist(), counts.tolist()


def _finish(bin_ids: list[int], counts: list[int]) -> np.ndarray:
    return np.repeat(np.asarray(bin_ids, dtype=np.int64), np.asarray(counts, dtype=np.int64))


_BLOCK = 8  # rooms are bucketed in blocks of 2**_BLOCK for the two-level bitsets


def first_fit_decreasing(
    sizes: np.ndarray, capacity: int, max_bins: int | None = None
) -> tuple[np.ndarray, int]:
    """First fit over sizes sorted largest first.

    Because sizes only decrease, a bin is *eligible* (room >= current size) from the moment
    the size drops to its room until an item brings its room below the size. Eligible bins
    sit in a min-heap of bin ids, so the first fit is the heap's top. The others wait in
    buckets by room; a two-level bitset finds the largest waiting room, and buckets whose
    room is at least the new size join the heap when a new run of sizes starts.
    """
    n = len(sizes)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    limit = n if max_bins is None else min(n, max_bins)
    smallest = int(sizes[-1])
    low = (1 << _BLOCK) - 1
    eligible: list[int] = []
    waiting: dict[int, list[int]] = {}
    fine = [0] * ((capacity >> _BLOCK) + 1)
    coarse = 0
    rooms: list[int] = []
    out_bins: list[int] = []
    out_counts: list[int] = []

    def wait(room: int, b: int) -> None:
        nonlocal coarse
        bucket = waiting.get(room)
        if bucket is not None:
            bucket.append(b)
            return
        waiting[room] = [b]
        blk = room >> _BLOCK
        if not fine[blk]:
            coarse |= 1 << blk
        fine[blk] |= 1 << (room & low)

    values, run_lengths = _runs(sizes)
    for s, k in zip(values, run_lengths, strict=True):
        while coarse:  # wake every waiting bin whose room is now >= s
            blk = coarse.bit_length() - 1
            bits = fine[blk]
            top = (blk << _BLOCK) + bits.bit_length() - 1
            if top < s:
                break
            for b in waiting.pop(top):
                heappush(eligible, b)
            bits ^= 1 << (top & low)
            fine[blk] = bits
            if not bits:
                coarse ^= 1 << blk
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
            elif len(rooms) < limit:
                per = capacity // s
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
            else:
                out_bins.append(-1)
                out_counts.append(k)
                k = 0
    return _finish(out_bins, out_counts), len(rooms)


def best_fit_decreasing(
    sizes: np.ndarray, capacity: int, max_bins: int | None = None
) -> tuple[np.ndarray, int]:
    """Best fit over sizes sorted largest first, with bucketed rooms and a two-level bitset.

    ``fine[blk]`` has bit ``r & 255`` set when some bin has exactly room ``r`` in block
    ``blk = r >> 8``; ``coarse`` has bit ``blk`` set when ``fine[blk]`` is non-zero. The
    smallest room >= s is found with two lowest-set-bit lookups on small integers.
    """
    n = len(sizes)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    limit = n if max_bins is None else min(n, max_bins)
    smallest = int(sizes[-1])
    low = (1 << _BLOCK) - 1
    buckets: dict[int, list[int]] = {}
    fine = [0] * ((capacity >> _BLOCK) + 1)
    coarse = 0
    out_bins: list[int] = []
    out_counts: list[int] = []
    n_bins = 0

    def add(room: int, b: int) -> None:
        nonlocal coarse
        heap = buckets.get(room)
        if heap:
            heappush(heap, b)
            return
        buckets[room] = [b]
        blk = room >> _BLOCK
        if not fine[blk]:
            coarse |= 1 << blk
        fine[blk] |= 1 << (room & low)

    values, run_lengths = _runs(sizes)
    for s, k in zip(values, run_lengths, strict=True):
        while k:
            blk = s >> _BLOCK
            above = fine[blk] >> (s & low)
            if above:
                room = s + (above & -above).bit_length() - 1
            else:
                upper = coarse >> (blk + 1)
                if upper:
                    blk += (upper & -upper).bit_length()
                    bits = fine[blk]
                    room = (blk << _BLOCK) + (bits & -bits).bit_length() - 1
                else:
                    room = -1
            if room >= 0:
                heap = buckets[room]
                b = heappop(heap)
                if not heap:
                    del buckets[room]
                    blk = room >> _BLOCK
                    fine[blk] ^= 1 << (room & low)
                    if not fine[blk]:
                        coarse ^= 1 << blk
                m = room // s
                if m > k:
                    m = k
                k -= m
                out_bins.append(b)
                out_counts.append(m)
                room -= m * s
                if room >= smallest:
                    add(room, b)
            elif n_bins < limit:
                per = capacity // s
                while k and n_bins < limit:
                    m = per if per < k else k
                    k -= m
                    b = n_bins
                    n_bins += 1
                    out_bins.append(b)
                    out_counts.append(m)
                    room = capacity - m * s
                    if room >= smallest:
                        add(room, b)
            else:
                out_bins.append(-1)
                out_counts.append(k)
                k = 0
    return _finish(out_bins, out_counts), n_bins


def group_by_bin(bin_of: np.ndarray, n_bins: int) -> list[list[int]]:
    """Item indices of each bin ``0..n_bins-1``, ascending; items with ``bin_of < 0`` are left out."""
    keep = np.flatnonzero(bin_of >= 0)
    ids = bin_of[keep]
    order = keep[np.argsort(ids, kind="stable")].tolist()
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
