"""Aligning a step by leaving a few of its examples (at most ``max_deferred``) for the next.

For a prefix of m examples packed into c bins, two ways to keep c - (c mod dp) bins: empty the
c mod dp lightest bins (their examples go, largest first, into the free room of the kept bins,
and those that fit nowhere are deferred), or defer the largest examples, as few as the token
bound allows, and repack the rest. Examples deferred by the previous step are never deferred
again. The emitted size must stay in the window and the next step's window must hold the
deferred examples. Fewest deferred examples first, then tokens nearest the anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_packing.packing.planner.bounds import SegmentBound
from megatron_packing.packing.planner.segments import Bins, SegmentPacker
from megatron_packing.packing.planner.window import StepContext, outward


@dataclass(frozen=True)
class Deferral:
    """A prefix of ``span`` examples whose ``kept`` bins align; ``moved`` positions lead the
    next step. ``packs`` prefixes were packed to find it."""

    span: int
    kept: Bins
    moved: list[int]
    packs: int


@dataclass(frozen=True)
class DeferralSearch:
    """Finds a `Deferral` for one step (see the module docstring)."""

    segments: SegmentPacker
    dp: int
    capacity: int
    max_deferred: int
    tries: int  # counts tried past the fewest the token bound allows (`PlannerTunables.defer_tries`)

    def search(self, lengths: np.ndarray, aligned: np.ndarray, bound: SegmentBound,
               context: StepContext, forced: int, target: int, tokens: np.ndarray, anchor: float,
               budget: int | None) -> Deferral | None:
        lowest, highest, _ = context.window()
        dp, limit = self.dp, self.max_deferred
        # A prefix of m examples emits m - (deferred) of them, so m may reach ``limit`` past
        # the window's top and still emit a size inside the window.
        top = min(highest + limit, len(lengths))
        best: tuple[tuple[int, float, int], int, Bins, list[int]] | None = None
        most = limit  # the fewest deferred examples found so far (at most the limit)
        footprint = np.minimum(aligned, self.capacity)  # what each example takes of its bin
        packs = 0
        for m in outward(target, lowest, top):
            if budget is not None and packs >= budget:
                break
            bins, _ = self.segments.segment(lengths, 0, m, bound)
            packs += 1
            count = len(bins)
            surplus = count % dp  # bins to remove to come down to a multiple of dp
            if count < dp or surplus == 0:
                continue
            # A prefix that must defer more than the best found so far is skipped unopened:
            # the same choice, without its refill and repacks.
            if self.fewest_deferred(footprint[:m], forced, count - surplus) > most:
                continue
            loads = [int(aligned[b].sum()) for b in bins]
            # The lightest bins have the fewest tokens to rehouse; a bin holding an example
            # deferred once already cannot be emptied (it would be deferred again).
            emptied = sorted((i for i in range(count) if min(bins[i]) >= forced),
                             key=lambda i: (loads[i], i))[:surplus]
            if len(emptied) < surplus:
                continue
            options = [self.refill(bins, loads, emptied, aligned)]
            largest = self.defer_largest(lengths[:m], aligned[:m], count - surplus, forced)
            if largest is not None:
                options.append(largest)
            for kept, moved in options:
                size = m - len(moved)
                if len(moved) > limit or not lowest <= size <= highest:
                    continue
                # The deferred examples lead the next step, so its smallest size must hold them.
                following = context.after(size)
                if following is None or following.window().lowest < len(moved):
                    continue
                kept_tokens = int(tokens[m]) - int(lengths[moved].sum())
                score = (len(moved), abs(kept_tokens - anchor), m)
                if best is None or score < best[0]:
                    best = (score, m, kept, moved)
                    most = len(moved)
        if best is None:
            return None
        _, m, kept, moved = best
        return Deferral(m, kept, moved, packs)

    def fewest_deferred(self, footprint: np.ndarray, forced: int, kept_bins: int) -> int:
        """A lower bound on the examples a prefix must defer to fit ``kept_bins`` bins.

        What leaves carries at least the prefix's excess over the kept bins' room, so at least as
        many examples as the fewest of its largest deferrable ones (positions >= forced) that sum
        to the excess; ``max_deferred`` + 1 when even the largest ``max_deferred`` do not."""
        excess = int(footprint.sum()) - kept_bins * self.capacity
        if excess <= 0:
            return 0
        heaviest = np.sort(footprint[forced:])[::-1][:self.max_deferred]
        return int(np.searchsorted(np.cumsum(heaviest), excess)) + 1

    def defer_largest(self, lengths: np.ndarray, aligned: np.ndarray, goal: int,
                      forced: int) -> tuple[Bins, list[int]] | None:
        """Defer the largest examples (positions >= forced) so that the rest pack into a multiple
        of dp no larger than ``goal``: as few as the token bound allows, then up to ``tries``
        more. Returns (bins of the kept prefix positions, deferred positions) or None."""
        limit, dp = self.max_deferred, self.dp
        if goal < dp:
            return None
        candidates = np.arange(forced, len(aligned))
        candidates = candidates[np.argsort(-aligned[forced:], kind="stable")][:limit]
        # goal bins hold at most goal x C tokens: the largest examples whose removal brings the
        # rest under that are the fewest worth trying (removed[j] = tokens of the j + 1 largest).
        footprint = np.minimum(aligned, self.capacity)
        excess = int(footprint.sum()) - goal * self.capacity
        removed = np.cumsum(footprint[candidates])
        first = int(np.searchsorted(removed, excess)) + 1 if excess > 0 else 1
        for count in range(first, min(first + self.tries, len(candidates) + 1)):
            moved = np.sort(candidates[:count])
            keep = np.ones(len(aligned), dtype=bool)
            keep[moved] = False
            positions = np.flatnonzero(keep)
            packed = self.segments.packer.pack(lengths[positions])
            self.segments.runs += 1
            if len(packed) % dp == 0 and dp <= len(packed) <= goal:
                return [[int(positions[i]) for i in b] for b in packed], moved.tolist()
        return None

    def refill(self, bins: Bins, loads: list[int], emptied: list[int],
               aligned: np.ndarray) -> tuple[Bins, list[int]]:
        """Bins without ``emptied``, their examples moved into free room where they fit.

        Returns the kept bins and the positions that fit nowhere (sorted)."""
        gone = set(emptied)
        kept = [list(b) for i, b in enumerate(bins) if i not in gone]
        free = [self.capacity - load for i, load in enumerate(loads) if i not in gone]
        leftover = []
        # Best fit decreasing into the kept bins' free room: largest first, tightest room.
        for p in sorted((p for i in emptied for p in bins[i]), key=lambda p: (-int(aligned[p]), p)):
            size = int(aligned[p])
            fitting = [j for j, room in enumerate(free) if room >= size]
            if not fitting:
                leftover.append(p)
                continue
            j = min(fitting, key=lambda j: (free[j], j))
            kept[j].append(p)
            free[j] -= size
        return kept, sorted(leftover)
