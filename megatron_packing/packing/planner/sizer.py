"""`StepSizer`: one step's size and bins, from the parts of this package.

Inside the window (`window`), where no size of this step or of the steps ahead can save a bin
(`floor`), the step takes the size nearest the nominal tokens and pads it to its floor. Otherwise
a step that can align does: the exact or the bounded search (`search`), planning ahead only to
choose among such sizes (`lookahead`). With bounded deferral, a step that cannot align may leave
a few examples of its window to lead the next step (`deferral`). Otherwise the step is padded:
among the sizes packed, the one after which most of the next steps can align, then the best by
`padding.rank_padded`; its bins are rounded up to a multiple of dp by `dp_rounding.round_to_dp`,
the packer's own dp rounding. With a per-micro-batch cost (``microbatch_cost``), sizes equally
good on alignment are weighed by their tokens' distance from the running load plus the charge
of their micro-batches (`charge`): a shorter step against a more even one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from megatron_packing.common.validation import require_int, require_number
from megatron_packing.packing.algorithms import SeqPacker
from megatron_packing.packing.dp_rounding import first_multiple, round_to_dp
from megatron_packing.packing.planner.bounds import SegmentBound
from megatron_packing.packing.planner.charge import MicrobatchCharge
from megatron_packing.packing.planner.deferral import DeferralSearch
from megatron_packing.packing.planner.floor import floor_bins, no_step_can_drop
from megatron_packing.packing.planner.lookahead import future_alignment
from megatron_packing.packing.planner.padding import fewest_padding_size, rank_padded
from megatron_packing.packing.planner.search import (
    Grids,
    SearchProblem,
    SearchSetting,
    SizeSearch,
    choose_search,
    search_budget,
)
from megatron_packing.packing.planner.segments import Bins, SegmentPacker
from megatron_packing.packing.planner.window import StepContext
from megatron_packing.packing.tunables import DEFAULT_TUNABLES, PlannerTunables


@dataclass
class SizingDecision:
    """The chosen size and its bins (positions into the step's prefix of ``span`` examples)."""

    size: int  # examples emitted by this step
    bins: Bins  # a multiple of dp; empty lists are placeholder bins
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
    evened: bool = False  # took the nominal tokens at the floor, where no size saves a bin


DEFAULT_LOOKAHEAD_STEPS = 6
"""Steps planned together (the YAML's ``lookahead_steps``). Basis: against 3 on the study
geometries, 64.3% against 61.0% aligned at 128/4K/dp8 and bins fewer or the same, for about 1 ms
more a step at B = 1024. Sweep (`benchmarks/bench_planner_constants.py`): at 3, +8 bins and -1
aligned at 128/4K/8, -1 aligned at 256/16K/8, +1 aligned at 1024/64K/8 and with deferral; at 12,
-2 aligned at 1024/64K/8 and +1 with deferral, the bins unchanged."""

DEFAULT_MAX_PACKS = 8
"""Packs a large window's search may spend (None: every size). Basis: the fast path of the six
study geometries (fewer bins than the exhaustive search on each, 1-2 packer runs a step at
B = 1024). Sweep: no change at 4 or 16."""


class StepSizer:
    """Picks step sizes for a packer and a data-parallel size.

    ``lengths`` passed to `decide` are the raw lengths of the examples ahead, in stream order;
    ``aligned`` are their aligned sizes as the packer sees them (own-bin oversize examples larger
    than the usable capacity). ``max_deferred`` > 0 lets a step that cannot align leave up to
    that many examples of its window to lead the next step. Among equally good sizes, the one
    whose tokens are nearest the target times the mean length of the examples read ahead wins:
    token load per step stays even while the drift is still repaid. ``microbatch_cost`` (tokens
    per micro-batch, ``microbatch_cost_tokens``) adds the charge of a size's micro-batches to
    that distance (`charge.MicrobatchCharge`); 0 leaves every choice to the distance.
    """

    def __init__(self, packer: SeqPacker, dp_size: int, *, max_deferred: int = 0,
                 lookahead_steps: int = DEFAULT_LOOKAHEAD_STEPS,
                 max_packs: int | None = DEFAULT_MAX_PACKS,
                 tunables: PlannerTunables = DEFAULT_TUNABLES,
                 microbatch_cost: float = 0.0) -> None:
        dp = require_int("dp_size", dp_size, minimum=1, error=ValueError)
        deferred = require_int("max_deferred", max_deferred, minimum=0, error=ValueError)
        assert dp is not None and deferred is not None  # allow_none is off
        self.microbatch_cost = require_number("microbatch_cost", microbatch_cost, minimum=0,
                                              error=ValueError)
        if packer.dp_size is not None:
            raise ValueError(f"StepSizer needs the packer's natural bin counts, but this packer "
                             f"rounds them to dp_size={packer.dp_size}; build it without dp_size "
                             f"(the planner rounds padded steps itself)")
        self.packer = packer
        self.dp_size = dp
        self.tunables = tunables
        self.horizon = max(1, int(lookahead_steps))
        self.max_packs = max_packs
        self.max_deferred = deferred
        self.capacity = packer.usable_capacity
        self.segments = SegmentPacker(packer, dp, tunables)
        self.grids: Grids = OrderedDict()
        self.setting = SearchSetting(dp, self.horizon, max_packs, tunables, self.segments,
                                     self.grids)
        self.deferral = DeferralSearch(self.segments, dp, self.capacity, deferred, tunables.defer_tries)

    def bound(self, aligned: np.ndarray) -> SegmentBound:
        """The segment bound of a read-ahead (its aligned sizes)."""
        return SegmentBound(aligned, self.capacity)

    def search_for(self, lowest: int, highest: int) -> SizeSearch:
        """The search strategy a window gets (`search.choose_search`)."""
        return choose_search(self.setting, lowest, highest)

    def decide(self, lengths: np.ndarray, aligned: np.ndarray, context: StepContext,
               forced: int = 0) -> SizingDecision:
        """Choose this step's size and bins. ``lengths`` must cover the window's highest size
        (plus ``max_deferred`` when deferring); the first ``forced`` examples were deferred by
        the previous step and may not be deferred again."""
        lowest, highest, target = context.window()
        if len(lengths) < highest:
            raise ValueError(f"need {highest} examples read ahead, got {len(lengths)}")
        if forced > lowest:
            raise ValueError(f"{forced} deferred examples do not fit a window starting at {lowest}")
        runs_before = self.segments.runs
        decision = self._decide(lengths, aligned, context, forced)
        decision.packer_runs += self.segments.runs - runs_before
        return decision

    def _decide(self, lengths: np.ndarray, aligned: np.ndarray, context: StepContext,
                forced: int) -> SizingDecision:
        lowest, highest, target = context.window()
        bound = self.bound(aligned)
        bounds = bound.prefixes(highest)
        dp = self.dp_size

        if lowest == highest:  # forced: the epoch's tail or the run's final step
            bins, ok = self.segments.evaluate(lengths[:target], int(bounds[target]))
            return self._finish(lengths[:target], bins, ok, 1, [target], runs=1,
                                sizes=aligned[:target])

        # Hopeless: even the largest size packs into fewer bins than dp. The target is packed;
        # the examples beyond it add about two bins per capacity of tokens at most, plus one
        # (first-fit packings leave at most one bin half empty, so each added bin holds more
        # than half a capacity). Only when that estimate reaches dp is the largest size packed.
        packs = 0
        if bounds[highest] < dp:
            bins = self.packer.pack(lengths[:target])
            packs += 1
            extra = int(np.minimum(aligned[target:highest], self.capacity).sum())
            at_most = len(bins) + 2 * -(-extra // self.capacity) + int(highest > target)
            if at_most >= dp:
                at_most = len(self.packer.pack(lengths[:highest]))
                packs += 1
            if at_most < dp:
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

        evened = self._even_at_floor(lengths, aligned, bound, bounds, context, tokens,
                                     spread / anchor if anchor > 0 else 0.0, packs)
        if evened is not None:
            return evened

        charge = (MicrobatchCharge(self.microbatch_cost, dp, self.capacity, tokens)
                  if self.microbatch_cost else None)
        problem = SearchProblem(lengths, bound, bounds, context, context.window().sizes(),
                                token_gap, packs, charge)
        result = self.search_for(lowest, highest).search(problem)
        tried, packs, future = result.tried, result.packs, result.future
        if result.chosen is not None:
            size, bins = result.chosen
            return self._finish(lengths[:size], bins, True, packs, tried)

        budget = search_budget(self.max_packs, self.tunables, lowest, highest)
        if self.max_deferred:
            deferral = self.deferral.search(lengths, aligned, bound, context, forced, target,
                                            tokens, anchor, budget)
            if deferral is not None:
                decision = self._finish(lengths[:deferral.span], deferral.kept, True,
                                        deferral.packs, [deferral.span], deferred=deferral.moved)
                decision.packs += packs
                return decision

        # Nothing aligned: also pack the size whose bound promises the fewest padding bins.
        best = fewest_padding_size(bounds, lowest, highest, target, dp)
        if best not in tried:
            tried.append(best)
            packs += 1
        packed = {}
        for size in tried:
            bins, ok = self.segments.segment(lengths, 0, size, bound)
            if ok:  # the size the bound favours aligned after all
                return self._finish(lengths[:size], bins, True, packs, tried)
            packed[size] = bins
        ranked = rank_padded(packed, dp, target, token_gap, spread, self.tunables.padding_weight,
                             charge)
        size = ranked[0]
        # Plan ahead here too (the bound judges): a padded step that leaves the next steps able to
        # align saves more bins than its own padding would (measured on the six study geometries:
        # fewer bins than the exhaustive search on each, where fewest padding first was behind).
        if self.horizon > 1 and len(ranked) > 1:
            if any(k not in future for k in ranked):
                future = future_alignment(self.setting.bound_judge(bound), len(lengths), context,
                                          ranked, self.horizon)
            size = min(ranked, key=lambda k: -future[k])  # stable: ties keep the ranking
        return self._finish(lengths[:size], packed[size], False, packs, tried, sizes=aligned[:size])

    def _even_at_floor(self, lengths: np.ndarray, aligned: np.ndarray, bound: SegmentBound,
                       bounds: np.ndarray, context: StepContext, tokens: np.ndarray,
                       token_cv: float, packs: int) -> SizingDecision | None:
        """The step when no size can save a bin, this step or ahead (`floor`): the size whose
        tokens are nearest B x the read-ahead's mean length, if it packs into the step's floor;
        else None (the search decides). ``token_cv``: a fixed-B step's token spread over its
        tokens, which scales the margin for the stream beyond the read-ahead."""
        spreads = self.tunables.floor_margin_spreads
        if spreads is None:
            return None
        # The epoch's or the run's last step is forced to take whatever drift is left, and may
        # cross a multiple of dp with it; the step before it is the last that can steer that
        # drift, so it aligns where it can. (Evening up to the end, the steps past the
        # read-ahead taken as unable to drop, cost 16 bins at 2048 / 32K / dp 16 held out and
        # 8 at 256 / 16K / dp 8 of the study; with these two steps left out, none.)
        steps_left = min(context.steps_left_in_epoch, context.steps_left_in_run or 1 << 62)
        if steps_left <= 2:
            return None
        lowest, highest, target = context.window()
        nominal = float(tokens[-1]) / max(len(lengths), 1) * context.batch_size
        # Nearest the nominal tokens (the prefix sums ascend: the two sizes around it); ties
        # nearest the target, then the larger size.
        at = int(np.searchsorted(tokens, nominal))
        near = {min(max(k, lowest), highest) for k in (at - 1, at)}
        size = min(near, key=lambda k: (abs(float(tokens[k]) - nominal), abs(k - target), -k))
        floor = floor_bins(bounds, lowest, self.dp_size)
        if first_multiple(int(bounds[size]), self.dp_size) != floor:
            return None  # above the floor by the bound already: no pack needed to know
        if not no_step_can_drop(bound, size, context.batch_size, context.v, self.horizon - 1,
                                len(lengths), self.dp_size, spreads * token_cv):
            return None
        bins, ok = self.segments.segment(lengths, 0, size, bound)
        cost = len(bins) if ok else first_multiple(len(bins), self.dp_size)
        if cost != floor:
            return None
        decision = self._finish(lengths[:size], bins, ok, packs + 1, [size], sizes=aligned[:size])
        if decision.placeholder_bins:
            return None  # an empty micro-batch where aligning might need none: search
        decision.evened = True
        return decision

    def _finish(self, lengths: np.ndarray, bins: Bins, aligned: bool, packs: int, tried: list[int],
                *, deferred: list[int] | None = None, runs: int = 0,
                sizes: np.ndarray | None = None) -> SizingDecision:
        packed = len(bins)
        if aligned:
            final, placeholders = bins, 0
        else:
            assert sizes is not None, "a padded step passes its aligned sizes"
            final, placeholders = round_to_dp(bins, sizes, self.dp_size)
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
