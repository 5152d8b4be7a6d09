"""`simulate` reports the modeled step time of the plans it made, computed from scratch here."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
from torch.utils.data import SequentialSampler

from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.packing.rank_bound import slowest_rank_bound
from megatron_packing.packing.tunables import DEFAULT_TUNABLES
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream
from megatron_packing.reports.simulation import simulate, simulate_exhaustive

K = 24576.0


def test_simulate_reports_the_slowest_rank_spread_of_its_plans():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 4096, size=64 * 12)
    result = simulate(lengths, batch_size=64, capacity=4096, dp_size=4, steps=10, align=True)
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, 64, 4, bin_capacity=4096,
        total_steps=10, oversize_policy="truncate")
    slowest, mean, bound = [], [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in sampler:
            plan = batch.plan
            ranks = [sum(int(lengths[i]) + int(lengths[i]) ** 2 / K
                         for b in rank for i in plan.bins[b]) for rank in plan.rank_bins]
            slowest.append(max(ranks))
            mean.append(sum(ranks) / len(ranks))
            taken = lengths[list(plan.example_indices)]
            bound.append(slowest_rank_bound(taken, taken, len(plan.bins) // 4, 4, 4096, K))
    assert result.step_time_cv == pytest.approx(np.std(slowest) / np.mean(slowest))
    assert result.step_time_imbalance == pytest.approx(np.mean(slowest) / np.mean(mean))
    assert result.step_time_imbalance > 1.0
    # The least imbalance these bins allow, whatever the hand-out: from the same plans.
    assert result.step_time_imbalance_bound == pytest.approx(np.mean(bound) / np.mean(mean))
    assert 1.0 - 1e-9 <= result.step_time_imbalance_bound <= result.step_time_imbalance


def test_the_exhaustive_reference_is_timed_on_its_own_bins():
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 4096, size=64 * 12)
    run = simulate_exhaustive(lengths, batch_size=64, capacity=4096, dp_size=4, steps=10)
    assert 0.0 < run.step_time_cv < 1.0 and run.step_time_imbalance >= 1.0
    assert run.step_time_imbalance_bound is not None
    assert 1.0 - 1e-9 <= run.step_time_imbalance_bound <= run.step_time_imbalance


def test_the_sampler_hands_out_again_the_steps_its_moves_left_uneven():
    # Long documents at B 256 / 32K / dp 16: full bins and a few long sequences leave the
    # slowest rank above the mean after one pass of moves; the retry (on by default) hands
    # those steps out again. The plans keep their examples and bins; only the hand-out moves.
    pools = load_pools(find_pool_dir())
    lengths = mixed_stream({n: pools[n] for n in ("leval_pairs", "lima")}, 256 * 10, 32768, seed=0)
    common = dict(batch_size=256, capacity=32768, dp_size=16, steps=10, align=True)
    once = simulate(lengths, tunables=replace(DEFAULT_TUNABLES, rebalance_retry_above=None),
                    **common)
    default = simulate(lengths, **common)
    assert (default.bins, default.examples, default.aligned_steps) == (
        once.bins, once.examples, once.aligned_steps)
    assert default.step_time_imbalance < once.step_time_imbalance - 0.005
    # The retry's partners are read: with 8 of the 16 ranks it finds little there.
    fewer = simulate(lengths, tunables=replace(DEFAULT_TUNABLES, rebalance_retry_partners=8),
                     **common)
    assert fewer.step_time_imbalance > default.step_time_imbalance + 0.005
