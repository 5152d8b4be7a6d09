"""The per-micro-batch cost (``microbatch_cost_tokens``): in bin costs, rank times, the bound,
the hand-out and the planner's choice between a more even and a shorter step."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from torch.utils.data import SequentialSampler

from megatron_packing import DPAlignedPackingBatchSampler
from megatron_packing.packing.balance import bin_costs, imbalance, sequence_cost
from megatron_packing.packing.planner.charge import MicrobatchCharge
from megatron_packing.packing.planner.padding import rank_padded
from megatron_packing.packing.rank_bound import slowest_rank_bound
from megatron_packing.packing.rebalance import rebalance_examples
from megatron_packing.packing.step_time import modeled_bin_costs, rank_times, step_times

from .test_rank_bound import hand_outs


def test_every_bin_a_placeholder_too_costs_the_micro_batch_cost():
    # k = 100: 100 tokens cost 200, 50 cost 75.
    lengths = [100, 50, 50]
    assert bin_costs([[0], [1, 2], []], lengths, 100.0).tolist() == [200.0, 150.0, 0.0]
    assert bin_costs([[0], [1, 2], []], lengths, 100.0, 30.0).tolist() == [230.0, 180.0, 30.0]
    with pytest.raises(ValueError, match="microbatch_cost must be >= 0"):
        bin_costs([[0]], lengths, 100.0, -1.0)


def test_a_worked_step_with_the_micro_batch_cost_and_full_rows():
    bins = [[100], [50, 50], [50], []]
    ranks = [[0, 3], [1, 2]]
    # 2 micro-batches per rank at 10 each on top of the sequences' 200 / 150 + 75.
    assert rank_times(bins, ranks, 100.0, microbatch_cost=10.0).tolist() == [220.0, 245.0]
    # Rows of 100: every bin's linear work is 100 whatever it holds (the placeholder too), so
    # rank 0 pays 100 + 100 (attention) + 100 and rank 1 100 + 50 + 100 + 25.
    assert modeled_bin_costs(bins, 100.0, row_tokens=100).tolist() == [200.0, 150.0, 125.0, 100.0]
    assert rank_times(bins, ranks, 100.0, microbatch_cost=10.0, row_tokens=100).tolist() == [
        320.0, 295.0]
    # A row never shorter than what it holds (an oversize example in a bin of its own).
    assert modeled_bin_costs([[150]], 100.0, row_tokens=100).tolist() == [150.0 + 225.0]
    times = step_times([(bins, ranks)], 100.0, microbatch_cost=10.0, capacity=100)
    assert times.slowest.tolist() == [245.0]
    assert times.bound is not None and times.bound[0] <= 245.0


@settings(max_examples=300, deadline=None)
@given(hand_outs())
def test_no_hand_out_is_faster_than_the_bound_with_a_micro_batch_cost_or_full_rows(h) -> None:
    lengths, per_rank = h["lengths"], h["per_rank"]
    costs = sequence_cost(lengths, h["constant"])
    attention = costs - lengths
    for m, rows in ((0.0, None), (37.5, None), (1000.0, None), (0.0, h["capacity"]),
                    (250.0, h["capacity"])):
        bound = slowest_rank_bound(lengths, h["sizes"], per_rank, h["dp"], h["capacity"],
                                   h["constant"], microbatch_cost=m, row_tokens=rows)
        slowest = 0.0
        for rank in h["ranks"]:
            time = per_rank * m
            for b in rank:
                held = [int(i) for i in h["bins"][b]]
                tokens = float(lengths[held].sum()) if held else 0.0
                time += (tokens if rows is None else max(rows, tokens)) + float(attention[held].sum())
            slowest = max(slowest, time)
        assert bound <= slowest * (1 + 1e-12) + 1e-9, (m, rows)
    plain = slowest_rank_bound(lengths, h["sizes"], per_rank, h["dp"], h["capacity"], h["constant"])
    charged = slowest_rank_bound(lengths, h["sizes"], per_rank, h["dp"], h["capacity"],
                                 h["constant"], microbatch_cost=40.0)
    assert charged == pytest.approx(plain + 40.0 * per_rank)


def test_moving_examples_keeps_the_bins_and_adds_the_cost_of_each_ranks_bins():
    # Costs are integers (exact in floats): the transfers compare differences, so the moves are
    # the same, and each rank's cost grows by m x its bins.
    bins = [[0, 1], [2], [3], [4, 5]]
    sizes = [5, 4, 1, 2, 3, 3]
    costs = [5.0, 4.0, 1.0, 2.0, 3.0, 3.0]
    ranks = [[0, 1], [2, 3]]
    options = dict(fill_rounds=4, evens_per_rank=1, partners=3)
    plain, plain_costs = rebalance_examples(bins, sizes, costs, ranks, 10, **options)
    charged, charged_costs = rebalance_examples(bins, sizes, costs, ranks, 10, **options,
                                                microbatch_cost=100.0)
    assert charged == plain
    assert charged_costs == [c + 200.0 for c in plain_costs]
    one = rebalance_examples(bins, sizes, costs, [[0, 1, 2, 3]], 10, **options, microbatch_cost=7.0)
    assert one[1] == [sum(costs) + 28.0]


def test_the_charge_is_the_micro_batches_beyond_the_tokens_rows():
    tokens = np.array([0, 100, 250, 400])
    charge = MicrobatchCharge(10.0, 2, 100, tokens)
    assert charge(1, 1) == pytest.approx(10.0 * (2 - 1.0))  # one bin rounds up to two rows
    assert charge(3, 4) == pytest.approx(0.0)  # four full rows
    assert charge(2, 3) == pytest.approx(10.0 * (4 - 2.5))


def test_a_padded_step_that_runs_fewer_micro_batches_wins_where_they_cost_enough():
    # dp 2, capacity 100. Size 10 packs into 4 bins (2 per rank, 300 tokens) and is nearest the
    # token load; size 11 packs into 5 (rounded to 6: 3 per rank, 340 tokens).
    packed = {10: [[0], [1], [2], [3]], 11: [[0], [1], [2], [3], [4]]}
    tokens = np.zeros(12)
    tokens[10], tokens[11] = 300.0, 340.0
    gaps = {10: 40.0, 11: 0.0}
    assert rank_padded(packed, 2, 11, gaps.__getitem__, 100.0, 0.0)[0] == 11
    cheap = MicrobatchCharge(5.0, 2, 100, tokens)  # 5 x 1 extra row - 5 x 0.4: 3 tokens
    assert rank_padded(packed, 2, 11, gaps.__getitem__, 100.0, 0.0, cheap)[0] == 11
    dear = MicrobatchCharge(500.0, 2, 100, tokens)
    assert rank_padded(packed, 2, 11, gaps.__getitem__, 100.0, 0.0, dear)[0] == 10


# A worked stream: capacity 100, dp 3, B = 20 and v = 2 (sizes 18-22), planned greedily
# (lookahead 1). The first 18 examples of 50 pair into 9 full bins (3 micro-batches per rank,
# 900 tokens); each 60 after them needs a bin of its own, so size 21 aligns at 12 bins (4 per
# rank, 1,080 tokens). The token load is B x the read-ahead's mean (22 examples, 1,140 tokens):
# 1,036.4, so size 21 is nearer (43.6 against 136.4 tokens) and wins when a micro-batch costs
# nothing. Its 12 rows hold 10.8 rows of tokens, 18's 9 hold 9: charged m per row beyond its
# tokens, 21 costs 1.2 m more, so from m = 92.7 / 1.2 = 77.3 the shorter step wins.
WORKED = [50] * 18 + [60] * 4 + [50] * 90 + [60] * 30


def _first_step(microbatch_cost: float):
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(WORKED))), WORKED, 20, 3, bin_capacity=100,
        allowed_variation=0.1, lookahead_steps=1, total_steps=5,
        microbatch_cost_tokens=microbatch_cost)
    return next(iter(sampler)).plan


@pytest.mark.parametrize("cost,examples,bins", [(0.0, 21, 12), (77.0, 21, 12), (78.0, 18, 9),
                                                (5000.0, 18, 9)])
def test_a_large_micro_batch_cost_makes_the_planner_take_the_shorter_step(cost, examples, bins):
    plan = _first_step(cost)
    assert (plan.num_examples, plan.num_bins, plan.aligned) == (examples, bins, True)
    assert all(len(rank) == bins // 3 for rank in plan.rank_bins)


def test_the_sampler_logs_its_imbalance_with_the_micro_batch_cost():
    lengths = np.random.default_rng(3).integers(1, 2048, size=400)
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, 64, 4, bin_capacity=2048,
        total_steps=4, microbatch_cost_tokens=3000.0)
    plan = next(iter(sampler)).plan
    positions = {index: p for p, index in enumerate(plan.example_indices)}
    bins = [[positions[i] for i in b] for b in plan.bins]
    step = lengths[list(plan.example_indices)]
    ranks = [list(r) for r in plan.rank_bins]
    charged = imbalance(bin_costs(bins, step, 24576.0, 3000.0), ranks)
    assert plan.dp_imbalance == pytest.approx(charged)
    assert charged < imbalance(bin_costs(bins, step, 24576.0), ranks)


def test_a_state_saved_with_another_micro_batch_cost_is_refused():
    def sampler(cost: float) -> DPAlignedPackingBatchSampler:
        return DPAlignedPackingBatchSampler(
            SequentialSampler(range(len(WORKED))), WORKED, 20, 3, bin_capacity=100,
            allowed_variation=0.1, total_steps=5, microbatch_cost_tokens=cost)

    saved = sampler(0.0)
    next(iter(saved))
    state = saved.state_dict()
    sampler(0.0).load_state_dict(state)
    with pytest.raises(ValueError, match=r"microbatch_cost_tokens: saved 0\.0, now 100\.0"):
        sampler(100.0).load_state_dict(state)
