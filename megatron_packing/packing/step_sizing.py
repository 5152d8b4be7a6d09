"""Choosing a step's batch size so that its bin count divides by the data-parallel size.

The examples arrive in a fixed order; a step takes a prefix of what is left. Its size may differ
from the nominal batch size B by at most v examples, and the running drift
``emitted - steps x B`` (counted within the epoch) stays within +-v. Inside that window we look
for a size whose packed bin count is a multiple of dp, so that no rank idles.

The search is cheap because most sizes can be ruled out without packing: the bin count of a
prefix is never below ``ceil(tokens / capacity)`` and, with the packers here, rarely more than
one bin above it. Only sizes whose bound admits a multiple of dp are packed, nearest the target
first, and at most ``max_packs`` of them. A size is also judged by the step after it: we prefer
a boundary that leaves the next step a window in which alignment is still possible (two-step
lookahead). When no size aligns, the step takes the size with the fewest padding bins, and the
missing bins are made by splitting the heaviest bins, so every rank still gets real work.

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

    def lookahead_need(self) -> int:
        """Examples to read ahead so that this step and the next can both be judged."""
        _, highest, _ = self.window()
        after = self.after(highest)
        extra = 0 if after is None else after.window()[1]
        return min(self.remaining, highest + extra)


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
        lookahead: bool = True,
        bound_slack: int = 1,
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.packer = packer
        self.dp_size = int(dp_size)
        self.max_packs = None if max_packs is None else int(max_packs)
        self.lookahead = lookahead
        self.bound_slack = int(bound_slack)
        self.capacity = packer.usable_capacity

    # ------------------------------------------------------------------ bounds
    def lower_bounds(self, aligned: np.ndarray) -> np.ndarray:
        """lb[k] = fewest bins any packer needs for the first k examples (lb[0] = 0)."""
        oversize = aligned > self.capacity
        fitting = np.where(oversize, 0, aligned)
        tokens = np.concatenate(([0], np.cumsum(fitting, dtype=np.int64)))
        own = np.concatenate(([0], np.cumsum(oversize, dtype=np.int64)))
        return -(-tokens // self.capacity) + own

    def _promising(self, bound: int) -> bool:
        """Could a packing of this bound's prefix reach a multiple of dp?"""
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

    def _next_step_ok(
        self, lengths: np.ndarray, aligned: np.ndarray, size: int, context: StepContext
    ) -> bool:
        """Can the step after a boundary at ``size`` still align?"""
        after = context.after(size)
        if after is None:
            return True
        lowest, highest, target = after.window()
        rest_lengths = lengths[size:]
        if highest > len(rest_lengths):  # not enough read ahead to judge: do not penalise
            return True
        if after.kind != STEP_NORMAL:
            bound = int(self.lower_bounds(aligned[size : size + target])[-1])
            if not self._promising(bound):
                return False
            _, ok = self._evaluate(rest_lengths[:target], bound)
            return ok
        bounds = self.lower_bounds(aligned[size : size + highest])
        return any(self._promising(int(bounds[k])) for k in range(lowest, highest + 1))

    # ------------------------------------------------------------------ decision
    def decide(
        self, lengths: np.ndarray, aligned: np.ndarray, context: StepContext
    ) -> SizingDecision:
        """Choose this step's size and bins. ``lengths`` must cover the window's highest size."""
        lowest, highest, target = context.window()
        if len(lengths) < highest:
            raise ValueError(f"need {highest} examples read ahead, got {len(lengths)}")
        bounds = self.lower_bounds(aligned[:highest])
        packs = 0
        tried: list[int] = []

        if lowest == highest:  # forced: the epoch's tail or the run's final step
            bins, ok = self._evaluate(lengths[:target], int(bounds[target]))
            return self._finish(lengths[:target], bins, ok, 1, [target])

        # Hopeless: even the largest size packs into fewer bins than dp.
        if bounds[highest] < self.dp_size:
            bins = self.packer.pack(lengths[:highest])
            packs += 1
            if len(bins) < self.dp_size:
                bins = self.packer.pack(lengths[:target]) if target != highest else bins
                packs += int(target != highest)
                decision = self._finish(lengths[:target], bins, False, packs, [target])
                decision.hopeless = True
                return decision

        fallback_aligned: tuple[int, list[list[int]]] | None = None
        misaligned: list[tuple[int, int, int, list[list[int]]]] = []  # (padding, distance, k, bins)
        sizes = list(_outward(target, lowest, highest))
        promising = [k for k in sizes if self._promising(int(bounds[k]))]
        # Sizes whose bound rules alignment out come last: only an unlimited budget reaches them.
        unlikely = [k for k in sizes if not self._promising(int(bounds[k]))]
        for size in promising + unlikely:
            if self.max_packs is not None and packs >= self.max_packs:
                break
            if fallback_aligned is not None and size in unlikely:
                break
            bins, ok = self._evaluate(lengths[:size], int(bounds[size]))
            packs += 1
            tried.append(size)
            if ok:
                if not self.lookahead or self._next_step_ok(lengths, aligned, size, context):
                    return self._finish(lengths[:size], bins, True, packs, tried)
                if fallback_aligned is None:
                    fallback_aligned = (size, bins)
            else:
                padding = max(self.dp_size, -(-len(bins) // self.dp_size) * self.dp_size) - len(
                    bins
                )
                misaligned.append((padding, abs(size - target), size, bins))

        if fallback_aligned is not None:
            size, bins = fallback_aligned
            return self._finish(lengths[:size], bins, True, packs, tried)
        if not any(k == target for _, _, k, _ in misaligned):
            bins = self.packer.pack(lengths[:target])
            packs += 1
            tried.append(target)
            padding = max(self.dp_size, -(-len(bins) // self.dp_size) * self.dp_size) - len(bins)
            misaligned.append((padding, 0, target, bins))
        _, _, size, bins = min(misaligned, key=lambda entry: (entry[0], entry[1], entry[2]))
        return self._finish(lengths[:size], bins, False, packs, tried)

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
