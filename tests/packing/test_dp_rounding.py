"""The one DP-rounding mechanism (`round_to_dp`): its contract, a worked example, and that the
factory's ``dp_size`` packer and the planner's padded steps round the same way."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.algorithms import PackingAlgorithm
from megatron_packing.packing.alignment import Alignment
from megatron_packing.packing.dp_rounding import round_to_dp
from megatron_packing.packing.factory import make_seq_packer, make_sft_sequence_packer
from megatron_packing.packing.planner.sizer import StepSizer
from megatron_packing.packing.planner.window import StepContext

from ._helpers import check_fits, check_partition

ALGORITHMS = [a.value for a in PackingAlgorithm]
SETTINGS = settings(max_examples=80, deadline=None)


def smallest_multiple(count: int, dp: int) -> int:
    """The least multiple of dp that is >= max(count, dp), by counting up."""
    return next(m for m in itertools.count(dp, dp) if m >= max(count, dp))


@st.composite
def natural_packings(draw):
    seq = draw(st.sampled_from([1, 2, 4, 8]))
    alignment = Alignment(seq, seq * draw(st.sampled_from([1, 2, 4])))
    capacity = draw(st.integers(alignment.bin_multiple, 512))
    max_len = alignment.max_sequence_length(capacity)
    lengths = draw(st.lists(st.integers(1, max_len), max_size=60))
    packer = make_seq_packer(draw(st.sampled_from(ALGORITHMS)), capacity, alignment=alignment)
    return packer, lengths, draw(st.integers(1, 16))


@SETTINGS
@given(natural_packings())
def test_round_to_dp_reaches_the_least_multiple_and_keeps_every_example(case) -> None:
    packer, lengths, dp = case
    natural = packer.pack(lengths)
    sizes = packer.alignment.padded_lengths(np.asarray(lengths, dtype=np.int64))
    bins, placeholders = round_to_dp(natural, sizes, dp)
    target = smallest_multiple(len(natural), dp)
    assert len(bins) == target
    check_partition([b for b in bins if b], len(lengths))  # every example exactly once
    check_fits(bins, lengths, packer.alignment, packer.bin_capacity)
    assert placeholders == sum(1 for b in bins if not b)
    # Placeholder bins only when there are fewer examples than bins to fill.
    assert placeholders == max(0, target - len(lengths))
    if len(natural) == target:
        assert bins == natural
    elif not placeholders:  # only splits: each bin is part of one natural bin
        homes = [set(b) for b in natural]
        assert all(any(set(b) <= home for home in homes) for b in bins)


def test_round_to_dp_worked_example() -> None:
    # Capacity 100, MFFD: [60, 40] and [50, 30, 20], both loads 100.
    lengths = [60, 50, 40, 30, 20]
    natural = make_seq_packer("mffd", 100).pack(lengths)
    assert natural == [[0, 2], [1, 3, 4]]
    assert round_to_dp(natural, lengths, 2) == (natural, 0)  # already a multiple: unchanged
    # dp 3: the heaviest (a tie: the lower index) splits into {60} and {40}; the second half
    # is appended.
    assert round_to_dp(natural, lengths, 3) == ([[0], [1, 3, 4], [2]], 0)
    # dp 4: then [50, 30, 20] splits: 50 into the first half, 30 and 20 into the lighter second.
    assert round_to_dp(natural, lengths, 4) == ([[0], [1], [2], [3, 4]], 0)
    # dp 8: 5 examples for 8 bins: one each, in position order, and 3 placeholder bins.
    assert round_to_dp(natural, lengths, 8) == ([[0], [1], [2], [3], [4], [], [], []], 3)
    assert round_to_dp([], [], 4) == ([[], [], [], []], 4)  # no examples: dp placeholders


def planned_step(packer, lengths: np.ndarray, dp: int):
    """The planner's decision for a forced step (an epoch's tail) of all of ``lengths``."""
    sizer = StepSizer(packer, dp)
    context = StepContext(len(lengths), 0, 0, len(lengths), 1)
    return sizer.decide(lengths, packer.alignment.padded_lengths(lengths), context)


@SETTINGS
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=50), st.integers(1, 12),
       st.sampled_from(ALGORITHMS), st.sampled_from([1, 2]), st.sampled_from([1, 2]))
def test_the_factory_packer_rounds_as_the_planner_pads(lengths, dp, algorithm, tp, cp) -> None:
    values = np.asarray(lengths, dtype=np.int64)
    plain = make_sft_sequence_packer(1024, tp, cp, algorithm=algorithm)
    rounded = make_sft_sequence_packer(1024, tp, cp, dp_size=dp, algorithm=algorithm)
    decision = planned_step(plain, values, dp)
    if decision.packed_bins < len(plain.pack(values)):
        return  # the planner found a tighter packing: not the same natural bins
    packed = rounded.pack(values)
    assert decision.bins == packed
    assert decision.placeholder_bins == sum(1 for b in packed if not b)


def test_the_factory_packer_and_the_planner_pad_this_step_alike() -> None:
    # The example above, through both: split bins at dp 4, placeholders at dp 8.
    lengths = np.array([60, 50, 40, 30, 20])
    for dp, expected, placeholders in ((4, [[0], [1], [2], [3, 4]], 0),
                                       (8, [[0], [1], [2], [3], [4], [], [], []], 3)):
        decision = planned_step(make_sft_sequence_packer(100), lengths, dp)
        assert (decision.bins, decision.placeholder_bins) == (expected, placeholders)
        assert make_sft_sequence_packer(100, dp_size=dp).pack(lengths) == expected
