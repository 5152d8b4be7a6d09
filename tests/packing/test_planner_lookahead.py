"""The lookahead at its seam: checked against brute force over every admissible path.

On small windows well inside the epoch (and at its end, where the last boundary is the epoch's
end), every sequence of step sizes the windows allow is enumerated with `StepContext`, and the
most steps that align along any of them is compared with the backward pass. The judge is an
arbitrary pair test (a hash of the segment), so no property of the bound hides a wrong pass.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.planner.bounds import BoundJudge, PairJudge, SegmentBound
from megatron_packing.packing.planner.lookahead import (
    boundary_layers,
    future_alignment,
    onward_alignment,
)
from megatron_packing.packing.planner.window import StepContext
from megatron_packing.packing.tunables import DEFAULT_TUNABLES

FAST = settings(max_examples=80, deadline=None)


def hashed_judge(salt: int, density: float) -> PairJudge:
    """Whether segment [s, e) "aligns": a fixed pseudo-random function of (s, e)."""
    def test(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        mixed = (starts.astype(np.int64) * 1_000_003 + ends.astype(np.int64) * 7919 + salt) % 1009
        return mixed < density * 1009
    return PairJudge(test)


def brute_best(judge: PairJudge, context: StepContext | None, position: int, depth: int,
               available: int) -> int | None:
    """Most aligned steps over ``depth`` more steps from ``position``; None when no full path."""
    @cache
    def best(drift: int, remaining: int, left_epoch: int, left_run: int | None, pos: int,
             depth: int) -> int | None:
        if depth == 0:
            return 0
        ctx = StepContext(context.batch_size, context.v, drift, remaining, left_epoch, left_run)
        lowest, highest, _ = ctx.window()
        found = None
        for size in range(lowest, highest + 1):
            end = pos + size
            if end > available:
                break
            following = ctx.after(size)
            rest = 0 if following is None and depth == 1 else (
                None if following is None else best(following.drift, following.remaining,
                                                    following.steps_left_in_epoch,
                                                    following.steps_left_in_run, end, depth - 1))
            if rest is None:
                continue
            gain = int(judge(np.array([pos]), np.array([end]))[0]) + rest
            found = gain if found is None else max(found, gain)
        return found

    if context is None:
        return 0 if depth == 0 else None
    return best(context.drift, context.remaining, context.steps_left_in_epoch,
                context.steps_left_in_run, position, depth)


@st.composite
def cases(draw):
    batch = draw(st.integers(3, 9))
    v = draw(st.integers(1, max(1, batch // 3)))
    drift = draw(st.integers(-v, v))
    horizon = draw(st.integers(2, 4))
    near_end = draw(st.booleans())
    steps_left = draw(st.integers(2, horizon)) if near_end else 50
    # Near the end: the last step is a tail of a few examples (N = k x B + r, small r), so
    # the rule that leaves one example for each later step binds.
    tail = draw(st.integers(1, v + 2))
    remaining = ((steps_left - 1) * batch - drift + tail) if near_end else 10_000
    remaining = max(remaining, steps_left)
    available = min(remaining, (horizon + 1) * (batch + v))
    judge = hashed_judge(draw(st.integers(0, 10_000)), draw(st.sampled_from([0.2, 0.5, 0.8])))
    return StepContext(batch, v, drift, remaining, steps_left), horizon, available, judge


def depth_of(context: StepContext, horizon: int) -> int:
    """Steps after this one that the pass judges: the horizon, or to the epoch's end."""
    return min(horizon, context.steps_left_in_epoch) - 1


@FAST
@given(cases())
def test_future_alignment_matches_brute_force(case):
    context, horizon, available, judge = case
    lowest, highest, _ = context.window()
    sizes = list(range(lowest, highest + 1))
    future = future_alignment(judge, available, context, sizes, horizon)
    depth = depth_of(context, horizon)
    for k in sizes:
        expected = brute_best(judge, context.after(k), k, depth, available)
        assert future[k] == max(expected or 0, 0), (k, future, expected)


@FAST
@given(cases())
def test_onward_alignment_matches_brute_force(case):
    context, horizon, available, judge = case
    lowest, highest, _ = context.window()
    sizes = list(range(lowest, highest + 1))
    onward = onward_alignment(judge, available, context, sizes, horizon)
    depth = depth_of(context, horizon)
    if depth == 0:
        assert onward is None
        return
    assert onward is not None
    for k in sizes:
        after = context.after(k)
        most, ends = onward.after(k, context)
        # Brute force: every admissible end e of the next step, then the steps after it.
        options = {}
        if after is not None:
            next_low, next_high, _ = after.window()
            for e in range(k + next_low, min(k + next_high, available) + 1):
                rest = brute_best(judge, after.after(e - k), e, depth - 1, available)
                if rest is not None:
                    options[e] = rest
        if not options:
            assert most == -1 and ends is None
            continue
        assert most == max(options.values())
        assert sorted(ends.tolist()) == sorted(e for e, r in options.items() if r == most)


def test_a_worked_lookahead():
    # B = 4, v = 1, two steps ahead: only segments [3, 7) and [5, 9) align. Taking 3 now lets
    # the next step align (3 -> 7); taking 5 lets it align too (5 -> 9); taking 4 does not.
    def test(starts, ends):
        return np.array([(int(s), int(e)) in {(3, 7), (5, 9)} for s, e in zip(starts, ends, strict=True)])

    context = StepContext(4, 1, 0, 1000, 50)
    future = future_alignment(PairJudge(test), 100, context, [4, 5, 3], 2)
    assert future == {3: 1, 4: 0, 5: 1}


@FAST
@given(cases())
def test_every_boundary_leaves_an_example_for_each_later_step(case):
    # The layers of boundaries: a normal step's end leaves at least one example for each later
    # step of the epoch, the tail ends at the epoch's end, and nothing past the read-ahead.
    context, horizon, available, _ = case
    layers = boundary_layers(context, context.window().target, horizon, available)
    assert len(layers) == depth_of(context, horizon)
    for j, layer in enumerate(layers):
        steps_after = context.steps_left_in_epoch - (j + 2)  # steps of the epoch after this one
        if layer.tail:
            assert steps_after == 0 and layer.positions.tolist() == [context.remaining]
        else:
            assert (layer.positions <= context.remaining - steps_after).all()
            assert (np.abs(layer.offsets) <= context.v).all()
        assert (layer.positions <= available).all()


@st.composite
def bound_cases(draw):
    """A lookahead case judged by the segment bound: lengths near C/t (t = 1..4, so every term
    of the bound can decide), sometimes own-bin oversize ones, dp from 1 to 8."""
    context, horizon, available, _ = draw(cases())
    capacity = 12 * draw(st.integers(1, 20))
    near = st.sampled_from([capacity, capacity // 2, capacity // 3, capacity // 4, capacity // 6])
    # Mostly exact fractions: segment totals then land on multiples of C, where an
    # off-by-one in a term's threshold shows.
    length = st.one_of(near, near, near.map(lambda x: x + 1), st.integers(1, capacity))
    if draw(st.booleans()):
        length = st.one_of(length, st.integers(capacity + 1, 2 * capacity))  # own-bin examples
    lengths = np.array(draw(st.lists(length, min_size=available, max_size=available)),
                       dtype=np.int64)
    return context, horizon, available, SegmentBound(lengths, capacity), draw(st.integers(1, 8))


@FAST
@given(bound_cases())
def test_the_bound_judges_rows_by_sorted_search_as_it_judges_every_cell(case):
    # Above `range_judge_cells` the bound's judge answers each row of a (boundary, next
    # boundary) grid by sorted searches; with the threshold at 0 every grid goes that way, at
    # a huge one none does. The counts of aligned steps ahead must be the same.
    context, horizon, available, bound, dp = case
    lowest, highest, _ = context.window()
    sizes = list(range(lowest, highest + 1))
    by_rows = BoundJudge(bound, dp, tunables=replace(DEFAULT_TUNABLES, range_judge_cells=0))
    by_cells = BoundJudge(bound, dp, tunables=replace(DEFAULT_TUNABLES, range_judge_cells=1 << 60))
    assert (future_alignment(by_rows, available, context, sizes, horizon)
            == future_alignment(by_cells, available, context, sizes, horizon))
    rows = onward_alignment(by_rows, available, context, sizes, horizon)
    cells = onward_alignment(by_cells, available, context, sizes, horizon)
    assert (rows is None) == (cells is None)
    if rows is not None and cells is not None:
        assert rows.best.tolist() == cells.best.tolist()
