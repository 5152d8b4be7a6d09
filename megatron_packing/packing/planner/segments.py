"""Packing a prefix or segment of the read-ahead, reaching for a multiple of dp.

`SegmentPacker.evaluate` packs; when the natural count is not a multiple of dp, a packing
capped at the first multiple of dp at or above the lower bound may still exist.
`SegmentPacker.segment` does the same for ``lengths[start:end]``, memoised by content across
steps (a bounded cache: plans never depend on it, so a resumed run plans the same).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from megatron_packing.packing.algorithms import SeqPacker
from megatron_packing.packing.dp_rounding import Bins, first_multiple
from megatron_packing.packing.planner.bounds import SegmentBound
from megatron_packing.packing.tunables import DEFAULT_TUNABLES, PlannerTunables


class SegmentPacker:
    """A packer for one dp size, with a content-keyed memo of packed segments."""

    def __init__(self, packer: SeqPacker, dp: int, tunables: PlannerTunables = DEFAULT_TUNABLES) -> None:
        self.packer = packer
        self.dp = dp
        self.memo_limit = tunables.memo_examples
        self._memo: OrderedDict[bytes, tuple[tuple[tuple[int, ...], ...], bool]] = OrderedDict()
        self._memo_examples = 0
        self.runs = 0  # packer runs really made (memo misses), for the plans' reports

    def evaluate(self, lengths: np.ndarray, bound: int) -> tuple[Bins, bool]:
        """Pack a prefix; try to reach a multiple of dp between the bound and the natural count."""
        bins = self.packer.pack(lengths)
        count = len(bins)
        dp = self.dp
        if count % dp == 0 and count >= dp:
            return bins, True
        # The natural count overshoots. A multiple of dp at or above the lower bound but below
        # the natural count may still be reachable by a packing capped at that many bins.
        target = first_multiple(bound, dp)
        if target < count:
            tighter = self.packer.pack_to_count(lengths, target)
            if tighter is not None:
                return tighter, True
        return bins, False

    def segment(self, lengths: np.ndarray, start: int, end: int,
                bound: SegmentBound) -> tuple[Bins, bool]:
        """`evaluate` of lengths[start:end], memoised by content across steps."""
        segment = lengths[start:end]
        key = segment.tobytes()
        hit = self._memo.get(key)
        # Keyed by the lengths themselves, not by position: the next step sees the same examples
        # at other offsets, and the result depends only on the lengths.
        if hit is None:
            lower = int(bound(np.array([start]), np.array([end]))[0])
            bins, flag = self.evaluate(segment, lower)
            # Tuples of ints: the garbage collector untracks them, so a full collection does
            # not walk the whole memo (lists made every such collection a 100+ ms stall).
            hit = (tuple(tuple(b) for b in bins), flag)
            self.runs += 1
            self._memo[key] = hit
            self._memo_examples += len(segment)
            while self._memo_examples > self.memo_limit:  # least recently used first
                _, (old_bins, _) = self._memo.popitem(last=False)
                self._memo_examples -= sum(len(b) for b in old_bins)
        else:
            self._memo.move_to_end(key)
        return [list(b) for b in hit[0]], hit[1]
