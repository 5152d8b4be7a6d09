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

The bound of ``[start, end)`` never decreases as ``end`` grows (every term is a count over the
segment). So along one start and increasing ends, the ends whose bound is one given multiple of
dp form one run; `BoundJudge.best_in_ranges` finds each run's edges by a sorted search per
term of the bound (`SegmentBound.reaching`; by bisection when own-bin examples add to the
largest term) instead of judging every end, and answers the lookahead's question (the best of
``aligns + value`` over a range of ends) from a range-maximum table of the values.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import numpy as np

from megatron_packing.packing.tunables import DEFAULT_TUNABLES, PlannerTunables

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

    def reaching(self, ends: np.ndarray) -> Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
        """``first(starts, low, high, target)``: for each i, the first j in [low[i], high[i])
        whose bound on [starts[i], ends[j]) is at least target[i] >= 1, or high[i] if none.
        ``ends`` must be non-decreasing (the bound then is too along each start)."""
        if self._own[-1] != 0:
            def bisect(starts: np.ndarray, low: np.ndarray, high: np.ndarray,
                       target: np.ndarray) -> np.ndarray:
                low, high = low.copy(), high.copy()
                while True:  # bisection over the rising bound
                    open_ = np.flatnonzero(low < high)
                    if open_.size == 0:
                        return low
                    mid = (low[open_] + high[open_]) // 2
                    reached = self(starts[open_], ends[mid]) >= target[open_]
                    high[open_] = np.where(reached, mid, high[open_])
                    low[open_] = np.where(reached, low[open_], mid + 1)
            return bisect
        # Without own-bin examples the bound is the largest of its terms, so it reaches the
        # target where its first term does; each term is a prefix-sum difference, found by
        # one sorted search along the ends.
        capacity = self.capacity
        tokens, tokens_at = self._tokens, self._tokens[ends]
        crowded = [(per_bin, counts, counts[ends]) for per_bin, counts in self._crowded]

        def first(starts: np.ndarray, low: np.ndarray, high: np.ndarray,
                  target: np.ndarray) -> np.ndarray:
            above = target.astype(np.int64) - 1
            # ceil((T[e] - T[s]) / C) >= X exactly when T[e] > T[s] + (X - 1) C.
            found = np.searchsorted(tokens_at, tokens[starts] + above * capacity, side="right")
            for per_bin, counts, counts_at in crowded:
                # ceil(n / t) >= X exactly when n >= (X - 1) t + 1.
                reach = np.searchsorted(counts_at, counts[starts] + (above * per_bin + 1),
                                        side="left")
                np.minimum(found, reach, out=found)
            return np.clip(found, low, high)
        return first

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

    def by_ranges(self, rows: int, columns: int) -> bool:
        """Judge a grid this large row by row (`best_in_ranges`) rather than cell by cell?"""
        return rows * columns > self.tunables.range_judge_cells

    def best_in_ranges(self, starts: np.ndarray, ends: np.ndarray, low: np.ndarray,
                       high: np.ndarray, values: np.ndarray) -> np.ndarray:
        """For each ``starts[i]``: the largest ``aligns(start, ends[j]) + values[j]`` over
        ``low[i] <= j < high[i]``, or -1 where that range is empty.

        ``ends`` must be strictly increasing. The same numbers as judging the whole
        (start, end) grid, from a few sorted searches per row and multiple of dp that the
        row's bounds span.
        """
        dp = self.dp
        out = np.full(starts.shape, -1, dtype=np.int64)
        rows = np.flatnonzero(high > low)
        if rows.size == 0:
            return out
        table = range_max_table(values)
        s, lo, hi = starts[rows], low[rows], high[rows]
        best = range_max(table, lo, hi)
        # The bound along each row rises with the end: the multiples of dp it can meet lie
        # between its values at the range's two edges.
        multiple = np.maximum(-(-self.bound(s, ends[lo]) // dp), 1) * dp
        last = self.bound(s, ends[hi - 1])
        reach = self.bound.reaching(ends)
        while True:
            live = np.flatnonzero(multiple <= last)
            if live.size == 0:
                break
            ls, llo, lhi, target = s[live], lo[live], hi[live], multiple[live]
            # The ends whose bound is exactly ``target``: from the first at or above it to the
            # first above it.
            begin = reach(ls, llo, lhi, target)
            stop = reach(ls, begin, lhi, target + 1)
            hit = stop > begin
            if hit.any():
                index = live[hit]
                best[index] = np.maximum(best[index], range_max(table, begin[hit], stop[hit]) + 1)
            multiple[live] += dp
        out[rows] = best
        return out


def range_max_table(values: np.ndarray) -> np.ndarray:
    """Sparse table: row k holds the maximum of each window of 2**k values starting there
    (padded at the end to the values' length; queries never read the padding)."""
    table = [values]
    width = 1
    while 2 * width <= len(values):
        last = table[-1]
        table.append(np.concatenate((np.maximum(last[:-width], last[width:]), last[-width:])))
        width *= 2
    return np.stack(table)


def range_max(table: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """max(values[low:high]) for each non-empty range (two overlapping power-of-2 windows)."""
    level = np.frexp(high - low)[1] - 1  # floor(log2(span)), exact for integers below 2**53
    return np.maximum(table[level, low], table[level, high - np.left_shift(1, level)])


class PairJudge:
    """A pair-by-pair test (1-d starts and ends of equal length), such as real packer counts."""

    broadcasts = False

    def __init__(self, test: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
        self.test = test

    def __call__(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return self.test(starts, ends)
