"""Moving examples between ranks' bins: what it keeps, that it helps, and worked examples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.balance import (
    assign_bins_to_ranks,
    bin_costs,
    sequence_cost,
)
from megatron_packing.packing.rebalance import rebalance_examples


def _rank_costs(bins: list[list[int]], costs: np.ndarray, ranks: list[list[int]]) -> list[float]:
    return [float(sum(costs[i] for b in r for i in bins[b])) for r in ranks]


@st.composite
def steps(draw):
    """A step as the sampler hands it over: bins first-fit over the padded sizes, some empty
    placeholder bins, now and then an oversize example alone in its bin, a multiple of dp."""
    capacity = draw(st.sampled_from([16, 64, 100, 4096]))
    dp = draw(st.integers(2, 6))
    sizes = draw(st.lists(st.integers(1, capacity), min_size=1, max_size=60))
    oversize = draw(st.lists(st.integers(capacity + 1, 2 * capacity), max_size=2))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i, s in enumerate(sizes):
        for b, load in enumerate(loads):
            if load + s <= capacity:
                bins[b].append(i)
                loads[b] += s
                break
        else:
            bins.append([i])
            loads.append(s)
    for s in oversize:
        bins.append([len(sizes)])
        sizes.append(s)
    bins += [[] for _ in range(-len(bins) % dp + dp * draw(st.integers(0, 1)))]
    order = draw(st.permutations(range(len(bins))))
    bins = [bins[b] for b in order]
    constant = draw(st.sampled_from([8.0, 64.0, 24576.0]))
    return dict(bins=bins, sizes=np.asarray(sizes), capacity=capacity, dp=dp,
                constant=constant, costs=sequence_cost(sizes, constant), fill_rounds=draw(st.integers(0, 4)),
                evens=draw(st.integers(0, 3)), partners=draw(st.integers(1, 7)))


@settings(max_examples=300, deadline=None)
@given(steps())
def test_what_a_rebalance_keeps_and_that_the_slowest_rank_never_slows(s) -> None:
    bins, sizes, costs, capacity = s["bins"], s["sizes"], s["costs"], s["capacity"]
    ranks = assign_bins_to_ranks(bin_costs(bins, sizes, s["constant"]), s["dp"])
    out = rebalance_examples(bins, sizes, costs, ranks, capacity, fill_rounds=s["fill_rounds"],
                             evens_per_rank=s["evens"], partners=s["partners"])[0]
    assert len(out) == len(bins)
    assert sorted(i for b in out for i in b) == sorted(i for b in bins for i in b)
    for before, after in zip(bins, out, strict=True):
        assert bool(before) == bool(after)  # no bin emptied, no placeholder filled
        if sum(sizes[before]) > capacity:
            assert after == before  # an oversize example stays alone in its bin
        else:
            assert sum(sizes[after]) <= capacity
    assert max(_rank_costs(out, costs, ranks)) <= max(_rank_costs(bins, costs, ranks)) * (1 + 1e-12)
    assert rebalance_examples(bins, sizes, costs, ranks, capacity, fill_rounds=s["fill_rounds"],
                              evens_per_rank=s["evens"], partners=s["partners"])[0] == out  # deterministic
    # The rank costs kept along the moves are the costs of the bins it returns.
    same, kept = rebalance_examples(bins, sizes, costs, ranks, capacity,
                                    fill_rounds=s["fill_rounds"], evens_per_rank=s["evens"],
                                    partners=s["partners"])
    assert same == out
    assert kept == pytest.approx(_rank_costs(out, costs, ranks), rel=1e-9, abs=1e-9)


def test_one_move_evens_two_ranks() -> None:
    # Rank 0 holds bin 0 (sizes 5 and 4), rank 1 bin 1 (size 1); costs are the sizes.
    sizes = np.array([5, 4, 1])
    out = rebalance_examples([[0, 1], [2]], sizes, sizes.astype(float), [[0], [1]], 10,
                             fill_rounds=4, evens_per_rank=1, partners=3)[0]
    assert out == [[0], [2, 1]]


def test_a_swap_evens_two_ranks_where_no_move_fits() -> None:
    # Bin 0: sizes 5 and 4 (cost 9); bin 1: 3, 3, 1 (cost 7, room 2). Moving the 4 or the 5
    # would make rank 1 the slower; swapping the 4 for a 3 makes both 8.
    sizes = np.array([5, 4, 3, 3, 1])
    out = rebalance_examples([[0, 1], [2, 3, 4]], sizes, sizes.astype(float), [[0], [1]], 9,
                             fill_rounds=4, evens_per_rank=1, partners=3)[0]
    assert out == [[0, 2], [3, 4, 1]]
    assert _rank_costs(out, sizes.astype(float), [[0], [1]]) == [8.0, 8.0]


def test_an_exchange_evens_two_ranks_whose_bins_are_full() -> None:
    # Both bins are full (capacity 100), so no example can move and no one-for-one swap fits.
    # Costs s + s^2 / 100: rank 0 holds 60 and 40 (96 + 56 = 152), rank 1 five 20s (5 x 24 =
    # 120). The 40 goes into rank 1's bin and two 20s (the fewest smallest that make room,
    # cost 48) come back into its place: 144 against 128.
    sizes = np.array([60, 40, 20, 20, 20, 20, 20])
    costs = sequence_cost(sizes, 100.0)
    out = rebalance_examples([[0, 1], [2, 3, 4, 5, 6]], sizes, costs, [[0], [1]], 100,
                             fill_rounds=4, evens_per_rank=1, partners=3)[0]
    assert out == [[0, 2, 3], [4, 5, 6, 1]]
    assert _rank_costs(out, costs, [[0], [1]]) == [144.0, 128.0]


def test_an_exchange_gives_back_the_smallest_examples_first() -> None:
    # Capacity 100, costs s + s^2 / 100. Rank 0: 37 and 59 (144.50); rank 1: 28, 27, 13, 16
    # (103.38). The first even swaps the 37 for the 27 (128.10 against 119.78). Then no move
    # fits (6 free) and no swap helps, so the 27 goes into rank 1's bin, 21 tokens short,
    # which gives back its smallest examples until it fits: the 13 is not enough, so the 16
    # too (cost 33.25 for the 27's 34.29): 127.06 against 120.82.
    sizes = np.array([37, 59, 28, 27, 13, 16])
    costs = sequence_cost(sizes, 100.0)
    out = rebalance_examples([[0, 1], [2, 3, 4, 5]], sizes, costs, [[0], [1]], 100,
                             fill_rounds=0, evens_per_rank=1, partners=3)[0]
    assert out == [[1, 4, 5], [2, 0, 3]]
    assert max(_rank_costs(out, costs, [[0], [1]])) == pytest.approx(127.06)


def test_an_exchange_takes_back_no_more_than_the_examples_bin_can_hold() -> None:
    # Both bins full (capacity 100); costs s + s^2 / 100: rank 0 holds 70 and 30 (119 + 39 =
    # 158), rank 1 four 25s (125). The 70 into rank 1's bin would need three 25s back (75
    # tokens, cost 93.75: the ranks at 132.75 and 150.25), but the 70's bin keeps the 30 and
    # holds only 70 more. The 30 would need two 25s back, costlier than itself. Nothing fits.
    sizes = np.array([70, 30, 25, 25, 25, 25])
    costs = sequence_cost(sizes, 100.0)
    out = rebalance_examples([[0, 1], [2, 3, 4, 5]], sizes, costs, [[0], [1]], 100,
                             fill_rounds=4, evens_per_rank=1, partners=3)[0]
    assert out == [[0, 1], [2, 3, 4, 5]]


def test_a_full_bin_takes_nothing_and_a_single_example_stays() -> None:
    sizes = np.array([8, 2, 7])
    # Bin 1 is full (capacity 9 with 7 + 2): the 2 cannot join it; bin 0's 8 cannot leave.
    out = rebalance_examples([[0], [2]], sizes, sizes.astype(float), [[0], [1]], 9,
                             fill_rounds=4, evens_per_rank=1, partners=3)[0]
    assert out == [[0], [2]]


def test_every_bin_keeps_an_example() -> None:
    # Rank 0 holds two bins of one example each (cost 3 + 3), rank 1 two of cost 1 each.
    # Moving a 3 would empty its bin; swapping a 3 for a 1 evens the ranks at 4.
    sizes = np.array([3, 3, 1, 1])
    out = rebalance_examples([[0], [1], [2], [3]], sizes, sizes.astype(float), [[0, 1], [2, 3]],
                             10, fill_rounds=4, evens_per_rank=1, partners=3)[0]
    assert out == [[2], [1], [0], [3]]


def test_the_fill_leaves_each_bin_an_example() -> None:
    # Rank 0: bin 0 holds two examples of cost 2, bin 2 one of 10; rank 1: bin 1, cost 1.
    # The mean (7.5) would let both 2s go, but bin 0 keeps one; the 10 is alone.
    sizes = np.array([2, 2, 1, 10])
    out = rebalance_examples([[0, 1], [2], [3]], sizes, sizes.astype(float), [[0, 2], [1]],
                             100, fill_rounds=1, evens_per_rank=0, partners=3)[0]
    assert out == [[0], [2, 1], [3]]


def test_a_placeholder_bin_takes_nothing() -> None:
    # Rank 1's only bin with examples has room 2; its empty placeholder bin would take the 3.
    sizes = np.array([3, 3, 2, 4])
    out = rebalance_examples([[0, 1], [2], [], [3]], sizes, sizes.astype(float),
                             [[0, 1], [2, 3]], 6, fill_rounds=4, evens_per_rank=1, partners=3)[0]
    assert out == [[0, 1], [2], [], [3]]


def test_a_swap_keeps_both_bins_within_capacity_whatever_the_costs() -> None:
    # Costs need not grow with sizes (a caller's cost model): swapping the costly short
    # example for the fast rank's longer one would overfill bin 0 (room 1, the newcomer 2 longer).
    sizes = np.array([2, 6, 4])
    costs = np.array([5.0, 1.0, 1.0])
    out = rebalance_examples([[0, 1], [2]], sizes, costs, [[0], [1]], 9, fill_rounds=4,
                             evens_per_rank=1, partners=3)[0]
    assert out == [[0, 1], [2]]


def test_the_slowest_rank_tries_the_next_lightest_when_the_lightest_can_take_nothing() -> None:
    # Rank 1 is the lightest but its one bin is full (an example of size 10, cost 1); rank 2
    # has room. The slowest rank (0, cost 9) gives its 4 to rank 2: the slowest is then 7.
    sizes = np.array([5, 4, 10, 1])
    costs = np.array([5.0, 4.0, 1.0, 3.0])
    ranks = [[0], [1], [2]]
    out = rebalance_examples([[0, 1], [2], [3]], sizes, costs, ranks, 10, fill_rounds=4,
                             evens_per_rank=1, partners=3)[0]
    assert out == [[0], [2], [3, 1]]
    assert _rank_costs(out, costs, ranks) == [5.0, 1.0, 7.0]


def test_the_budget_and_one_rank_leave_the_bins_as_they_are() -> None:
    sizes = np.array([5, 4, 1])
    bins = [[0, 1], [2]]
    assert rebalance_examples(bins, sizes, sizes.astype(float), [[0], [1]], 10,
                              fill_rounds=0, evens_per_rank=0, partners=3)[0] == bins
    assert rebalance_examples(bins, sizes, sizes.astype(float), [[0, 1]], 10,
                              fill_rounds=4, evens_per_rank=1, partners=3)[0] == bins


def test_the_fill_moves_the_costliest_examples_down_to_the_mean() -> None:
    # Rank 0 costs 16 (7, 5, 3, 1 in one bin), rank 1 costs 2: the mean is 9, 7 to move. The 7
    # goes first; nothing is left to move, so one move evens them at 9.
    sizes = np.array([7, 5, 3, 1, 2])
    out = rebalance_examples([[0, 1, 2, 3], [4]], sizes, sizes.astype(float), [[0], [1]], 100,
                             fill_rounds=1, evens_per_rank=0, partners=3)[0]
    assert out == [[1, 2, 3], [4, 0]]
    # With rank 1's example costing nothing, 8 is to move: the 7 goes, the 5 and the 3 would
    # overshoot, the 1 fills it exactly.
    costs = np.array([7.0, 5.0, 3.0, 1.0, 0.0])
    out = rebalance_examples([[0, 1, 2, 3], [4]], sizes, costs, [[0], [1]], 100,
                             fill_rounds=1, evens_per_rank=0, partners=3)[0]
    assert out == [[1, 2], [4, 0, 3]]


@pytest.mark.parametrize("evens, heavy", [(0, 18.0), (1, 14.0), (2, 12.0), (5, 12.0)])
def test_the_evens_budget_counts_transfers_per_rank(evens: int, heavy: float) -> None:
    # Both bins full: only swaps help, each of a 3 for a 1 moving 2 of the 12 gap. Two ranks
    # with one even each make two swaps; evening them takes three, and then none helps.
    sizes = np.full(12, 2)
    costs = np.array([3.0] * 6 + [1.0] * 6)
    out = rebalance_examples([list(range(6)), list(range(6, 12))], sizes, costs, [[0], [1]], 12,
                             fill_rounds=4, evens_per_rank=evens, partners=3)[0]
    assert _rank_costs(out, costs, [[0], [1]])[0] == heavy


def test_every_rank_above_the_mean_fills_from_the_lightest_in_one_round() -> None:
    # Ranks 0 and 1 are heavy (6), 2 and 3 light (2): rank 0 gives its 2 to rank 2, then
    # rank 1, with rank 3 now the lightest, gives its 2 to rank 3; all four at 4.
    sizes = np.array([4, 2, 4, 2, 2, 2])
    bins = [[0, 1], [2, 3], [4], [5]]
    ranks = [[0], [1], [2], [3]]
    out = rebalance_examples(bins, sizes, sizes.astype(float), ranks, 10, fill_rounds=1,
                             evens_per_rank=0, partners=3)[0]
    assert _rank_costs(out, sizes.astype(float), ranks) == [4.0, 4.0, 4.0, 4.0]
    assert out == [[0], [2], [4, 1], [5, 3]]


def test_the_slowest_rank_tries_the_next_lightest_ranks_up_to_partners() -> None:
    # Costs are squares: rank 0 holds 4 + 49, rank 1 36, rank 2 only a placeholder (0), which
    # can take no transfer. With three partners the second lightest takes the 2 (cost 4);
    # with one, the slowest rank tries the placeholder rank alone and stops.
    sizes = np.array([2, 7, 6])
    costs = sizes.astype(float) ** 2
    bins, ranks = [[0, 1], [2], []], [[0], [1], [2]]
    three = rebalance_examples(bins, sizes, costs, ranks, 12, fill_rounds=0, evens_per_rank=1,
                               partners=3)[0]
    one = rebalance_examples(bins, sizes, costs, ranks, 12, fill_rounds=0, evens_per_rank=1,
                             partners=1)[0]
    assert three == [[1], [2, 0], []]
    assert one == [[0, 1], [2], []]


def test_a_move_is_sought_among_the_nearest_examples_each_side_of_the_ideal_cost() -> None:
    # Rank 0: bins 1 (examples 1 and 2) and 0 (example 0, alone, so it stays); rank 1: bin 2 and
    # a placeholder. The ideal move costs half the gap. Only the examples nearest that cost on
    # each side are tried (a wider search bought at most 0.03% of modeled run time held out:
    # benchmarks/results/bench_hand_out_budget.md).
    sizes = np.array([1, 7, 1, 7])
    bins, ranks = [[0], [1, 2], [3], []], [[1, 0], [2, 3]]
    nearest = np.array([1.0, 49.0, 0.99, 49.0])  # example 2 is next below the ideal: it moves
    assert rebalance_examples(bins, sizes, nearest, ranks, 12, fill_rounds=0, evens_per_rank=1,
                              partners=3)[0] == [[0], [1], [3, 2], []]
    second = sizes.astype(float) ** 2  # example 2 ties example 0, one place further: none moves
    assert rebalance_examples(bins, sizes, second, ranks, 12, fill_rounds=0, evens_per_rank=1,
                              partners=3)[0] == bins


def test_the_evens_see_the_loads_a_fill_left() -> None:
    # Costs are the sizes, capacity 10. Rank 0: bins 0 (7) and 2 (4 + 1), cost 12; rank 1:
    # bin 1 (1) and a placeholder. The fill moves the 4 into bin 1 (8 against 5). Then the 7
    # goes into bin 1, now holding 5 with room 5, which gives back its 1 and 4: 6 against 7.
    # The searches after that read bin 2 as the fill left it (1 token, room 9), not as before.
    sizes = np.array([7, 1, 4, 1])
    costs = sizes.astype(float)
    ranks = [[0, 2], [1, 3]]
    out = rebalance_examples([[0], [1], [2, 3], []], sizes, costs, ranks, 10, fill_rounds=1,
                             evens_per_rank=1, partners=3)[0]
    assert out == [[1, 2], [0], [3], []]
    assert _rank_costs(out, costs, ranks) == [6.0, 7.0]
