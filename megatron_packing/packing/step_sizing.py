"""Choosing a step's batch size so that its bin count divides by the data-parallel size.

The examples arrive in a fixed order; a step takes a prefix of what is left. Its size may differ
from the nominal batch size B by at most v examples, and the running drift
``emitted - steps x B`` (counted within the epoch) stays within +-v. Inside that window we look
for a size whose packed bin count is a multiple of dp, so that no rank idles.

Most sizes can be ruled out without packing. A prefix's bin count is never below a lower bound
computed in O(1) from prefix sums (tokens over capacity, and counts of examples too large to
share a bin), and on large windows the packers almost always reach it.

How much is packed adapts to the window. When (sizes in the window) x (largest size) is small
(``FULL_SEARCH_EXAMPLES``), every size is packed, so the step is never behind an exhaustive
search; if the window is also small enough, planning ahead uses real packer counts (memoised by
content across steps) for the next step, where the bound is often loose (examples a third of the
capacity). On larger windows a budget of packs is spent in the order the bound suggests:

1. sizes whose bound is a multiple of dp, then sizes one bin above one;
2. within each group, the sizes after which most of the next ``horizon - 1`` steps can still
   align, judged by a backward pass over (step, boundary offset) with the same bound;
3. then the tokens nearest the expected tokens of a target-sized step, then nearest the target.

A step that can align always does; planning ahead only chooses among such sizes. With bounded
deferral, a step that cannot align may leave a few examples of its window to lead the next step.
Otherwise the step is padded: among the sizes packed, the one after which most of the next steps
can align, then one whose tokens stay within a fixed-B step's token spread of the anchor, then
the least of (squared token distance from the anchor, in spreads) + ``PADDING_WEIGHT`` per
padding bin: a padding bin less puts more of the stream into bins spent anyway, but not at any
cost to the token load. The missing bins are made by splitting the heaviest bins, so every rank
still gets real work.

Pure numpy: no torch, no ranks, no files.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from megatron_packing.packing.algorithms import SeqPacker
from megatron_packing.packing.rebin import split_to_count
from megatron_packing.validation import require_int

STEP_NORMAL = "normal"
STEP_EPOCH_TAIL = "epoch_tail"  # the epoch's last step: takes what remains
STEP_RUN_FINAL = "run_final"  # the run's last scheduled step: repays the drift exactly

SegmentBounds = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(starts, ends) -> a lower bound on the bins of each stream segment ``[start, end)``."""
SegmentTest = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""(starts, ends) -> whether each stream segment ``[start, end)`` packs into a multiple of dp."""


@dataclass(frozen=True)
class StepContext:
    """Where the stream stands before a step; everything the window depends on."""

    batch_size: int  # B
    variation: int  # v
    drift: int  # examples emitted in this epoch minus steps taken x B
    remaining: int  # examples left in the epoch, >= 1
    steps_left_in_epoch: int  # including this step, >= 1
    steps_left_in_run: int | None = None  # including this step; None when there is no horizon

    @property
    def kind(self) -> str:
        if self.steps_left_in_epoch <= 1:
            return STEP_EPOCH_TAIL
        if self.steps_left_in_run == 1:
            return STEP_RUN_FINAL
        return STEP_NORMAL

    def window(self) -> tuple[int, int, int]:
        """(lowest, highest, target) size for this step; lowest == highest when it is forced."""
        batch, v, drift = self.batch_size, self.variation, self.drift
        if self.kind == STEP_EPOCH_TAIL:
            return self.remaining, self.remaining, self.remaining
        # Every later step of the epoch needs at least one example.
        cap = self.remaining - (self.steps_left_in_epoch - 1)
        if self.kind == STEP_RUN_FINAL:
            size = max(1, min(batch - drift, cap))
            return size, size, size
        # Two windows intersect: the size itself within B +- v, and the drift after the step,
        # drift + size - B, within +-v. The cap may squeeze the window below B - v near the
        # epoch's end; lowest then follows it down.
        lowest = max(batch - v, batch - v - drift, 1)
        highest = min(batch + v, batch + v - drift, cap)
        lowest = min(lowest, highest)
        # B - drift would bring the drift back to 0: the nominal size, clipped into the window.
        target = min(max(batch - drift, lowest), highest)
        return lowest, highest, target

    def after(self, size: int) -> StepContext | None:
        """The next step's context after taking ``size`` examples (None if the epoch ends)."""
        if self.steps_left_in_epoch <= 1:
            return None
        steps_left_in_run = None if self.steps_left_in_run is None else self.steps_left_in_run - 1
        if steps_left_in_run == 0:
            return None
        return replace(
            self,
            drift=self.drift + size - self.batch_size,
            remaining=self.remaining - size,
            steps_left_in_epoch=self.steps_left_in_epoch - 1,
            steps_left_in_run=steps_left_in_run,
        )

    def lookahead_need(self, steps: int = 2) -> int:
        """Examples to read ahead so that this step and the ``steps - 1`` after it can be judged."""
        _, highest, _ = self.window()
        if steps <= 1 or self.after(highest) is None:
            return min(self.remaining, highest)
        # Any later step's window ends at most B + v past the previous boundary.
        return min(self.remaining, highest + (steps - 1) * (self.batch_size + self.variation))


# The whole window is packed when (sizes in the window) x (largest size) is at most this many
# examples; above it, the search packs at most max_packs sizes (the fast path).
FULL_SEARCH_EXAMPLES = 16_384
# Planning ahead uses real packer counts (memoised) when (sizes in the window)^2 x (largest
# size) is at most this many examples, and the O(1) bound otherwise.
EXACT_LOOKAHEAD_EXAMPLES = 32_768
# Steps planned together by default (``lookahead_steps``). Measured on the six study geometries
# and two streams: against 3, more steps align (64.3% against 61.0% at 128 / 4K / dp 8) and the
# bins are fewer or the same, for about 1 ms more planning a step at B = 1024.
DEFAULT_LOOKAHEAD_STEPS = 6
# What a padding bin of a padded step weighs against its squared token distance from the anchor
# (in fixed-B token spreads; squared, since the token CV is a mean of squares and one far step
# costs more than several near ones). Measured on the six study geometries and two streams: at
# 0.2-0.4 every one keeps fewer bins than the exhaustive search and a token CV no higher than
# fixed B's. Ranking by padding first keeps the bins but raises the CV at dp 16; ranking by
# tokens alone loses bins at dp 8.
PADDING_WEIGHT = 0.3
# Grids of (boundary, next boundary) judgements remembered across steps (a pure cache): about
# two steps' worth at the default lookahead.
GRIDS_REMEMBERED = 12
# Packed segments remembered across steps, counted in examples held (a pure cache: plans never
# depend on it). About three steps' segments of the exact lookahead at B=128.
MEMO_EXAMPLES = 65_536


@dataclass
class SizingDecision:
    """The chosen size and its bins (positions into the step's prefix of ``span`` examples)."""

    size: int  # examples emitted by this step
    bins: list[list[int]]  # a multiple of dp; empty lists are placeholder bins
    packed_bins: int  # the count the packer reached for these examples
    padding_bins: int  # bins added beyond packed_bins to reach a multiple of dp
    placeholder_bins: int  # bins with no example at all
    aligned: bool  # packed_bins is a multiple of dp: no padding bin was needed
    packs: int  # segments evaluated by the search (memo hits included, so plans never depend on it)
    hopeless: bool = False  # no size in the window could align (too few bins for dp)
    candidates: list[int] = field(default_factory=list)  # sizes that were packed, in order
    span: int = 0  # examples of the read-ahead consumed: size + deferred
    deferred: list[int] = field(default_factory=list)  # positions (< span) left for the next step
    packer_runs: int = 0  # packer runs really made for this step, lookahead included


class StepSizer:
    """Picks step sizes for a packer and a data-parallel size.

    ``lengths`` passed to `decide` are the raw lengths of the examples ahead, in stream order;
    ``aligned`` are their aligned sizes as the packer sees them (own-bin oversize examples larger
    than the usable capacity). ``max_deferred`` > 0 lets a step that cannot align leave up to
    that many examples of its window to lead the next step. Among equally good sizes, the one
    whose tokens are nearest the target times the mean length of the examples read ahead wins:
    token load per step stays even while the drift is still repaid.
    """

    def __init__(
        self,
        packer: SeqPacker,
        dp_size: int,
        *,
        max_packs: int | None = 8,
        bound_slack: int = 1,
        horizon: int = DEFAULT_LOOKAHEAD_STEPS,
        max_deferred: int = 0,
        full_search_examples: int = FULL_SEARCH_EXAMPLES,
        exact_lookahead_examples: int = EXACT_LOOKAHEAD_EXAMPLES,
    ) -> None:
        dp = require_int("dp_size", dp_size, minimum=1, error=ValueError)
        deferred = require_int("max_deferred", max_deferred, minimum=0, error=ValueError)
        assert dp is not None and deferred is not None  # allow_none is off
        self.packer = packer
        self.dp_size = dp
        self.max_packs = None if max_packs is None else int(max_packs)
        self.bound_slack = int(bound_slack)
        self.horizon = max(1, int(horizon))
        self.max_deferred = deferred
        self.full_search_examples = int(full_search_examples)
        self.exact_lookahead_examples = int(exact_lookahead_examples)
        self.unlikely_packs = 3  # the fast path's budget when no size's bound is a multiple of dp
        self.capacity = packer.usable_capacity
        self._memo: OrderedDict[bytes, tuple[tuple[tuple[int, ...], ...], bool]] = OrderedDict()
        self._memo_examples = 0
        self._grids: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()
        self._runs = 0

    # ------------------------------------------------------------------ budget
    def budget(self, lowest: int, highest: int) -> int | None:
        """Packs allowed to the search: None (the whole window) when the window is cheap."""
        if self.max_packs is None:
            return None
        sizes = highest - lowest + 1
        # Packing is about linear in the examples packed, so packing every size costs about
        # sizes x highest example placements: below the threshold a full search is affordable
        # and the step is never behind one that packs every size.
        if sizes * highest <= self.full_search_examples:
            return None
        return self.max_packs

    def exact_lookahead(self, lowest: int, highest: int) -> bool:
        """Plan ahead with real packer counts? Only when the whole window is searched anyway."""
        sizes = highest - lowest + 1
        # The next step's segments run from each candidate boundary to each boundary after it:
        # about sizes^2 segments of up to highest examples each (memoised across steps).
        return (self.budget(lowest, highest) is None
                and sizes * sizes * highest <= self.exact_lookahead_examples)

    # ------------------------------------------------------------------ bounds
    def lower_bounds(self, aligned: np.ndarray) -> np.ndarray:
        """lb[k] = a lower bound on the bins of the first k examples (lb[0] = 0)."""
        ends = np.arange(len(aligned) + 1)
        return self._segment_estimator(aligned)(np.zeros_like(ends), ends)

    def _promising(self, bound: int) -> bool:
        """Could this prefix pack into a multiple of dp? (Its count is rarely above bound + slack.)"""
        dp = self.dp_size
        # -(-a // b) is ceil(a / b) in integers; a step needs at least dp bins (one per rank).
        first_multiple = max(dp, -(-bound // dp) * dp)
        return first_multiple <= bound + self.bound_slack

    # ------------------------------------------------------------------ evaluation
    def _evaluate(self, lengths: np.ndarray, bound: int) -> tuple[list[list[int]], bool]:
        """Pack a prefix; try to reach a multiple of dp between the bound and the natural count."""
        bins = self.packer.pack(lengths)
        count = len(bins)
        dp = self.dp_size
        if count % dp == 0 and count >= dp:
            return bins, True
        # The natural count overshoots. A multiple of dp at or above the lower bound but below
        # the natural count may still be reachable by a packing capped at that many bins.
        target = max(dp, -(-bound // dp) * dp)
        if target < count:
            tighter = self.packer.pack_to_count(lengths, target)
            if tighter is not None:
                return tighter, True
        return bins, False

    def _segment(self, lengths: np.ndarray, start: int, end: int,
                 estimate: SegmentBounds) -> tuple[list[list[int]], bool]:
        """`_evaluate` of lengths[start:end], memoised by content across steps."""
        segment = lengths[start:end]
        key = segment.tobytes()
        hit = self._memo.get(key)
        # Keyed by the lengths themselves, not by position: the next step sees the same examples
        # at other offsets, and the result depends only on the lengths.
        if hit is None:
            bound = int(estimate(np.array([start]), np.array([end]))[0])
            bins, flag = self._evaluate(segment, bound)
            # Tuples of ints: the garbage collector untracks them, so a full collection does
            # not walk the whole memo (lists made every such collection a 100+ ms stall).
            hit = (tuple(tuple(b) for b in bins), flag)
            self._runs += 1
            self._memo[key] = hit
            self._memo_examples += len(segment)
            while self._memo_examples > MEMO_EXAMPLES:  # least recently used first
                _, (old_bins, _) = self._memo.popitem(last=False)
                self._memo_examples -= sum(len(b) for b in old_bins)
        else:
            self._memo.move_to_end(key)
        return [list(b) for b in hit[0]], hit[1]

    def _pad(self, lengths: np.ndarray, bins: list[list[int]],
             sizes: np.ndarray | None = None) -> tuple[list[list[int]], int]:
        """Raise the bin count to a multiple of dp (at least dp) with balanced non-empty bins.
        With ``sizes`` (the packer's sizes of ``lengths``; ``bins`` its natural packing) the bins
        are split directly: what ``pack_to_count`` does after packing them again."""
        dp = self.dp_size
        count = len(bins)
        target = max(dp, -(-count // dp) * dp)
        if target == count:
            return bins, 0
        items = len(lengths)
        if items >= target:  # more bins than the natural count: balanced splits of the heaviest
            natural = (sizes is not None and not self.packer.min_bin_count
                       and self.packer.bin_count_multiple in (None, 1))
            split = (split_to_count(bins, sizes.tolist(), target) if natural and sizes is not None
                     else self.packer.pack_to_count(lengths, target))
            if split is not None and len(split) == target:
                return split, 0
        # Fewer examples than rows: one example per row, the rest are placeholder rows.
        spread = [[i] for i in range(items)] if items <= target else bins
        placeholders = target - len(spread)
        return spread + [[] for _ in range(placeholders)], placeholders

    # ------------------------------------------------------------------ planning ahead
    def _segment_estimator(self, aligned: np.ndarray) -> SegmentBounds:
        """A function (starts, ends) -> lower bounds on the bins of stream segments, O(1) each.

        The largest of: tokens over the capacity (no bin holds more than C); and, for t = 1, 2
        and 3, the examples above C / (t + 1) over t, rounded up (t + 1 of them exceed C, so no
        bin holds more than t: with t = 1, every example above half the capacity has a bin of
        its own). Own-bin oversize examples add one bin each. The packers here reach this bound
        on most real steps, so it doubles as the estimate used to plan ahead.
        """
        capacity = self.capacity
        oversize = aligned > capacity
        tokens = np.cumsum(np.where(oversize, 0, aligned), dtype=np.int64)
        # int32 when the read-ahead's tokens fit: the grids judged ahead are about twice as
        # fast in it, and the bounds are the same.
        dtype = np.int32 if tokens.size == 0 or tokens[-1] < 2**31 - capacity else np.int64
        zero = np.zeros(1, dtype=dtype)

        # Prefix sums turn every segment's total into two lookups: total[s:e] = p[e] - p[s].
        def prefix(values: np.ndarray) -> np.ndarray:
            return np.concatenate((zero, np.cumsum(values, dtype=dtype)))

        token_sums = np.concatenate((zero, tokens.astype(dtype)))
        own = prefix(oversize)
        crowded = [(t, prefix((aligned * (t + 1) > capacity) & ~oversize)) for t in (1, 2, 3)]

        def estimate(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
            # ceil(a / b) as (a + b - 1) // b: the totals are never negative.
            bound = (token_sums[ends] - token_sums[starts] + (capacity - 1)) // capacity
            for per_bin, counts in crowded:
                crowd = counts[ends] - counts[starts]
                if per_bin > 1:
                    crowd = (crowd + (per_bin - 1)) // per_bin
                np.maximum(bound, crowd, out=bound)
            bound += own[ends]
            bound -= own[starts]
            return bound

        estimate.source = aligned  # type: ignore[attr-defined]  # what every bound depends on
        return estimate

    def _future_alignment(self, aligns: SegmentTest, available: int, context: StepContext,
                          sizes: list[int], aligns_later: SegmentTest | None = None,
                          onward_only: bool = False) -> Any:
        """For each candidate size: how many of the next steps can still align after it.

        Boundary j of the next few steps may sit anywhere within +-v of its nominal place
        j x B, consecutive boundaries within v of each other (the step-size window). A backward
        pass over (step, offset) gives, for each boundary, the most steps after it that can
        align; ``aligns(starts, ends)`` judges the next step's segments (the bound, or real packer
        counts) and ``aligns_later`` (default: the same) those of the steps after it. Only the
        examples read ahead are considered. With ``onward_only``, returns instead the next
        step's end boundaries (offsets, positions, is_tail) and the most aligned steps after
        each (None when there is none), for a caller that judges the next step itself.
        """
        batch, v = context.batch_size, context.variation
        # Boundary positions of later steps, layer by layer (relative to the current position).
        # The stream stands at (steps taken) x B + drift, so the boundary after ``layer`` more
        # steps, ``offset`` from its nominal place, is ``layer x B - drift + offset`` ahead.
        layers: list[tuple[np.ndarray, np.ndarray, bool]] = []  # (offsets, positions, is_tail)
        step_context = context.after(sizes[0]) if sizes else None
        for layer in range(2, self.horizon + 1):
            if step_context is None:
                break
            kind = step_context.kind
            if kind == STEP_EPOCH_TAIL:  # the epoch's last step ends exactly at its end
                offsets = np.zeros(1, dtype=np.int64)
                positions = np.array([context.remaining], dtype=np.int64)
            else:  # +-v while the drift may float; 0 for the run's final step, which repays it
                offsets = (np.arange(-v, v + 1, dtype=np.int64) if kind == STEP_NORMAL
                           else np.zeros(1, dtype=np.int64))
                positions = layer * batch - context.drift + offsets
                # Leave at least one example for each later step of the epoch.
                keep = positions <= context.remaining - (step_context.steps_left_in_epoch - 1)
                offsets, positions = offsets[keep], positions[keep]
            keep = positions <= available  # only what was read ahead can be judged
            offsets, positions = offsets[keep], positions[keep]
            if positions.size == 0:
                break
            layers.append((offsets, positions, kind == STEP_EPOCH_TAIL))
            # Only the kind of the following steps matters here, not their drift.
            step_context = replace(step_context, drift=0).after(batch)

        def best_onward(offsets: np.ndarray, positions: np.ndarray,
                        nxt: tuple[np.ndarray, np.ndarray, bool], best_after: np.ndarray,
                        judge: SegmentTest) -> np.ndarray:
            """Most aligned steps from each boundary, over the step to the next layer and on."""
            next_offsets, next_positions, next_tail = nxt
            # A step takes at least one example, and its size B + (offset change) stays within
            # B +- v, so consecutive offsets differ by at most v (the tail takes what is left).
            valid = next_positions[None, :] - positions[:, None] >= 1
            if not next_tail:
                valid &= np.abs(next_offsets[None, :] - offsets[:, None]) <= v
            if getattr(judge, "broadcasts", False):
                # O(1) per pair from prefix sums: judge the whole grid at once (no gathers).
                ok = judge(positions[:, None], next_positions[None, :])
                return np.where(valid, ok + best_after[None, :], -1).max(axis=1)
            rows, cols = np.nonzero(valid)
            gain = np.full(valid.shape, -1, dtype=np.int64)  # -1: no valid step (never chosen)
            ok = judge(positions[rows], next_positions[cols]).astype(np.int64)
            gain[rows, cols] = ok + best_after[cols]
            return gain.max(axis=1)

        chosen = np.asarray(sizes, dtype=np.int64)
        if not layers:
            return None if onward_only else {int(k): 0 for k in chosen}
        # Backward: best = most aligned steps from each boundary of a layer to the horizon.
        best = np.zeros(layers[-1][1].size, dtype=np.int64)
        for index in range(len(layers) - 2, -1, -1):
            best = best_onward(layers[index][0], layers[index][1], layers[index + 1], best,
                               aligns_later or aligns)
        if onward_only:
            return layers[0], best
        # Taking k examples now leaves the first boundary at offset drift + k - B.
        future = best_onward(context.drift + chosen - batch, chosen, layers[0], best, aligns)
        return {int(k): max(int(f), 0) for k, f in zip(chosen, future, strict=True)}

    # ------------------------------------------------------------------ decision
    def decide(
        self, lengths: np.ndarray, aligned: np.ndarray, context: StepContext, forced: int = 0
    ) -> SizingDecision:
        """Choose this step's size and bins. ``lengths`` must cover the window's highest size
        (plus ``max_deferred`` when deferring); the first ``forced`` examples were deferred by
        the previous step and may not be deferred again."""
        lowest, highest, target = context.window()
        if len(lengths) < highest:
            raise ValueError(f"need {highest} examples read ahead, got {len(lengths)}")
        if forced > lowest:
            raise ValueError(f"{forced} deferred examples do not fit a window starting at {lowest}")
        runs_before = self._runs
        decision = self._decide(lengths, aligned, context, forced)
        decision.packer_runs += self._runs - runs_before
        return decision

    def _decide(self, lengths: np.ndarray, aligned: np.ndarray, context: StepContext,
                forced: int) -> SizingDecision:
        lowest, highest, target = context.window()
        estimate = self._segment_estimator(aligned)
        ends = np.arange(highest + 1)
        bounds = estimate(np.zeros_like(ends), ends)

        if lowest == highest:  # forced: the epoch's tail or the run's final step
            bins, ok = self._evaluate(lengths[:target], int(bounds[target]))
            return self._finish(lengths[:target], bins, ok, 1, [target], runs=1,
                                sizes=aligned[:target])

        # Hopeless: even the largest size packs into fewer bins than dp. The target is packed;
        # the examples beyond it add about two bins per capacity of tokens at most, plus one
        # (first-fit packings leave at most one bin half empty, so each added bin holds more
        # than half a capacity). Only when that estimate reaches dp is the largest size packed.
        packs = 0
        if bounds[highest] < self.dp_size:
            bins = self.packer.pack(lengths[:target])
            packs += 1
            extra = int(np.minimum(aligned[target:highest], self.capacity).sum())
            at_most = len(bins) + 2 * -(-extra // self.capacity) + int(highest > target)
            if at_most >= self.dp_size:
                at_most = len(self.packer.pack(lengths[:highest]))
                packs += 1
            if at_most < self.dp_size:
                decision = self._finish(lengths[:target], bins, False, packs, [target], runs=packs,
                                        sizes=aligned[:target])
                decision.hopeless = True
                return decision

        tokens = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
        # The tokens a target-sized step should carry at the running mean of the examples read
        # ahead (about ``horizon`` steps of them).
        anchor = float(tokens[-1]) / max(len(lengths), 1) * target

        def token_gap(k: int) -> float:
            return abs(float(tokens[k]) - anchor)

        # A fixed-B step's token spread: sqrt(target) x the read-ahead's length std. A size
        # further than this from the anchor raises the token load's spread above fixed B's.
        spread = float(np.sqrt(target) * lengths.std()) if len(lengths) else 0.0

        sizes = list(_outward(target, lowest, highest))
        budget = self.budget(lowest, highest)
        if budget is None and self.exact_lookahead(lowest, highest):
            tried, packs, result = self._search_exact(lengths, estimate, context, sizes, token_gap)
            future: dict[int, int] = {}
        else:
            tried, packs, result, future = self._search_bounded(lengths, bounds, estimate, context,
                                                                sizes, token_gap, budget, packs)
        if result is not None:
            return result

        if self.max_deferred:
            deferred = self._search_deferral(lengths, aligned, estimate, context, forced, target,
                                             tokens, anchor, budget)
            if deferred is not None:
                deferred.packs += packs
                return deferred

        # Nothing aligned: also pack the size whose bound promises the fewest padding bins
        # (ties: nearest the target).
        dp = self.dp_size
        misaligned = []  # (off the token spread, weighed token distance and padding, distance, k)
        window = np.arange(lowest, highest + 1)
        estimated = bounds[window]
        est_padding = np.maximum(dp, -(-estimated // dp) * dp) - estimated
        best = int(window[np.lexsort((np.abs(window - target), est_padding))[0]])
        if best not in tried:
            tried.append(best)
            packs += 1
        packed = {}
        for size in tried:
            bins, ok = self._segment(lengths, 0, size, estimate)
            if ok:  # the size the bound favours aligned after all
                return self._finish(lengths[:size], bins, True, packs, tried)
            packed[size] = bins
        # Plan ahead here too (the bound judges): a padded step that leaves the next steps able to
        # align saves more bins than its own padding would (measured on the six study geometries:
        # fewer bins than the exhaustive search on each, where fewest padding first was behind).
        for size, bins in packed.items():
            padding = max(dp, -(-len(bins) // dp) * dp) - len(bins)
            gap = token_gap(size)
            weighed = (gap / spread) ** 2 + PADDING_WEIGHT * padding if spread > 0 else float(padding)
            misaligned.append((gap > spread, weighed, abs(size - target), size))
        ranked = [entry[-1] for entry in sorted(misaligned)]
        size = ranked[0]
        if self.horizon > 1 and len(ranked) > 1:
            if any(k not in future for k in ranked):
                future = self._future_alignment(self._bound_aligns(estimate), len(lengths),
                                                context, ranked)
            size = min(ranked, key=lambda k: -future[k])  # stable: ties keep the ranking
        bins = packed[size]
        return self._finish(lengths[:size], bins, False, packs, tried, sizes=aligned[:size])

    def _search_exact(self, lengths: np.ndarray, estimate: SegmentBounds, context: StepContext,
                      sizes: list[int], token_gap: Callable[[int], float]
                      ) -> tuple[list[int], int, SizingDecision | None]:
        """Among the sizes that align, the most aligned steps ahead (real counts for the next
        step), then the tokens nearest the anchor. The same choice as packing every size and
        every (size, next boundary) segment, but a segment is packed only when its result could
        change the choice: a size only while its best case beats the best found so far (every
        size is packed when none aligns, as the exhaustive search does)."""
        position = {k: i for i, k in enumerate(sizes)}
        ranked = sorted(sizes, key=lambda k: (token_gap(k), position[k]))
        # Real counts for the next step, the bound beyond: as good on real pools, 3x cheaper.
        onward = (self._future_alignment(self._bound_aligns(estimate), len(lengths), context,
                                         sizes, onward_only=True) if self.horizon > 1 else None)
        tried: list[int] = []
        chosen, most = None, -1
        for k in ranked:
            ends, after = None, -1  # no admissible next step counts 0, as in `_future_alignment`
            if onward is not None:
                (offsets, positions, tail), best = onward
                valid = positions - k >= 1
                if not tail:
                    valid &= np.abs(offsets - (context.drift + k - context.batch_size)) <= context.variation
                if valid.any():
                    after = int(best[valid].max())
                    ends = positions[valid & (best == after)]
            if max(after + 1, 0) <= most:
                continue  # cannot beat the best so far (ties keep the earlier size)
            bins, ok = self._segment(lengths, 0, k, estimate)
            tried.append(k)
            if not ok:
                continue
            future = 0 if ends is None else max(after + int(any(
                self._segment(lengths, k, int(e), estimate)[1] for e in ends)), 0)
            if future > most:
                chosen, most, chosen_bins = k, future, bins
                if onward is None:
                    break  # no planning ahead: the first that aligns
        if chosen is None:
            return tried, len(tried), None
        return tried, len(tried), self._finish(lengths[:chosen], chosen_bins, True, len(tried), tried)

    def _search_bounded(self, lengths: np.ndarray, bounds: np.ndarray, estimate: SegmentBounds,
                        context: StepContext, sizes: list[int], token_gap: Callable[[int], float],
                        budget: int | None, packs: int) -> Any:
        """Pack sizes in the bound's order, at most ``budget``; take the first that aligns. Also
        returns the steps ahead that can align after each size, where they were computed."""
        order, exact, future = self._search_order(sizes, bounds, estimate, len(lengths), context,
                                                  token_gap)
        if budget is not None and not exact:
            budget = min(budget, self.unlikely_packs)  # no bound is a multiple of dp: rarely aligns
        tried: list[int] = []
        for size in order:
            if budget is not None and packs >= budget:
                break
            bins, ok = self._segment(lengths, 0, size, estimate)
            packs += 1
            tried.append(size)
            if ok:
                return tried, packs, self._finish(lengths[:size], bins, True, packs, tried), future
        return tried, packs, None, future

    def _search_deferral(self, lengths: np.ndarray, aligned: np.ndarray, estimate: SegmentBounds,
                         context: StepContext, forced: int, target: int, tokens: np.ndarray,
                         anchor: float, budget: int | None) -> SizingDecision | None:
        """Align by leaving a few examples (at most ``max_deferred``) for the next step.

        For a prefix of m examples packed into c bins, two ways to keep c - (c mod dp) bins: empty
        the c mod dp lightest bins (their examples go, largest first, into the free room of the
        kept bins, and those that fit nowhere are deferred), or defer the largest examples, as
        few as the token bound allows, and repack the rest. Examples deferred by the previous
        step are never deferred again. The emitted size must stay in the window and the next step's window
        must hold the deferred examples. Fewest deferred examples first, then tokens nearest the
        anchor.
        """
        lowest, highest, _ = context.window()
        dp, limit = self.dp_size, self.max_deferred
        # A prefix of m examples emits m - (deferred) of them, so m may reach ``limit`` past
        # the window's top and still emit a size inside the window.
        top = min(highest + limit, len(lengths))
        best: tuple[tuple[int, float, int], int, list[list[int]], list[int]] | None = None
        most = limit  # the fewest deferred examples found so far (at most the limit)
        footprint = np.minimum(aligned, self.capacity)  # what each example takes of its bin
        packs = 0
        for m in _outward(target, lowest, top):
            if budget is not None and packs >= budget:
                break
            bins, _ = self._segment(lengths, 0, m, estimate)
            packs += 1
            count = len(bins)
            surplus = count % dp  # bins to remove to come down to a multiple of dp
            if count < dp or surplus == 0:
                continue
            # A prefix that must defer more than the best found so far is skipped unopened:
            # the same choice, without its refill and repacks.
            if self._fewest_deferred(footprint[:m], forced, count - surplus) > most:
                continue
            loads = [int(aligned[b].sum()) for b in bins]
            # The lightest bins have the fewest tokens to rehouse; a bin holding an example
            # deferred once already cannot be emptied (it would be deferred again).
            emptied = sorted((i for i in range(count) if min(bins[i]) >= forced),
                             key=lambda i: (loads[i], i))[:surplus]
            if len(emptied) < surplus:
                continue
            options = [self._refill(bins, loads, emptied, aligned)]
            largest = self._defer_largest(lengths[:m], aligned[:m], count - surplus, forced)
            if largest is not None:
                options.append(largest)
            for kept, moved in options:
                size = m - len(moved)
                if len(moved) > limit or not lowest <= size <= highest:
                    continue
                # The deferred examples lead the next step, so its smallest size must hold them.
                following = context.after(size)
                if following is None or following.window()[0] < len(moved):
                    continue
                kept_tokens = int(tokens[m]) - int(lengths[moved].sum())
                score = (len(moved), abs(kept_tokens - anchor), m)
                if best is None or score < best[0]:
                    best = (score, m, kept, moved)
                    most = len(moved)
        if best is None:
            return None
        _, m, kept, moved = best
        return self._finish(lengths[:m], kept, True, packs, [m], deferred=moved)

    def _fewest_deferred(self, footprint: np.ndarray, forced: int, kept_bins: int) -> int:
        """A lower bound on the examples a prefix must defer to fit ``kept_bins`` bins.

        What leaves carries at least the prefix's excess over the kept bins' room, so at least as
        many examples as the fewest of its largest deferrable ones (positions >= forced) that sum
        to the excess; ``max_deferred`` + 1 when even the largest ``max_deferred`` do not."""
        excess = int(footprint.sum()) - kept_bins * self.capacity
        if excess <= 0:
            return 0
        heaviest = np.sort(footprint[forced:])[::-1][:self.max_deferred]
        return int(np.searchsorted(np.cumsum(heaviest), excess)) + 1

    def _defer_largest(self, lengths: np.ndarray, aligned: np.ndarray, goal: int, forced: int,
                       tries: int = 3) -> tuple[list[list[int]], list[int]] | None:
        """Defer the largest examples (positions >= forced) so that the rest pack into a multiple
        of dp no larger than ``goal``: as few as the token bound allows, then up to ``tries``
        more. Returns (bins of the kept prefix positions, deferred positions) or None."""
        limit, dp = self.max_deferred, self.dp_size
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
        for count in range(first, min(first + tries, len(candidates) + 1)):
            moved = np.sort(candidates[:count])
            keep = np.ones(len(aligned), dtype=bool)
            keep[moved] = False
            positions = np.flatnonzero(keep)
            packed = self.packer.pack(lengths[positions])
            self._runs += 1
            if len(packed) % dp == 0 and dp <= len(packed) <= goal:
                return [[int(positions[i]) for i in b] for b in packed], moved.tolist()
        return None

    def _refill(self, bins: list[list[int]], loads: list[int], emptied: list[int],
                aligned: np.ndarray) -> tuple[list[list[int]], list[int]]:
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

    def _bound_aligns(self, estimate: SegmentBounds) -> SegmentTest:
        """Judge segments by the O(1) bound: does it reach a multiple of dp?

        A grid of (boundary, next boundary) pairs is remembered by the examples it spans and
        the pairs' places among them: the next step judges most of the same boundary pairs
        again (a boundary j steps ahead now is j - 1 steps ahead then)."""
        dp = self.dp_size
        source = getattr(estimate, "source", None)

        def judge(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
            counts = estimate(starts, ends)
            return (counts % dp == 0) & (counts >= dp)

        def aligns(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
            if source is None or starts.ndim != 2 or starts.size * ends.size < 256:
                return judge(starts, ends)
            low, high = int(starts.min()), int(ends.max())
            key = (source[low:high].tobytes(), (starts - low).tobytes(), (ends - low).tobytes(),
                   starts.shape, ends.shape)
            grid = self._grids.get(key)
            if grid is None:
                grid = judge(starts, ends)
                grid.flags.writeable = False  # shared by later steps
                self._grids[key] = grid
                if len(self._grids) > GRIDS_REMEMBERED:
                    self._grids.popitem(last=False)  # the oldest
            else:
                self._grids.move_to_end(key)
            return grid

        aligns.broadcasts = True  # type: ignore[attr-defined]  # element-wise: takes a grid
        return aligns

    def _search_order(self, sizes: list[int], bounds: np.ndarray, estimate: SegmentBounds,
                      available: int, context: StepContext, token_gap: Callable[[int], float]
                      ) -> tuple[list[int], bool, dict[int, int]]:
        """The order in which to pack the window's sizes (given nearest the target first).

        Sizes whose bound is itself a multiple of dp come first (the packers here usually reach
        the bound), then those a bin above one; among each, the sizes after which most of the
        next few steps can align, then the tokens nearest the anchor; then the rest, which only
        a larger budget reaches. Also says whether any bound is itself a multiple of dp, and
        gives the steps ahead that can align after each size, where it was computed.
        """
        dp = self.dp_size

        def tier(k: int) -> int:
            bound = int(bounds[k])
            if bound % dp == 0 and bound >= dp:
                return 0  # aligns if the packer reaches the bound, as it usually does
            return 1 if self._promising(bound) else 2  # 1: aligns one bin above the bound

        aligns = self._bound_aligns(estimate)
        tiers = {k: tier(k) for k in sizes}
        future: dict[int, int] = {}
        if self.horizon > 1:
            candidates = [k for k in sizes if tiers[k] < 2]
            if len(candidates) > 1:
                # Every size: a padded step reuses it (the backward pass costs the same).
                future = self._future_alignment(aligns, available, context, sizes)
        position = {k: i for i, k in enumerate(sizes)}
        order = sorted(sizes, key=lambda k: (tiers[k], -future.get(k, 0) if tiers[k] < 2 else 0,
                                             token_gap(k), position[k]))
        return order, any(t == 0 for t in tiers.values()), future

    def _finish(
        self,
        lengths: np.ndarray,
        bins: list[list[int]],
        aligned: bool,
        packs: int,
        tried: list[int],
        *,
        deferred: list[int] | None = None,
        runs: int = 0,
        sizes: np.ndarray | None = None,
    ) -> SizingDecision:
        packed = len(bins)
        if aligned:
            final, placeholders = bins, 0
        else:
            final, placeholders = self._pad(lengths, bins, sizes)
        deferred = list(deferred or [])
        return SizingDecision(
            size=len(lengths) - len(deferred),
            bins=final,
            packed_bins=packed,
            padding_bins=len(final) - packed,
            placeholder_bins=placeholders,
            aligned=aligned and packed % self.dp_size == 0,
            packs=packs,
            candidates=tried,
            span=len(lengths),
            deferred=deferred,
            packer_runs=runs,
        )


def _outward(target: int, lowest: int, highest: int) -> Iterator[int]:
    """target, target+1, target-1, target+2, ... within [lowest, highest]."""
    yield target
    for offset in range(1, max(highest - target, target - lowest) + 1):
        if target + offset <= highest:
            yield target + offset
        if target - offset >= lowest:
            yield target - offset
