"""Shared helpers for the packing tests: fit checks and an exact bin-packing solver."""

from __future__ import annotations

import numpy as np

from megatron_packing.packing.alignment import Alignment


def check_partition(bins: list[list[int]], n: int) -> None:
    """Every position 0..n-1 appears exactly once; positions inside a bin ascend."""
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(n))
    for b in bins:
        assert b == sorted(b)


def check_fits(bins: list[list[int]], lengths, alignment: Alignment, capacity: int) -> None:
    """No bin's footprint exceeds the capacity."""
    lengths = np.asarray(lengths)
    for b in bins:
        assert alignment.footprint(lengths[b]) <= capacity, (b, lengths[b])


def optimal_bins(sizes: list[int], capacity: int) -> int:
    """Fewest bins of ``capacity`` holding ``sizes`` (exhaustive search with pruning)."""
    items = sorted(sizes, reverse=True)
    best = len(items)

    def search(i: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if i == len(items):
            best = len(loads)
            return
        remaining = sum(items[i:])
        free = sum(capacity - x for x in loads)
        if len(loads) + max(0, -(-(remaining - free) // capacity)) >= best:
            return
        seen = set()
        for b, load in enumerate(loads):
            if load + items[i] <= capacity and load not in seen:
                seen.add(load)
                loads[b] += items[i]
                search(i + 1, loads)
                loads[b] -= items[i]
        loads.append(items[i])
        search(i + 1, loads)
        loads.pop()

    search(0, [])
    return best
