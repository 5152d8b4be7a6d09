"""Choosing a step's batch size so that its bin count divides by the data-parallel size.

The examples arrive in a fixed order; a step takes a prefix of what is left. Its size may differ
from the nominal batch size B by at most v examples, and the running drift
``emitted - steps x B`` (counted within the epoch) stays within +-v. Inside that window we look
for a size whose packed bin count is a multiple of dp, so that no rank idles.

The search is cheap because most sizes can be ruled out without packing. A prefix's bin count
is never below a lower bound computed in O(1) from prefix sums (tokens over capacity, and
counts of examples too large to share a bin), and the packers here almost always reach it. The
sizes are packed in this order, at most ``max_packs`` of them, and the first that really aligns
is taken:

1. sizes whose bound is a multiple of dp, then sizes one bin above one;
2. within each group, the sizes after which most of the next ``horizon - 1`` steps can still
   align, judged by a backward pass over (step, boundary offset) with the same bound;
3. then nearest the target: target, target+1, target-1, ...

A step that can align always does; planning ahead only chooses among such sizes. When no size
aligns, the step takes the size with the fewest padding bins, and the missing bins are made by
splitting the heaviest bins, so every rank still gets real work.

Pure numpy: no torch, no ranks, no files.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from megatron_packing.packing.algorithms import SeqPacker

STEP_NORMAL = "normal"
STEP_EPOCH_TAIL = "epoch_tail"  # the epoch's last step: takes what remains
STEP_RUN_FINAL = "run_final"  # the run's last scheduled step: repays the drift exactly


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
        lowest = max(batch - v, batch - v - drift, 1)
        highest = min(batch + v, batch + v - drift, cap)
        lowest = min(lowest, highest)
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


@dataclass
class SizingDecision:
    """The chosen size and its bins (positions into the step's prefix)."""

    size: int
    bins: list[list[int]]  # a multiple of dp; empty lists are placeholder bins
    packed_bins: int  # the count the packer reached for these examples
    padding_bins: int  # bins added beyond packed_bins to reach a multiple of dp
    placeholder_bins: int  # bins with no example at all
    aligned: bool  # packed_bins is a multiple of dp: no padding bin was needed
    packs: int  # full packer runs spent on the search
    hopeless: bool = False  # no size in the window could align (too few bins for dp)
    candidates: list[int] = field(default_factory=list)  # sizes that were packed, in order


class StepSizer:
    """Picks step sizes for a packer and a data-parallel size.

    ``lengths`` passed to `decide` are the raw lengths of the examples ahead, in stream order;
    ``aligned`` are their aligned sizes as the packer sees them (own-bin oversize examples larger
    than the usable capacity).
    """

    def __init__(
        self,
        packer: SeqPacker,
        dp_size: int,
        *,
        max_packs: int | None = 8,
        bound_slack: int = 1,
        horizon: int = 3,
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.packer = packer
        self.dp_size = int(dp_size)
        self.max_packs = None if max_packs is None else int(max_packs)
        self.bound_slack = int(bound_slack)
        self.horizon = max(1, int(horizon))
        self.unlikely_packs = 3  # the budget when no size's bound is a multiple of dp
        self.capacity = packer.usable_capacity

    # ------------------------------------------------------------------ bounds
    def lower_bounds(self, aligned: np.ndarray) -> np.ndarray:
        """lb[k] = a lower bound on the bins of the first k examples (lb[0] = 0)."""
        ends = np.arange(len(aligned) + 1)
        return self._segment_estimator(aligned)(np.zeros_like(ends), ends)

    def _promising(self, bound: int) -> bool:
        """Could this prefix pack into a multiple of dp? (Its count is rarely above bound + slack.)"""
        dp = self.dp_size
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
        target = max(dp, -(-bound // dp) * dp)
        if target < count:
            tighter = self.packer.pack_to_count(lengths, target)
            if tighter is not None:
                return tighter, True
        return bins, False

    def _pad(self, lengths: np.ndarray, bins: list[list[int]]) -> tuple[list[list[int]], int]:
        """Raise the bin count to a multiple of dp (at least dp) with balanced non-empty bins."""
        dp = self.dp_size
        count = len(bins)
        target = max(dp, -(-count // dp) * dp)
        if target == count:
            return bins, 0
        items = len(lengths)
        if items >= target:
            split = self.packer.pack_to_count(lengths, target)
            if split is not None and len(split) == target:
                return split, 0
        # Fewer examples than rows: one example per row, the rest are placeholder rows.
        spread = [[i] for i in range(items)] if items <= target else bins
        placeholders = target - len(spread)
        return spread + [[] for _ in range(placeholders)], placeholders

    # ------------------------------------------------------------------ planning ahead
    def _segment_estimator(self, aligned: np.ndarray):
        """A function (starts, ends) -> lower bounds on the bins of stream segments, O(1) each.

        The largest of: tokens over the capacity; one bin per example above half the capacity
        plus the bins the rest need beyond the room those leave; and, for t = 2 and 3, the examples
        above C / (t + 1) over t (no bin holds more than t of them). The packers here reach this
        bound on almost every real step, so it doubles as the estimate used to plan ahead.
        """
        capacity = self.capacity
        oversize = aligned > capacity
        zero = np.zeros(1, dtype=np.int64)

        def prefix(values: np.ndarray) -> np.ndarray:
            return np.concatenate((zero, np.cumsum(values, dtype=np.int64)))

        large = (aligned > capacity // 2) & ~oversize
        tokens = prefix(np.where(oversize, 0, aligned))
        own = prefix(oversize)
        large_count = prefix(large)
        large_tokens = prefix(np.where(large, aligned, 0))
        above = {t: prefix((aligned * (t + 1) > capacity) & ~oversize) for t in (2, 3)}

        def estimate(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
            t = tokens[ends] - tokens[starts]
            lc = large_count[ends] - large_count[starts]
            lt = large_tokens[ends] - large_tokens[starts]
            bound = np.maximum(-(-t // capacity),
                               lc + -(-np.maximum(t - lt - (lc * capacity - lt), 0) // capacity))
            for per_bin, counts in above.items():
                bound = np.maximum(bound, -(-(counts[ends] - counts[starts]) // per_bin))
            return bound + own[ends] - own[starts]

        return estimate

    def _future_alignment(self, estimate, available: int, context: StepContext,
                          sizes: list[int]) -> dict[int, int]:
        """For each candidate size: how many of the next steps can still align after it.

        Boundary j of the next few steps may sit anywhere within +-v of its nominal place
        j x B, consecutive boundaries within v of each other (the step-size window). A backward
        pass over (step, offset) with estimated bin counts gives, for each boundary, the most
        steps after it that can align. Only the examples read ahead are considered.
        """
        batch, v, dp = context.batch_size, context.variation, self.dp_size
        # Boundary positions of later steps, layer by layer (relative to the current position).
        layers: list[tuple[np.ndarray, np.ndarray, bool]] = []  # (offsets, positions, is_tail)
        step_context = context.after(sizes[0]) if sizes else None
        for layer in range(2, self.horizon + 1):
            if step_context is None:
                break
            kind = step_context.kind
            if kind == STEP_EPOCH_TAIL:
                offsets = np.zeros(1, dtype=np.int64)
                positions = np.array([context.remaining], dtype=np.int64)
            else:
                offsets = (np.arange(-v, v + 1, dtype=np.int64) if kind == STEP_NORMAL
                           else np.zeros(1, dtype=np.int64))
                positions = layer * batch - context.drift + offsets
                keep = positions <= context.remaining - (step_context.steps_left_in_epoch - 1)
                offsets, positions = offsets[keep], positions[keep]
            keep = positions <= available
            offsets, positions = offsets[keep], positions[keep]
            if positions.size == 0:
                break
            layers.append((offsets, positions, kind == STEP_EPOCH_TAIL))
            step_context = replace(step_context, drift=0).after(batch)
        def best_onward(offsets, positions, nxt, best_after):
            """Most aligned steps from each boundary, over the step to the next layer and on."""
            next_offsets, next_positions, next_tail = nxt
            valid = next_positions[None, :] - positions[:, None] >= 1
            if not next_tail:
                valid &= np.abs(next_offsets[None, :] - offsets[:, None]) <= v
            counts = estimate(positions[:, None], next_positions[None, :])
            gain = ((counts % dp == 0) & (counts >= dp)).astype(np.int64) + best_after[None, :]
            return np.where(valid, gain, -1).max(axis=1)

        chosen = np.asarray(sizes, dtype=np.int64)
        if not layers:
            return {int(k): 0 for k in chosen}
        # Backward: best = most aligned steps from each boundary of a layer to the horizon.
        best = np.zeros(layers[-1][1].size, dtype=np.int64)
        for index in range(len(layers) - 2, -1, -1):
            best = best_onward(layers[index][0], layers[index][1], layers[index + 1], best)
        future = best_onward(context.drift + chosen - batch, chosen, layers[0], best)
        return {int(k): max(int(f), 0) for k, f in zip(chosen, future, strict=True)}

    # ------------------------------------------------------------------ decision
    def decide(
        self, lengths: np.ndarray, aligned: np.ndarray, context: StepContext
    ) -> SizingDecision:
        """Choose this step's size and bins. ``lengths`` must cover the window's highest size."""
        lowest, highest, target = context.window()
        if len(lengths) < highest:
            raise ValueError(f"need {highest} examples read ahead, got {len(lengths)}")
        estimate = self._segment_estimator(aligned)
        ends = np.arange(highest + 1)
        bounds = estimate(np.zeros_like(ends), ends)
        packs = 0
        tried: list[int] = []

        if lowest == highest:  # forced: the epoch's tail or the run's final step
            bins, ok = self._evaluate(lengths[:target], int(bounds[target]))
            return self._finish(lengths[:target], bins, ok, 1, [target])

        # Hopeless: even the largest size packs into fewer bins than dp. The target is packed;
        # the examples beyond it add about two bins per capacity of tokens at most, plus one.
        if bounds[highest] < self.dp_size:
            bins = self.packer.pack(lengths[:target])
            packs += 1
            extra = int(np.minimum(aligned[target:highest], self.capacity).sum())
            at_most = len(bins) + 2 * -(-extra // self.capacity) + int(highest > target)
            if at_most >= self.dp_size:
                at_most = len(self.packer.pack(lengths[:highest]))
                packs += 1
            if at_most < self.dp_size:
                decision = self._finish(lengths[:target], bins, False, packs, [target])
                decision.hopeless = True
                return decision

        misaligned: list[tuple[int, int, int, list[list[int]]]] = []  # (padding, distance, k, bins)
        # Sizes whose bound admits a multiple of dp first, best for the steps after them first;
        # then the rest, if the budget allows. The first size that really aligns is taken.
        order, exact = self._search_order(list(_outward(target, lowest, highest)), bounds,
                                          estimate, len(aligned), context)
        budget = self.max_packs
        if budget is not None and not exact:
            budget = min(budget, self.unlikely_packs)  # no bound is a multiple of dp: rarely aligns
        for size in order:
            if budget is not None and packs >= budget:
                break
            bins, ok = self._evaluate(lengths[:size], int(bounds[size]))
            packs += 1
            tried.append(size)
            if ok:
                return self._finish(lengths[:size], bins, True, packs, tried)
            padding = max(self.dp_size, -(-len(bins) // self.dp_size) * self.dp_size) - len(bins)
            misaligned.append((padding, abs(size - target), size, bins))

        # Nothing aligned: also pack the size whose bound promises the fewest padding bins.
        dp = self.dp_size
        window = np.arange(lowest, highest + 1)
        estimated = bounds[window]
        est_padding = np.maximum(dp, -(-estimated // dp) * dp) - estimated
        best = int(window[np.lexsort((np.abs(window - target), est_padding))[0]])
        if best not in tried:
            bins = self.packer.pack(lengths[:best])
            packs += 1
            tried.append(best)
            padding = max(dp, -(-len(bins) // dp) * dp) - len(bins)
            misaligned.append((padding, abs(best - target), best, bins))
        _, _, size, bins = min(misaligned, key=lambda entry: (entry[0], entry[1], entry[2]))
        return self._finish(lengths[:size], bins, False, packs, tried)

    def _search_order(self, sizes: list[int], bounds: np.ndarray, estimate, available: int,
                      context: StepContext) -> tuple[list[int], bool]:
        """The order in which to pack the window's sizes (given nearest the target first).

        Sizes whose bound is itself a multiple of dp come first (the packers here usually reach
        the bound), then those a bin above one; among each, the sizes after which most of the
        next few steps can align; then the rest, which only an unlimited budget reaches.
        Also says whether any bound is itself a multiple of dp.
        """
        dp = self.dp_size

        def tier(k: int) -> int:
            bound = int(bounds[k])
            if bound % dp == 0 and bound >= dp:
                return 0
            return 1 if self._promising(bound) else 2

        tiers = {k: tier(k) for k in sizes}
        future: dict[int, int] = {}
        if self.horizon > 1:
            candidates = [k for k in sizes if tiers[k] < 2]
            if len(candidates) > 1:
                future = self._future_alignment(estimate, available, context, candidates)
        position = {k: i for i, k in enumerate(sizes)}
        order = sorted(sizes, key=lambda k: (tiers[k], -future.get(k, 0), position[k]))
        return order, any(t == 0 for t in tiers.values())

    def _finish(
        self,
        lengths: np.ndarray,
        bins: list[list[int]],
        aligned: bool,
        packs: int,
        tried: list[int],
    ) -> SizingDecision:
        packed = len(bins)
        if aligned:
            final, placeholders = bins, 0
        else:
            final, placeholders = self._pad(lengths, bins)
        return SizingDecision(
            size=len(lengths),
            bins=final,
            packed_bins=packed,
            padding_bins=len(final) - packed,
            placeholder_bins=placeholders,
            aligned=aligned and packed % self.dp_size == 0,
            packs=packs,
            candidates=tried,
        )


def _outward(target: int, lowest: int, highest: int):
    """target, target+1, target-1, target+2, ... within [lowest, highest]."""
    yield target
    for offset in range(1, max(highest - target, target - lowest) + 1):
        if target + offset <= highest:
            yield target + offset
        if target - offset >= lowest:
            yield target - offset
