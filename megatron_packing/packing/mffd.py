"""Modified First-Fit Decreasing, the bin packing heuristic of Johnson and Garey (1985).

Its worst case is ``71/60 OPT + 1`` bins, better than first-fit decreasing's
``11/9 OPT + 6/9``. With capacity C, items are classed as large (> C/2), medium
(C/3, C/2], small (C/6, C/3] and tiny (<= C/6). Sizes arrive sorted largest first, ties by
original position, so the classes are consecutive slices. The phases:

1. Every large item opens its own bin (the "large bins", largest item first).
2. Forward through the large bins: put in the largest medium item that fits, if any.
3. Backward through the large bins without a medium item: if the two smallest remaining
   small items fit together, put in the smallest one, then the largest small item that
   still fits.
4. Forward through the large bins: while the smallest remaining item fits, put in the
   largest remaining item that fits.
5. First-fit decreasing for everything left. After phase 4 no leftover fits a large bin,
   so this opens new bins only; it equals first fit over all bins.

"Largest remaining that fits" is a bisection over the sorted sizes plus a union-find that
skips used items, so phases 1-4 cost O(n log n); phase 5 is `fit.first_fit_decreasing`.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from .fit import first_fit_decreasing


def modified_first_fit_decreasing(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """MFFD over sizes sorted largest first; returns ``(bin_of, n_bins)`` like the fit kernels."""
    n = len(sizes)
    # Sorted largest first, so each class is a slice: large [0, n_large), medium
    # [n_large, n_medium_end), small [n_medium_end, n_small_end), tiny after. The comparisons
    # are multiplied out (2s > C rather than s > C / 2) to stay in integers.
    n_large = int(np.count_nonzero(2 * sizes > capacity))
    if n_large == 0:
        return first_fit_decreasing(sizes, capacity)
    n_medium_end = int(np.count_nonzero(3 * sizes > capacity))
    n_small_end = int(np.count_nonzero(6 * sizes > capacity))

    size = sizes.tolist()
    # Ascending, for bisection: the first j in a slice with neg[j] >= -room, i.e. the first
    # item with size <= room, is the largest item of that slice that fits the room.
    neg = [-x for x in size]
    room = [capacity - x for x in size[:n_large]]
    bin_of = list(range(n_large)) + [-1] * (n - n_large)
    # Two union-find style forests over item positions, so that "the nearest unused item at
    # or after / at or before i" skips runs of used items in amortised near-constant time.
    # nxt[i]: i if item i is unused, else a pointer to the right (n = none);
    # prv[i]: i if unused, else a pointer to the left (-1 = none).
    # The large items are used from the start: they open the bins.
    nxt = [n_large] * n_large + list(range(n_large, n + 1))
    prv = [-1] * n_large + list(range(n_large, n))

    def next_unused(i: int) -> int:
        root = i
        while nxt[root] != root:
            root = nxt[root]
        while nxt[i] != root:  # path compression: point the whole walk at the answer
            nxt[i], i = root, nxt[i]
        return root

    def prev_unused(i: int) -> int:
        root = i
        while root >= 0 and prv[root] != root:
            root = prv[root]
        while i >= 0 and prv[i] != root and i != root:  # path compression, leftwards
            prv[i], i = root, prv[i]
        return root

    def place(j: int, b: int) -> None:
        bin_of[j] = b
        room[b] -= size[j]
        nxt[j] = j + 1  # used: both forests now step over j
        prv[j] = j - 1

    # Phase 2: the largest medium item that fits, forward through the large bins.
    has_medium = [False] * n_large
    if n_medium_end > n_large:
        for b in range(n_large):
            j = bisect_left(neg, -room[b], n_large, n_medium_end)
            if j < n_medium_end:
                j = next_unused(j)
                if j < n_medium_end:
                    place(j, b)
                    has_medium[b] = True

    # Phase 3: pairs of small items, backward through large bins that got no medium item.
    if n_small_end - n_medium_end >= 2:
        for b in range(n_large - 1, -1, -1):
            if has_medium[b]:
                continue
            # The two smallest unused small items (the highest positions of the slice).
            c1 = prev_unused(n_small_end - 1)
            c2 = prev_unused(c1 - 1) if c1 >= n_medium_end else -1
            if c2 < n_medium_end:
                break
            if size[c1] + size[c2] > room[b]:
                continue
            place(c1, b)
            # The largest small item that fits what is left; c2 fits, so one exists.
            j = next_unused(bisect_left(neg, -room[b], n_medium_end, n_small_end))
            place(j, b)

    # Phase 4: fill each large bin with the largest remaining items that fit. ``tail`` is the
    # smallest unused item: once it does not fit a bin, nothing does.
    tail = prev_unused(n - 1)
    for b in range(n_large):
        while tail >= n_large and size[tail] <= room[b]:
            j = next_unused(bisect_left(neg, -room[b], n_large, n))
            place(j, b)
            if j == tail:
                tail = prev_unused(tail - 1)
        if tail < n_large:
            break

    # Phase 5: first-fit decreasing for the rest, into new bins.
    out = np.asarray(bin_of, dtype=np.int64)
    rest = np.flatnonzero(out < 0)
    n_bins = n_large
    if len(rest):
        rest_bins, n_rest = first_fit_decreasing(sizes[rest], capacity)
        out[rest] = rest_bins + n_large
        n_bins += n_rest
    return out, n_bins
