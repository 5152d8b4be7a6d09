"""A lower bound on the bins of any stream segment in O(1), and judges of whether one aligns.

`SegmentBound` holds prefix sums of one read-ahead; ``bound(starts, ends)`` gives, for each
segment ``[start, end)``, the largest of: tokens over the capacity (no bin holds more than C);
and, for t = 1, 2 and 3, the examples strictly above C / (t + 1) over t, rounded up (t + 1 of
them exceed C, so no bin holds more than t; with t = 1 every example above half the capacity
has a bin of its own). An example of exactly C / (t + 1) is not crowded: t + 1 of them fill a
bin exactly. Own-bin oversize examples add one bin each. The packers reach this bound on most
real steps, so it doubles as the estimate used to plan ahead.

A `SegmentJudge` says whether each segment packs into a multiple of dp (at least dp bins).
`BoundJudge` judges by the bound, element-wise (it takes whole (boundary, next boundary) grids
and remembers them across steps); `PairJudge` wraps any pair-by-pair test, such as real packer
counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import numpy as np

from megatron_packing.packing.planner.tunables import DEFAULT_TUNABLES, PlannerTunables

CROWDED_PER_BIN = (1, 2, 3)  # t: no bin holds more than t examples above C / (t + 1)


class SegmentBound:
    """Lower bounds on the bins of segments of one read-ahead (its packer-aligned sizes)."""

    def __init__(self, aligned: np.ndarray, capacity: int) -> None:
        self.aligned = aligned  # what every bound depends on (a grid cache keys by it)
        self.capacity = capacity
        oversize = aligned > capacity
        tokens = np.cumsum(np.where(oversize, 0, aligned), dtype=np.int64)
        # int32 when the read-ahead's tokens fit: the grids judged ahead are about twice as
        # fast in it, and the bounds are the same.
        dtype = np.int32 if tokens.size == 0 or tokens[-1] < 2**31 - capacity else np.int64
        zero = np.zeros(1, dtype=dtype)

        # Prefix sums turn every segment's total into two lookups: total[s:e] = p[e] - p[s].
        def prefix(values: np.ndarray) -> np.ndarray:
            return np.concatenate((zero, np.cumsum(values, dtype=dtype)))

        self._tokens = np.concatenate((zero, tokens.astype(dtype)))
        self._own = prefix(oversize)
        self._crowded = [(t, prefix((aligned * (t + 1) > capacity) & ~oversize))
                         for t in CROWDED_PER_BIN]

    def __call__(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """A lower bound on the bins of each segment ``[start, end)`` (broadcasting)."""
        capacity = self.capacity
        # ceil(a / b) as (a + b - 1) // b: the totals are never negative.
        bound = (self._tokens[ends] - self._tokens[starts] + (capacity - 1)) // capacity
        for per_bin, counts in self._crowded:
            crowd = counts[ends] - counts[starts]
            if per_bin > 1:
                crowd = (crowd + (per_bin - 1)) // per_bin
            np.maximum(bound, crowd, out=bound)
        bound += self._own[ends]
        bound -= self._own[starts]
        return bound

    def prefixes(self, highest: int) -> np.ndarray:
        """lb[k] = the bound on the first k examples, k = 0..highest (lb[0] = 0)."""
        ends = np.arange(highest + 1)
        return self(np.zeros_like(ends), ends)


def aligns(counts: np.ndarray, dp: int) -> np.ndarray:
    """Whether each bin count is a multiple of dp with at least dp bins (one per rank)."""
    return (counts % dp == 0) & (counts >= dp)


class SegmentJudge(Protocol):
    """(starts, ends) -> whether each segment ``[start, end)`` packs into a multiple of dp."""

    broadcasts: bool  # True: takes a (boundaries x next boundaries) grid at once

    def __call__(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray: ...


class BoundJudge:
    """Judges segments by the bound: does it reach a multiple of dp?

    A grid of (boundary, next boundary) pairs is remembered by the examples it spans and the
    pairs' places among them: the next step judges most of the same pairs again (a boundary j
    steps ahead now is j - 1 steps ahead then). The cache is shared across read-aheads and
    changes no judgement."""

    broadcasts = True

    def __init__(self, bound: SegmentBound, dp: int,
                 grids: OrderedDict[tuple[object, ...], np.ndarray] | None = None,
                 tunables: PlannerTunables = DEFAULT_TUNABLES) -> None:
        self.bound = bound
        self.dp = dp
        self.grids = grids
        self.tunables = tunables

    def judge(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return aligns(self.bound(starts, ends), self.dp)

    def __call__(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        grids = self.grids
        if grids is None or starts.ndim != 2 or starts.size * ends.size < self.tunables.grid_cache_cells:
            return self.judge(starts, ends)
        low, high = int(starts.min()), int(ends.max())
        key = (self.bound.aligned[low:high].tobytes(), (starts - low).tobytes(),
               (ends - low).tobytes(), starts.shape, ends.shape)
        grid = grids.get(key)
        if grid is None:
            grid = self.judge(starts, ends)
            grid.flags.writeable = False  # shared by later steps
            grids[key] = grid
            if len(grids) > self.tunables.grids_remembered:
                grids.popitem(last=False)  # the oldest
        else:
            grids.move_to_end(key)
        return grid


class PairJudge:
    """A pair-by-pair test (1-d starts and ends of equal length), such as real packer counts."""

    broadcasts = False

    def __init__(self, test: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        self.test = test

    def __call__(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return self.test(starts, ends)
