"""The bound on a step's slowest rank: never above what a hand-out reaches, and worked examples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from megatron_packing.packing.balance import sequence_cost
from megatron_packing.packing.hand_out import hand_out
from megatron_packing.packing.rank_bound import slowest_rank_bound
from megatron_packing.packing.tunables import DEFAULT_TUNABLES

from .test_rebalance import steps


def _slowest(bins: list[list[int]], lengths: np.ndarray, ranks: list[list[int]],
             constant: float) -> float:
    costs = sequence_cost(lengths, constant)
    return max(float(sum(costs[i] for b in r for i in bins[b])) for r in ranks)


@st.composite
def hand_outs(draw):
    """Examples put into dp x n bins of a capacity at random (each into a random bin with room),
    with lengths at or below their footprints: any hand-out a step could have."""
    capacity = draw(st.sampled_from([8, 50, 100, 4096]))
    dp = draw(st.integers(1, 5))
    per_rank = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.integers(1, capacity), min_size=1, max_size=40))
    # Examples of exactly C / t make full bins, where the bound is tightest.
    sizes += [capacity // t for t in draw(st.lists(st.sampled_from([1, 2, 3, 4]), max_size=6))]
    sizes = [s for s in sizes if s > 0]
    shrink = draw(st.lists(st.integers(0, 3), min_size=len(sizes), max_size=len(sizes)))
    lengths = [max(1, s - d) for s, d in zip(sizes, shrink, strict=True)]
    load = [0] * (dp * per_rank)
    bins: list[list[int]] = [[] for _ in load]
    for i in draw(st.permutations(range(len(sizes)))):
        open_bins = [b for b, x in enumerate(load) if x + sizes[i] <= capacity]
        assume(open_bins)
        b = open_bins[draw(st.integers(0, len(open_bins) - 1))]
        bins[b].append(i)
        load[b] += sizes[i]
    ranks = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(dp)]
    constant = draw(st.sampled_from([4.0, 100.0, 24576.0]))
    return dict(bins=bins, ranks=ranks, lengths=np.asarray(lengths), sizes=np.asarray(sizes),
                capacity=capacity, dp=dp, per_rank=per_rank, constant=constant)


@settings(max_examples=400, deadline=None)
@given(hand_outs())
def test_no_hand_out_is_faster_than_the_bound(h) -> None:
    bound = slowest_rank_bound(h["lengths"], h["sizes"], h["per_rank"], h["dp"], h["capacity"],
                               h["constant"])
    assert bound <= _slowest(h["bins"], h["lengths"], h["ranks"], h["constant"]) * (1 + 1e-12)


@settings(max_examples=300, deadline=None)
@given(steps())
def test_the_sampler_hand_out_never_beats_the_bound(s) -> None:
    # The sampler's own hand-out, oversize examples alone in their bins and placeholders
    # included: the bound widens every bin to the largest example, so it still holds.
    bins, sizes, dp, constant = s["bins"], s["sizes"], s["dp"], s["constant"]
    out, ranks = hand_out(bins, sizes, sizes, dp, s["capacity"], "rebalanced",
                          DEFAULT_TUNABLES, constant)
    bound = slowest_rank_bound(sizes, sizes, len(bins) // dp, dp, s["capacity"], constant)
    assert bound <= _slowest(out, sizes, ranks, constant) * (1 + 1e-12)


def test_full_bins_make_the_rank_with_the_long_sequence_pay_its_attention_on_top() -> None:
    # Capacity 100, k = 100 (a sequence of s costs s + s^2 / 100), dp 2, 2 bins per rank.
    # One sequence of 100 (cost 200) and thirty of 10 (11 each): 400 tokens fill all 4 bins.
    lengths = np.array([100] + [10] * 30)
    # The mean rank costs (400 + 100 + 30) / 2 = 265; the longest example alone costs 200.
    # But the rank holding it must hold 200 tokens, its 100 and ten 10s: 200 + attention 100
    # + 10 x 1 = 310.
    assert slowest_rank_bound(lengths, lengths, 2, 2, 100, 100.0) == pytest.approx(310.0)
    # The sampler's hand-out reaches it.
    bins = [[0], list(range(1, 11)), list(range(11, 21)), list(range(21, 31))]
    out, ranks = hand_out(bins, lengths, lengths, 2, 100, "rebalanced", DEFAULT_TUNABLES, 100.0)
    assert _slowest(out, lengths, ranks, 100.0) == pytest.approx(310.0)


def test_room_in_the_bins_lowers_the_bound_to_the_mean() -> None:
    # The same with ten tens fewer: 100 tokens of room. The long sequence's rank can hold 100
    # tokens less, so the bound is the mean, (300 + 100 + 20) / 2 = 210.
    lengths = np.array([100] + [10] * 20)
    assert slowest_rank_bound(lengths, lengths, 2, 2, 100, 100.0) == pytest.approx(210.0)
    # The hand-out pairs the long sequence's bin with the empty one: 211 against 209.
    bins = [[0, 1], list(range(2, 12)), list(range(12, 21)), []]
    out, ranks = hand_out(bins, lengths, lengths, 2, 100, "rebalanced", DEFAULT_TUNABLES, 100.0)
    assert _slowest(out, lengths, ranks, 100.0) == pytest.approx(211.0)


def test_the_ranks_holding_the_longest_examples_fill_up_with_the_shortest() -> None:
    # Capacity 100, k = 100, dp 3, 1 bin per rank: 90, 90 and twelve 10s (300 tokens, the
    # three bins full), the mean rank (300 + 162 + 12) / 3 = 158. The rank holding a 90 holds
    # 100 tokens, so a 10 too: 100 + 81 + 1 = 182 (q = 1). If both 90s shared a rank (q = 2,
    # m = 1) it would hold 180 tokens; on two ranks (m = 2) they hold 200: (200 + 162 + 2) / 2.
    lengths = np.array([90, 90] + [10] * 12)
    assert slowest_rank_bound(lengths, lengths, 1, 3, 100, 100.0) == pytest.approx(182.0)
    # The best hand-out: [90, 10], [90, 10], [ten 10s]: 182.
    bins = [[0, 2], [1, 3], list(range(4, 14))]
    assert _slowest(bins, lengths, [[0], [1], [2]], 100.0) == pytest.approx(182.0)


def test_an_oversize_example_widens_the_bins_it_is_judged_by() -> None:
    # Two examples of 150, each alone in a bin of capacity 100 (as own_bin keeps them), dp 2,
    # one bin per rank: each rank holds one, 150 + 225 = 375. Judged by bins of 100, the 300
    # tokens would overflow two ranks by 100 and the bound would claim 425.
    lengths = np.array([150, 150])
    assert slowest_rank_bound(lengths, lengths, 1, 2, 100, 100.0) == pytest.approx(375.0)
    assert slowest_rank_bound([], [], 1, 2, 100) == 0.0
