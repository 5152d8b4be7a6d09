"""Changing a packing's bin count: balanced splitting up, fixed-count repacking down.

* :func:`split_to_count` raises the count. It repeatedly takes the heaviest bin holding two or
  more items (ties: lowest bin index) and splits it into two halves of near-equal load
  (items largest first, each into the lighter half). The first half keeps the bin's place;
  the second half is appended. Halves of a fitting bin fit, so feasibility is kept.
* :func:`fit_into_count` lowers it: it packs into exactly ``k`` bins with first fit, best fit
  and worst fit (spreads load; often wins on small instances) capped at ``k`` bins, and, when items are left over, runs a bounded repair
  (move a leftover into a bin by evicting a strictly smaller item, so the leftover total
  shrinks every step).
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush

import numpy as np

from .fit import (
    best_fit_decreasing,
    first_fit_decreasing,
    group_by_bin,
    worst_fit_decreasing,
)
from .tunables import DEFAULT_TUNABLES


def split_to_count(bins: list[list[int]], sizes: list[int], target: int) -> list[list[int]]:
    """Split the heaviest multi-item bins until there are ``target`` bins (or none can split).

    ``bins`` hold item ids, ``sizes[id]`` their (aligned) sizes. Items inside each bin stay
    sorted ascending.
    """
    bins = [list(b) for b in bins]
    # Max-heap by load (negated), ties to the lowest bin index; single items cannot split.
    heap = [(-sum(sizes[i] for i in b), idx) for idx, b in enumerate(bins) if len(b) >= 2]
    heapify(heap)
    while len(bins) < target and heap:
        _, idx = heappop(heap)
        # Largest first, each item into the lighter half (the LPT rule) keeps the halves
        # near-equal; each half is a subset of a fitting bin, so it fits too.
        # By size descending, ties by id ascending: a stable reverse sort of the ids in order
        # (C-level keys; a Python key function was a quarter of a padded step at B = 4096).
        items = sorted(sorted(bins[idx]), key=sizes.__getitem__, reverse=True)
        first: list[int] = []
        second: list[int] = []
        load_first = load_second = 0
        for i in items:
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


def _repair(bins: list[list[int]], sizes: list[int], capacity: int, pending: list[int]) -> bool:
    """Place ``pending`` items (ids into ``sizes``) into ``bins`` by bounded evictions."""
    loads = [sum(sizes[i] for i in b) for b in bins]
    if sum(sizes[i] for i in pending) > capacity * len(bins) - sum(loads):
        return False  # not enough free room in total: no sequence of moves can succeed
    heap = [(-sizes[i], i) for i in pending]
    heapify(heap)
    evictions = 0
    while heap:
        neg_s, x = heappop(heap)  # largest pending item first
        s = -neg_s
        best_bin, best_room = -1, capacity + 1  # best fit: the tightest room that holds x
        for b, load in enumerate(loads):
            room = capacity - load
            if s <= room < best_room:
                best_bin, best_room = b, room
        if best_bin >= 0:
            bins[best_bin].append(x)
            loads[best_bin] += s
            continue
        evictions += 1
        if evictions > DEFAULT_TUNABLES.repair_budget:  # `PlannerTunables.repair_budget`
            return False
        # Evict the smallest item y < s whose removal makes room for x. The pending total then
        # drops by s - y > 0, so repairs make progress; the budget bounds their number.
        victim, victim_bin, victim_size = -1, -1, s
        for b, items in enumerate(bins):
            need = s - (capacity - loads[b])
            for y in items:
                sy = sizes[y]
                if need <= sy < victim_size:
                    victim, victim_bin, victim_size = y, b, sy
        if victim < 0:
            return False
        bins[victim_bin].remove(victim)
        bins[victim_bin].append(x)
        loads[victim_bin] += s - victim_size
        heappush(heap, (-victim_size, victim))
    return True


def fit_into_count(sizes: np.ndarray, capacity: int, k: int) -> list[list[int]] | None:
    """Pack sizes (sorted largest first) into exactly ``k`` non-empty fitting bins, or None.

    Returned bins hold indices into ``sizes``, each bin sorted ascending.
    """
    n = len(sizes)
    if k <= 0 or n < k:
        return None
    best: tuple[np.ndarray, list[int], int] | None = None  # (bin_of, left over, their total)
    for kernel in (first_fit_decreasing, best_fit_decreasing, worst_fit_decreasing):
        bin_of, _ = kernel(sizes, capacity, k)
        left = bin_of < 0
        if not left.any():
            best = (bin_of, [], 0)
            break
        left_total = int(sizes[left].sum())
        if best is None or left_total < best[2]:
            best = (bin_of, np.flatnonzero(left).tolist(), left_total)
    assert best is not None
    size_list = sizes.tolist()
    bin_of, pending = best[0], best[1]
    bins = group_by_bin(bin_of, k)
    if pending and not _repair(bins, size_list, capacity, pending):
        return None
    bins = [sorted(b) for b in bins if b]
    return split_to_count(bins, size_list, k)
