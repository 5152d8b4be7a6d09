"""First-fit and best-fit kernels over integer item sizes sorted in non-increasing order.

Both kernels take a numpy array of sizes (already sorted, largest first), the bin capacity
and an optional cap on the number of bins. They return ``(bin_of, n_bins)`` where
``bin_of[i]`` is the bin of the ``i``-th sorted item (``-1`` when ``max_bins`` stopped it from
being placed). Bins are numbered in the order they are opened.

Speed comes from two facts. Sizes are integers, so equal sizes form runs: a run of ``k``
items of size ``s`` is placed a whole bin at a time (a bin with room ``r`` takes
``min(k, r // s)`` items at once, both under first fit and best fit), and new bins are
opened in bulk. And every query is logarithmic: first fit descends a max segment tree over
bins (leftmost bin with room >= s); best fit keeps one heap of bin ids per remaining room and
a two-level bitset over rooms (the smallest room >= s is a lowest-set-bit lookup).
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


def _volume_bound(sizes: np.ndarray, capacity: int, limit: int) -> int:
    """Most bins any any-fit packing can open: every two bins hold more than one capacity."""
    return min(limit, 2 * (-(-int(sizes.sum()) // capacity)) + 1)


def _grown(tree: list[int], leaves: int, n_bins: int) -> tuple[list[int], int]:
    """The segment tree rebuilt with twice as many leaves."""
    wide = 2 * leaves
    new = [0] * (2 * wide)
    new[wide : wide + n_bins] = tree[leaves : leaves + n_bins]
    for node in range(wide - 1, 0, -1):
        left = new[2 * node]
        right = new[2 * node + 1]
        new[node] = left if left >= right else right
    return new, wide


def first_fit_decreasing(
    sizes: np.ndarray, capacity: int, max_bins: int | None = None
) -> tuple[np.ndarray, int]:
    """First fit over sizes sorted largest first, with a max segment tree over bins.

    The tree is sized for the any-fit bound (2 x volume bound + 1 bins; it doubles if ever
    full), so each query walks ~log2(bins) levels.
    """
    n = len(sizes)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    limit = n if max_bins is None else min(n, max_bins)
    guess = _volume_bound(sizes, capacity, limit)
    leaves = 1
    while leaves < guess:
        leaves <<= 1
    tree = [0] * (2 * leaves)
    out_bins: list[int] = []
    out_counts: list[int] = []
    n_bins = 0
    values, run_lengths = _runs(sizes)
    for s, k in zip(values, run_lengths, strict=True):
        while k:
            if tree[1] >= s:
                node = 1
                while node < leaves:
                    node <<= 1
                    if tree[node] < s:
                        node += 1
                room = tree[node]
                m = room // s
                if m > k:
                    m = k
                k -= m
                out_bins.append(node - leaves)
                out_counts.append(m)
                room -= m * s
                tree[node] = room
                while node > 1:
                    other = tree[node ^ 1]
                    if other > room:
                        room = other
                    node >>= 1
                    if tree[node] == room:
                        break
                    tree[node] = room
            elif n_bins < limit:
                per = capacity // s
                while k and n_bins < limit:
                    if n_bins == leaves:
                        tree, leaves = _grown(tree, leaves, n_bins)
                    m = per if per < k else k
                    k -= m
                    out_bins.append(n_bins)
                    out_counts.append(m)
                    room = capacity - m * s
                    node = leaves + n_bins
                    n_bins += 1
                    while node and tree[node] < room:
                        tree[node] = room
                        node >>= 1
            else:
                out_bins.append(-1)
                out_counts.append(k)
                k = 0
    return _finish(out_bins, out_counts), n_bins


_BLOCK = 8  # rooms are bucketed in blocks of 2**_BLOCK for the two-level bitset


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
