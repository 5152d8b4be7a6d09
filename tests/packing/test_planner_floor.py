"""Evening a step at its floor (`planner.floor`, `StepSizer._even_at_floor`) at its seams.

Where no size of any step ahead can fall to a lower multiple of dp, a step takes the size whose
tokens are nearest B x the mean length instead of aligning, and never costs a bin for it (the
stream-level check is in tests/sampler/test_invariants.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.dp_rounding import first_multiple
from megatron_packing.packing.factory import make_seq_packer
from megatron_packing.packing.planner.bounds import SegmentBound
from megatron_packing.packing.planner.floor import floor_bins, no_step_can_drop
from megatron_packing.packing.planner.sizer import StepSizer
from megatron_packing.packing.planner.window import StepContext
from megatron_packing.packing.tunables import DEFAULT_TUNABLES
from megatron_packing.reports.simulation import simulate

FAST = settings(max_examples=80, deadline=None)


def test_no_step_can_drop_worked_examples():
    # Examples of 100 tokens, capacity 1,000: a step of B = 100 is 10 bins, of B - v = 90 is 9.
    bound = SegmentBound(np.full(2_000, 100), 1_000)
    # dp 4: 9 and 10 both round up to 12; no step ahead can fall to 8.
    assert no_step_can_drop(bound, 0, 100, 10, 3, 2_000, 4, 0.0)
    # dp 5: 10 is a multiple, 9 rounds up to 10 as well; at dp 3, 9 is a lower multiple than 12.
    assert no_step_can_drop(bound, 0, 100, 10, 3, 2_000, 5, 0.0)
    assert not no_step_can_drop(bound, 0, 100, 10, 3, 2_000, 3, 0.0)
    # A margin of 15% of the nominal 10 bins (2 bins) reaches 7 < 8 at dp 4.
    assert not no_step_can_drop(bound, 0, 100, 10, 3, 2_000, 4, 0.15)
    # Without a lookahead, or past the read-ahead, nothing is known of the steps ahead.
    assert not no_step_can_drop(bound, 0, 100, 10, 0, 2_000, 4, 0.0)
    assert not no_step_can_drop(bound, 1_950, 100, 10, 3, 2_000, 4, 0.0)
    assert floor_bins(bound.prefixes(100), 90, 4) == 12


@FAST
@given(st.lists(st.integers(1, 900), min_size=400, max_size=400), st.integers(20, 60),
       st.integers(1, 8), st.integers(1, 5), st.integers(2, 16),
       st.floats(0.0, 0.3), st.floats(0.0, 0.3))
def test_a_larger_margin_never_lets_more_steps_be_evened(sizes, batch, v, steps, dp, a, b):
    bound = SegmentBound(np.array(sizes), 1_000)
    small, large = sorted((a, b))
    if no_step_can_drop(bound, 0, batch, v, steps, len(sizes), dp, large):
        assert no_step_can_drop(bound, 0, batch, v, steps, len(sizes), dp, small)


@st.composite
def floor_steps(draw):
    """Short examples and a dp larger than a window's spread of bins: often no size saves one."""
    capacity = 2_048
    batch = draw(st.integers(64, 160))
    v = draw(st.integers(2, 8))
    lengths = np.array(draw(st.lists(st.integers(20, 400), min_size=4 * batch, max_size=4 * batch)))
    dp = draw(st.sampled_from([4, 8, 16]))
    drift = draw(st.integers(-v, v))
    packer = make_seq_packer(draw(st.sampled_from(["mffd", "ffd", "bfd"])), bin_capacity=capacity)
    return StepSizer(packer, dp), lengths, StepContext(batch, v, drift, 10_000, 50)


@FAST
@given(floor_steps())
def test_an_evened_step_takes_the_nominal_tokens_and_costs_no_bin_more(step):
    sizer, lengths, context = step
    decision = sizer.decide(lengths, lengths, context)
    if not decision.evened:
        return
    lowest, highest, _ = context.window()
    dp = sizer.dp_size
    tokens = np.concatenate(([0], np.cumsum(lengths)))
    nominal = tokens[-1] / len(lengths) * context.batch_size
    gaps = np.abs(tokens[lowest:highest + 1] - nominal)
    assert abs(tokens[decision.size] - nominal) == gaps.min()
    assert not decision.deferred and decision.placeholder_bins == 0
    for size in range(lowest, highest + 1):
        assert first_multiple(len(sizer.packer.pack(lengths[:size])), dp) >= len(decision.bins)


def test_steps_are_evened_only_with_the_margin_on():
    # About 61 bins a step at dp 16: a larger size reaches 64, none falls to 48.
    rng = np.random.default_rng(3)
    lengths = rng.integers(20, 420, size=4_000)
    packer = make_seq_packer("mffd", bin_capacity=2_048)
    context = StepContext(570, 28, 0, 10_000, 50)
    on = StepSizer(packer, 16).decide(lengths, lengths, context)
    off = StepSizer(packer, 16, tunables=replace(DEFAULT_TUNABLES, floor_margin_spreads=None))
    aligning = off.decide(lengths, lengths, context)
    assert on.evened and not on.aligned and len(on.bins) == 64 and on.size < aligning.size
    assert aligning.aligned and not aligning.evened and len(aligning.bins) == 64


def test_evening_brings_the_token_cv_below_fixed_b_where_alignment_saves_no_bin():
    # Short examples, capacity 2K, B 570 at dp 16: about 61 bins a step, so some sizes reach 64
    # but none falls to 48. Aligning there only swings the tokens.
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 420, size=570 * 24)
    common = dict(batch_size=570, capacity=2_048, dp_size=16, steps=24)
    fixed = simulate(lengths, align=False, **common)
    evened = simulate(lengths, align=True, **common)
    aligned = simulate(lengths, align=True, **common,
                       tunables=replace(DEFAULT_TUNABLES, floor_margin_spreads=None))
    assert evened.bins == aligned.bins == fixed.bins
    assert aligned.aligned_steps > 0
    assert evened.token_cv <= fixed.token_cv < aligned.token_cv

