"""The two search strategies at their seam, on windows small enough to search exactly.

`ExactSearch` must pick what packing every size and every (size, next boundary) segment would
pick; `BoundedSearch` with a budget covering the window must align exactly when the exact one
does, and with a budget must stay inside it. The bounded search plans ahead by the bound alone
and packs in the bound's tiers, so it can pick a size the exact one ranks lower (measured, 24 of
290 aligned steps on the shipped pools at B = 64, v = 3, dp 2/4/8; shown here on a drawn case).
That is why `choose_search` gives every window the exact search can afford to it, and the search
a sizer runs on a small window whose budget covers it never takes a size the exact one ranks
lower.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.factory import make_seq_packer
from megatron_packing.packing.planner.lookahead import future_alignment
from megatron_packing.packing.planner.search import (
    BoundedSearch,
    ExactSearch,
    SearchProblem,
    choose_search,
    covers,
    packed_judge,
    search_budget,
    searches_exactly,
)
from megatron_packing.packing.planner.sizer import DEFAULT_MAX_PACKS, StepSizer
from megatron_packing.packing.planner.window import StepContext
from megatron_packing.packing.tunables import DEFAULT_TUNABLES

FAST = settings(max_examples=120, deadline=None)


@st.composite
def steps(draw):
    """A sizer, a read-ahead and a context whose window is small."""
    capacity = draw(st.sampled_from([512, 1024, 2048]))
    batch = draw(st.integers(8, 32))
    v = draw(st.integers(1, 3))
    dp = draw(st.integers(2, 6))
    horizon = draw(st.integers(1, 4))
    drift = draw(st.integers(-v, v))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    count = (horizon + 1) * (batch + v)
    # Short and long examples mixed, as in SFT pools.
    lengths = np.where(rng.random(count) < 0.3, rng.integers(capacity // 3, capacity, count),
                       rng.integers(1, capacity // 4, count)).astype(np.int64)
    packer = make_seq_packer(draw(st.sampled_from(["mffd", "ffd", "bfd"])), bin_capacity=capacity)
    sizer = StepSizer(packer, dp, lookahead_steps=horizon)
    return sizer, lengths, StepContext(batch, v, drift, 10_000, 50)


def problem_of(sizer: StepSizer, lengths: np.ndarray, context: StepContext) -> SearchProblem:
    window = context.window()
    bound = sizer.bound(lengths)
    tokens = np.concatenate(([0], np.cumsum(lengths)))
    anchor = float(tokens[-1]) / len(lengths) * window.target
    return SearchProblem(lengths, bound, bound.prefixes(window.highest), context, window.sizes(),
                         lambda k: abs(float(tokens[k]) - anchor))


def aligned_partition(bins, size: int, dp: int) -> bool:
    return (len(bins) % dp == 0 and len(bins) >= dp
            and sorted(p for b in bins for p in b) == list(range(size)))


@FAST
@given(steps())
def test_the_exact_search_picks_what_packing_every_segment_picks(step):
    sizer, lengths, context = step
    problem = problem_of(sizer, lengths, context)
    result = ExactSearch(sizer.setting).search(problem)
    setting = sizer.setting
    good = [k for k in problem.sizes
            if setting.segments.segment(lengths, 0, k, problem.bound)[1]]
    if not good:
        assert result.chosen is None and sorted(result.tried) == sorted(problem.sizes)
        return
    if sizer.horizon > 1:
        future = future_alignment(packed_judge(setting, lengths, problem.bound), len(lengths),
                                  context, good, sizer.horizon, setting.bound_judge(problem.bound))
    else:
        future = dict.fromkeys(good, 0)
    position = {k: i for i, k in enumerate(problem.sizes)}
    expected = min(good, key=lambda k: (-future[k], problem.token_gap(k), position[k]))
    assert result.chosen is not None
    size, bins = result.chosen
    assert size == expected
    assert aligned_partition(bins, size, sizer.dp_size)


@FAST
@given(steps())
def test_the_bounded_search_aligns_exactly_when_the_exact_one_does(step):
    sizer, lengths, context = step
    problem = problem_of(sizer, lengths, context)
    exact = ExactSearch(sizer.setting).search(problem)
    bounded = BoundedSearch(sizer.setting, None).search(problem)
    assert (bounded.chosen is None) == (exact.chosen is None)
    if bounded.chosen is not None:
        size, bins = bounded.chosen
        assert aligned_partition(bins, size, sizer.dp_size)
        assert bounded.tried[-1] == size  # the first that aligns is taken
    else:
        assert sorted(bounded.tried) == sorted(problem.sizes)  # every size was packed


@FAST
@given(steps(), st.integers(1, 4))
def test_the_bounded_search_stays_within_its_budget(step, budget):
    sizer, lengths, context = step
    problem = problem_of(sizer, lengths, context)
    result = BoundedSearch(sizer.setting, budget).search(problem)
    assert result.packs <= max(budget, problem.packs)
    dp = sizer.dp_size
    if not any(int(problem.bounds[k]) % dp == 0 and problem.bounds[k] >= dp for k in problem.sizes):
        assert result.packs <= min(budget, DEFAULT_TUNABLES.unlikely_packs)


def test_which_search_a_window_gets():
    tunables, packs = DEFAULT_TUNABLES, DEFAULT_MAX_PACKS
    # B = 128, v = 6: 13 sizes x 134 <= 16,384 and 13^2 x 134 <= 32,768: exact.
    assert search_budget(packs, tunables, 122, 134) is None
    assert searches_exactly(packs, tunables, 122, 134)
    # B = 256, v = 12: 25 x 268 <= 16,384 (whole window) but 25^2 x 268 > 32,768: bounded.
    assert search_budget(packs, tunables, 244, 268) is None
    assert not searches_exactly(packs, tunables, 244, 268)
    # B = 1024, v = 51: a budget of max_packs.
    assert search_budget(packs, tunables, 973, 1075) == packs
    assert search_budget(None, tunables, 973, 1075) is None


def exact_ranking(sizer: StepSizer, lengths: np.ndarray, problem: SearchProblem):
    """The exact search's ranking of the aligning sizes (smaller is better), computed apart from
    it: every size packed, the next step by real packer counts, the steps beyond by the bound."""
    setting = sizer.setting
    good = [k for k in problem.sizes if setting.segments.segment(lengths, 0, k, problem.bound)[1]]
    if sizer.horizon > 1 and good:
        future = future_alignment(packed_judge(setting, lengths, problem.bound), len(lengths),
                                  problem.context, good, sizer.horizon,
                                  setting.bound_judge(problem.bound))
    else:
        future = dict.fromkeys(good, 0)
    position = {k: i for i, k in enumerate(problem.sizes)}
    return {k: (-future[k], problem.token_gap(k), position[k]) for k in good}


@FAST
@given(steps(), st.sampled_from([None, 0, 3, 5]), st.integers(0, 8))
def test_on_a_small_window_its_budget_covers_the_search_never_ranks_below_the_exact_one(
        step, extra, budget):
    # ``extra`` None: no pack budget at all; otherwise max_packs is the window's size plus
    # ``extra`` (it covers the window); ``budget`` alone may fall short of it.
    sizer, lengths, context = step
    lowest, highest, _ = context.window()
    packs = None if extra is None else highest - lowest + 1 + extra
    for max_packs in (packs, budget):
        tunables = replace(sizer.tunables, full_search_examples=0)
        sized = StepSizer(sizer.packer, sizer.dp_size, max_packs=max_packs, tunables=tunables)
        if not covers(search_budget(max_packs, tunables, lowest, highest), lowest, highest):
            continue  # the budget leaves sizes unpacked: the window is not searched whole
        problem = problem_of(sized, lengths, context)
        ranking = exact_ranking(sized, lengths, problem)
        result = choose_search(sized.setting, lowest, highest).search(problem)
        if not ranking:
            assert result.chosen is None
            continue
        assert result.chosen is not None
        assert ranking[result.chosen[0]] <= min(ranking.values()), (result.chosen[0], ranking)


def test_the_bounded_search_can_take_a_size_the_exact_one_ranks_lower():
    # Why small windows get the exact search: over a whole window, the first size that aligns
    # in the bound's order is sometimes not the exact search's choice.
    rng = np.random.default_rng(0)
    for _ in range(400):
        capacity, batch, v, dp = 1024, int(rng.integers(8, 33)), int(rng.integers(1, 4)), int(rng.integers(2, 7))
        horizon = int(rng.integers(2, 5))
        count = (horizon + 1) * (batch + v)
        lengths = np.where(rng.random(count) < 0.3, rng.integers(capacity // 3, capacity, count),
                           rng.integers(1, capacity // 4, count)).astype(np.int64)
        packer = make_seq_packer("mffd", bin_capacity=capacity)
        sizer = StepSizer(packer, dp, lookahead_steps=horizon)
        context = StepContext(batch, v, int(rng.integers(-v, v + 1)), 10_000, 50)
        problem = problem_of(sizer, lengths, context)
        ranking = exact_ranking(sizer, lengths, problem)
        chosen = BoundedSearch(sizer.setting, None).search(problem).chosen
        if chosen is not None and ranking[chosen[0]] > min(ranking.values()):
            return
    raise AssertionError("the bounded search matched the exact one on every drawn window")
