"""`simulate` reports the modeled step time of the plans it made, computed from scratch here."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from torch.utils.data import SequentialSampler

from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.reports.simulation import simulate, simulate_exhaustive

K = 24576.0


def test_simulate_reports_the_slowest_rank_spread_of_its_plans():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 4096, size=64 * 12)
    result = simulate(lengths, batch_size=64, capacity=4096, dp_size=4, steps=10, align=True)
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, 64, 4, bin_capacity=4096,
        total_steps=10, oversize_policy="truncate")
    slowest, mean = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in sampler:
            plan = batch.plan
            ranks = [sum(int(lengths[i]) + int(lengths[i]) ** 2 / K
                         for b in rank for i in plan.bins[b]) for rank in plan.rank_bins]
            slowest.append(max(ranks))
            mean.append(sum(ranks) / len(ranks))
    assert result.step_time_cv == pytest.approx(np.std(slowest) / np.mean(slowest))
    assert result.step_time_imbalance == pytest.approx(np.mean(slowest) / np.mean(mean))
    assert result.step_time_imbalance > 1.0


def test_the_exhaustive_reference_is_timed_on_its_own_bins():
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 4096, size=64 * 12)
    run = simulate_exhaustive(lengths, batch_size=64, capacity=4096, dp_size=4, steps=10)
    assert 0.0 < run.step_time_cv < 1.0 and run.step_time_imbalance >= 1.0
