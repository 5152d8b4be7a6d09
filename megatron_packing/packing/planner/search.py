"""Searching the window for a size whose packed bin count is a multiple of dp.

Two strategies behind one interface (`SizeSearch.search(problem) -> SearchResult`):

- `ExactSearch` (small windows): among the sizes that align, the most aligned steps ahead (real
  packer counts for the next step, the bound beyond), then the tokens nearest the anchor (plus,
  with a per-micro-batch cost, the charge of the size's micro-batches: `charge`). The same
  choice as packing every size and every (size, next boundary) segment, but a segment is packed
  only while its result could still change the choice.
- `BoundedSearch` (larger windows): packs sizes in the bound's order (`search_order`), at most
  a budget of them, and takes the first that aligns. It plans ahead by the bound alone and
  packs in the bound's tiers, so it can take an aligning size the exact search ranks lower
  (fewer aligned steps ahead, or tokens further from the anchor).

`choose_search` says which applies to a window.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from megatron_packing.packing.dp_rounding import first_multiple
from megatron_packing.packing.planner.bounds import BoundJudge, PairJudge, SegmentBound
from megatron_packing.packing.planner.lookahead import future_alignment, onward_alignment
from megatron_packing.packing.planner.segments import Bins, SegmentPacker
from megatron_packing.packing.planner.window import StepContext
from megatron_packing.packing.tunables import PlannerTunables

Grids = OrderedDict[tuple[object, ...], np.ndarray]


@dataclass(frozen=True)
class SearchProblem:
    """One step's search: the read-ahead, its bounds, where the stream stands, the sizes
    (nearest the target first) and how far each size's tokens are from the anchor."""

    lengths: np.ndarray
    bound: SegmentBound
    bounds: np.ndarray  # bound of each prefix, 0..highest
    context: StepContext
    sizes: list[int]
    token_gap: Callable[[int], float]
    packs: int = 0  # packs spent before the search (they count against the budget)
    # A size's micro-batches beyond its tokens, priced (`charge.MicrobatchCharge`: size, bins);
    # None when a micro-batch costs nothing (then every choice is the token gap's).
    charge: Callable[[int, int], float] | None = None

    def weighed_gap(self, size: int, bins: int) -> float:
        """The token gap plus the charge of ``size`` packed into ``bins`` bins."""
        gap = self.token_gap(size)
        return gap if self.charge is None else gap + self.charge(size, bins)


@dataclass
class SearchResult:
    """What was packed (in order), the packs spent, the aligned choice if any, and the steps
    ahead that can align after each size (where they were computed)."""

    tried: list[int]
    packs: int
    chosen: tuple[int, Bins] | None
    future: dict[int, int] = field(default_factory=dict)


class SizeSearch(Protocol):
    def search(self, problem: SearchProblem) -> SearchResult: ...


@dataclass(frozen=True)
class SearchSetting:
    """What every search shares: the dp size, the lookahead horizon, the packs a large
    window's search may spend (None: every size), the tunables, the segment packer (with its
    memo) and the remembered grids."""

    dp: int
    horizon: int
    max_packs: int | None
    tunables: PlannerTunables
    segments: SegmentPacker
    grids: Grids

    def bound_judge(self, bound: SegmentBound) -> BoundJudge:
        return BoundJudge(bound, self.dp, self.grids, self.tunables)


def search_budget(max_packs: int | None, tunables: PlannerTunables, lowest: int,
                  highest: int) -> int | None:
    """Packs allowed to the search: None (the whole window) when the window is cheap or
    ``max_packs`` is None."""
    if max_packs is None:
        return None
    sizes = highest - lowest + 1
    # Packing is about linear in the examples packed, so packing every size costs about
    # sizes x highest example placements: below the threshold a full search is affordable
    # and the step is never behind one that packs every size.
    if sizes * highest <= tunables.full_search_examples:
        return None
    return max_packs


def covers(budget: int | None, lowest: int, highest: int) -> bool:
    """Does the budget let the search pack every size of the window?"""
    return budget is None or budget >= highest - lowest + 1


def searches_exactly(max_packs: int | None, tunables: PlannerTunables, lowest: int,
                     highest: int) -> bool:
    """Plan ahead with real packer counts? Only when the whole window is searched anyway."""
    sizes = highest - lowest + 1
    # The next step's segments run from each candidate boundary to each boundary after it:
    # about sizes^2 segments of up to highest examples each (memoised across steps).
    return (covers(search_budget(max_packs, tunables, lowest, highest), lowest, highest)
            and sizes * sizes * highest <= tunables.exact_lookahead_examples)


def choose_search(setting: SearchSetting, lowest: int, highest: int) -> SizeSearch:
    """The search a window gets: exact wherever it is affordable (`searches_exactly`), so the
    bounded one, which can take a size the exact one ranks lower, never runs on such a window;
    bounded otherwise, with the window's budget."""
    if searches_exactly(setting.max_packs, setting.tunables, lowest, highest):
        return ExactSearch(setting)
    return BoundedSearch(setting, search_budget(setting.max_packs, setting.tunables, lowest,
                                                highest))


def promising(bound: int, dp: int, slack: int) -> bool:
    """Could this prefix pack into a multiple of dp? (Its count is rarely above bound + slack.)"""
    return first_multiple(bound, dp) <= bound + slack


class ExactSearch:
    """The whole window, with real packer counts for the next step (`searches_exactly`)."""

    def __init__(self, setting: SearchSetting) -> None:
        self.setting = setting

    def search(self, problem: SearchProblem) -> SearchResult:
        setting, lengths, sizes = self.setting, problem.lengths, problem.sizes
        segments, bound = setting.segments, problem.bound
        position = {k: i for i, k in enumerate(sizes)}
        ranked = sorted(sizes, key=lambda k: (problem.token_gap(k), position[k]))
        # Real counts for the next step, the bound beyond: as good on real pools, 3x cheaper.
        onward = (onward_alignment(setting.bound_judge(bound), len(lengths), problem.context,
                                   sizes, setting.horizon) if setting.horizon > 1 else None)
        tried: list[int] = []
        chosen, most, chosen_bins = None, -1, None
        weigh = problem.charge is not None  # ties on the future go to the least weighed gap
        best_gap = float("inf")
        for k in ranked:
            after, ends = onward.after(k, problem.context) if onward is not None else (-1, None)
            reach = max(after + 1, 0)
            if reach < most or (reach == most and not weigh):
                continue  # cannot beat the best so far (ties keep the earlier size)
            bins, ok = segments.segment(lengths, 0, k, bound)
            tried.append(k)
            if not ok:
                continue
            future = 0 if ends is None else max(after + int(any(
                segments.segment(lengths, k, int(e), bound)[1] for e in ends)), 0)
            gap = problem.weighed_gap(k, len(bins)) if weigh else 0.0
            if future > most or (weigh and future == most and gap < best_gap):
                chosen, most, chosen_bins, best_gap = k, future, bins, gap
                if onward is None and not weigh:
                    break  # no planning ahead: the first that aligns
        if chosen is None or chosen_bins is None:
            return SearchResult(tried, len(tried), None)
        return SearchResult(tried, len(tried), (chosen, chosen_bins))


class BoundedSearch:
    """At most a budget of packs, in the bound's order; the first size that aligns wins."""

    def __init__(self, setting: SearchSetting, budget: int | None) -> None:
        self.setting = setting
        self.budget = budget

    def search(self, problem: SearchProblem) -> SearchResult:
        setting = self.setting
        order, exact, future = search_order(setting, problem)
        budget = self.budget
        if budget is not None and not exact:
            # No bound is a multiple of dp: the step rarely aligns.
            budget = min(budget, setting.tunables.unlikely_packs)
        tried: list[int] = []
        packs = problem.packs
        for size in order:
            if budget is not None and packs >= budget:
                break
            bins, ok = setting.segments.segment(problem.lengths, 0, size, problem.bound)
            packs += 1
            tried.append(size)
            if ok:
                return SearchResult(tried, packs, (size, bins), future)
        return SearchResult(tried, packs, None, future)


def search_order(setting: SearchSetting, problem: SearchProblem) -> tuple[list[int], bool, dict[int, int]]:
    """The order in which to pack the window's sizes (given nearest the target first).

    Sizes whose bound is itself a multiple of dp come first (the packers here usually reach
    the bound), then those within ``bound_slack`` bins of one; among each, the sizes after which
    most of the next few steps can align, then the tokens nearest the anchor (with a
    per-micro-batch cost, plus the charge of the bound's bins); then the rest, which only a
    larger budget reaches. Also says whether any bound is itself a multiple of dp,
    and gives the steps ahead that can align after each size, where it was computed.
    """
    dp, sizes, bounds = setting.dp, problem.sizes, problem.bounds
    slack = setting.tunables.bound_slack

    def tier(k: int) -> int:
        bound = int(bounds[k])
        if bound % dp == 0 and bound >= dp:
            return 0  # aligns if the packer reaches the bound, as it usually does
        return 1 if promising(bound, dp, slack) else 2  # 1: aligns a bin or so above the bound

    tiers = {k: tier(k) for k in sizes}
    future: dict[int, int] = {}
    if setting.horizon > 1:
        candidates = [k for k in sizes if tiers[k] < 2]
        if len(candidates) > 1:
            # Every size: a padded step reuses it (the backward pass costs the same).
            future = future_alignment(setting.bound_judge(problem.bound), len(problem.lengths),
                                      problem.context, sizes, setting.horizon)
    position = {k: i for i, k in enumerate(sizes)}
    order = sorted(sizes, key=lambda k: (tiers[k], -future.get(k, 0) if tiers[k] < 2 else 0,
                                         problem.weighed_gap(k, int(bounds[k])), position[k]))
    return order, any(t == 0 for t in tiers.values()), future


def packed_judge(setting: SearchSetting, lengths: np.ndarray, bound: SegmentBound) -> PairJudge:
    """Real packer counts as a pair-by-pair judge (memoised): for checks against the bound's."""
    def test(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        return np.array([setting.segments.segment(lengths, int(s), int(e), bound)[1]
                         for s, e in zip(starts, ends, strict=True)], dtype=bool)
    return PairJudge(test)
