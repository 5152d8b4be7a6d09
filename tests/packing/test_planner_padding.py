"""Padded steps and deferral at their seams: what they return is always a valid step.

How a padded step's bins are rounded up to a multiple of dp: tests/packing/test_dp_rounding.py.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.factory import make_seq_packer
from megatron_packing.packing.planner.padding import fewest_padding_size, rank_padded
from megatron_packing.packing.planner.sizer import StepSizer
from megatron_packing.packing.planner.window import StepContext

FAST = settings(max_examples=60, deadline=None)


def test_padded_sizes_rank_by_token_distance_and_padding():
    packed = {10: [[0]] * 7, 11: [[0]] * 8, 12: [[0]] * 5}  # dp 4: 1, 0 and 3 padding bins
    gaps = {10: 0.5, 11: 0.9, 12: 3.0}
    # 12 is further from the anchor than a fixed-B step's spread: last whatever its padding.
    # (0.5)^2 + 0.3 x 1 = 0.55 against (0.9)^2 + 0 = 0.81: the default weight prefers 10;
    # at 0.6 a padding bin costs more than the token distance (0.85 against 0.81).
    assert rank_padded(packed, 4, 10, gaps.__getitem__, 1.0, 0.3) == [10, 11, 12]
    assert rank_padded(packed, 4, 10, gaps.__getitem__, 1.0, 0.6) == [11, 10, 12]
    # The bound's padding: size 5 is promised 0 padding bins, the rest more.
    bounds = np.array([0, 1, 2, 3, 3, 4, 5, 6])
    assert fewest_padding_size(bounds, 3, 7, 6, 4) == 5


@st.composite
def deferral_steps(draw):
    capacity = 1024
    batch = draw(st.integers(16, 40))
    v = draw(st.integers(1, 3))
    limit = draw(st.integers(1, 6))
    dp = draw(st.integers(2, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    count = batch + v + limit
    lengths = np.where(rng.random(count) < 0.3, rng.integers(capacity // 3, capacity, count),
                       rng.integers(1, capacity // 4, count)).astype(np.int64)
    context = StepContext(batch, v, draw(st.integers(-v, v)), 10_000, 50)
    forced = draw(st.integers(0, min(limit, context.window().lowest)))
    if draw(st.booleans()):  # the examples deferred before are the largest: never again
        lengths[:forced] = rng.integers(capacity // 2, capacity, forced)
    packer = make_seq_packer("mffd", bin_capacity=capacity)
    sizer = StepSizer(packer, dp, max_deferred=limit,
                      lookahead_steps=1)
    return sizer, lengths, context, forced


@FAST
@given(deferral_steps())
def test_a_deferral_is_an_aligned_step_that_defers_few_and_never_twice(step):
    sizer, lengths, context, forced = step
    window = context.window()
    tokens = np.concatenate(([0], np.cumsum(lengths)))
    deferral = sizer.deferral.search(lengths, lengths, sizer.bound(lengths), context, forced,
                                     window.target, tokens, float(tokens[-1]), None)
    if deferral is None:
        return
    dp, moved = sizer.dp_size, deferral.moved
    assert len(deferral.kept) % dp == 0 and len(deferral.kept) >= dp
    assert sorted([p for b in deferral.kept for p in b] + moved) == list(range(deferral.span))
    assert all(p >= forced for p in moved)  # an example deferred once is never deferred again
    assert 1 <= len(moved) <= sizer.max_deferred
    assert window.lowest <= deferral.span - len(moved) <= window.highest
    following = context.after(deferral.span - len(moved))
    assert following is not None and following.window().lowest >= len(moved)
    assert all(lengths[b].sum() <= sizer.capacity for b in deferral.kept)


def test_deferral_runs_on_these_steps():
    # The property above is not vacuous: deferrals are found, some with examples deferred before.
    found = with_forced = 0
    for seed in range(40):
        rng = np.random.default_rng(seed)
        lengths = np.where(rng.random(40) < 0.3, rng.integers(341, 1024, 40),
                           rng.integers(1, 256, 40)).astype(np.int64)
        sizer = StepSizer(make_seq_packer("mffd", bin_capacity=1024), 4, max_deferred=4)
        context = StepContext(32, 2, 0, 10_000, 50)
        tokens = np.concatenate(([0], np.cumsum(lengths)))
        forced = seed % 3
        deferral = sizer.deferral.search(lengths, lengths, sizer.bound(lengths), context, forced,
                                         32, tokens, float(tokens[32]), None)
        found += deferral is not None
        with_forced += deferral is not None and forced > 0
    assert found >= 10 and with_forced >= 5, (found, with_forced)
