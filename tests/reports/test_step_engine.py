"""The one step-simulation engine (`reports.steps.run_steps`) on a worked example, and both
simulations (the length pools' `simulate`, a YAML's `simulate_steps`) going through it.

The example: B = 4, dp = 2, capacity 1000, fixed B (no alignment), three steps in order:

- step 1: 600 600 300 300 -> bins {600, 300} {600, 300}: 2 bins, 1,800 tokens, fill 0.9, aligned;
- step 2: 700 700 700 100 -> the packer's 3 bins rounded up to 4 (one padding bin): each example
  alone, 2,200 tokens, fill 0.55, not aligned; ranks {700, 100} and {700, 700};
- step 3: 1200 400 300 100 -> 1200 truncated to 1000: bins {1000} {400, 300, 100}, 1,800 tokens,
  fill 0.9, aligned, one example truncated.

A sequence's modeled cost is s + s^2 / 24576 (the default attention constant); a rank's time is
its sequences' summed cost.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from torch.utils.data import SequentialSampler

from megatron_packing.config import PackingConfig
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.reports.config_simulation import simulate_steps
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream
from megatron_packing.reports.simulation import simulate
from megatron_packing.reports.steps import cv, run_steps

LENGTHS = [600, 600, 300, 300, 700, 700, 700, 100, 1200, 400, 300, 100]


def cost(*lengths: int) -> float:
    return sum(s + s * s / 24576 for s in lengths)


RANK_TIMES = [  # per step: each rank's modeled time
    (cost(600, 300), cost(600, 300)),  # 918.31 each
    (cost(700, 100), cost(700, 700)),  # 820.35 and 1439.88
    (cost(1000), cost(400, 300, 100)),  # 1040.69 and 810.58
]
SLOWEST = [max(r) for r in RANK_TIMES]
MEAN = [sum(r) / 2 for r in RANK_TIMES]
IMBALANCE = [s / m for s, m in zip(SLOWEST, MEAN, strict=True)]  # 1.0, 1.2741, 1.1243


def fixed_b_sampler() -> DPAlignedPackingBatchSampler:
    return DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(LENGTHS))), LENGTHS, 4, 2, bin_capacity=1000,
        allowed_variation=0.25, total_steps=3, align_to_dp=False, oversize_policy="truncate")


def test_the_engine_records_each_steps_plan_as_worked_out_by_hand():
    seen = []
    series = run_steps(fixed_b_sampler(), 3, label="fixed B", observe=seen.append)
    assert [plan.step for plan in seen] == [0, 1, 2]  # the observer sees every plan, in order
    assert series.label == "fixed B" and (series.bin_capacity, series.dp_size) == (1000, 2)
    assert series.batch_size.tolist() == [4, 4, 4]
    assert series.tokens.tolist() == [1800, 2200, 1800]
    assert series.bins.tolist() == [2, 4, 2]
    assert series.padding_bins.tolist() == [0, 1, 0]
    assert series.token_fill.tolist() == pytest.approx([0.9, 0.55, 0.9])
    assert series.aligned.tolist() == [True, False, True]
    assert series.truncated.tolist() == [0, 0, 1]
    assert series.deferred.tolist() == [0, 0, 0]
    assert series.slowest_rank.tolist() == pytest.approx(SLOWEST)
    assert series.mean_rank.tolist() == pytest.approx(MEAN)
    assert series.dp_imbalance.tolist() == pytest.approx(IMBALANCE)
    assert SLOWEST[1] == pytest.approx(1439.876302) and MEAN[2] == pytest.approx(925.634766)


def test_the_engines_totals_and_cv_are_the_hand_computed_ones():
    s = run_steps(fixed_b_sampler(), 3, label="fixed B").summary()
    assert (s["steps"], s["examples"], s["tokens"], s["bins"], s["padding_bins"]) == (
        3, 12, 5800, 8, 1)
    assert s["token_fill"] == pytest.approx(5800 / 8000)
    assert (s["aligned_steps"], s["aligned_fraction"]) == (2, pytest.approx(2 / 3))
    # tokens 1800, 2200, 1800: mean 5800 / 3, population std sqrt(320000 / 9)
    assert s["token_cv"] == pytest.approx((320000 / 9) ** 0.5 / (5800 / 3)) == pytest.approx(0.09753197)
    assert s["step_time_cv"] == pytest.approx(np.std(SLOWEST) / np.mean(SLOWEST))
    assert s["step_time_imbalance"] == pytest.approx(np.mean(SLOWEST) / np.mean(MEAN))
    assert (s["micro_batches_per_rank_min"], s["micro_batches_per_rank_max"]) == (1, 2)
    assert s["truncated_examples"] == 1


@pytest.mark.parametrize("values, expected", [
    ([1800, 2200, 1800], 0.09753197), ([5, 5], 0.0), ([], 0.0), ([0, 0], 0.0), ([1, 3], 0.5)])
def test_cv_is_the_population_std_over_the_mean(values, expected):
    assert cv(values) == pytest.approx(expected)


def test_the_pool_simulation_reports_the_engines_figures():
    result = simulate(np.asarray(LENGTHS), batch_size=4, capacity=1000, dp_size=2, steps=3,
                      align=False, variation=0.25)
    assert (result.label, result.steps, result.examples, result.bins, result.padding_bins,
            result.aligned_steps, result.min_batch, result.max_batch) == (
        "fixed B", 3, 12, 8, 1, 2, 4, 4)
    assert result.token_fill == pytest.approx(0.725)
    assert result.token_cv == pytest.approx(0.09753197)
    assert result.step_time_cv == pytest.approx(np.std(SLOWEST) / np.mean(SLOWEST))
    assert result.step_time_imbalance == pytest.approx(np.mean(SLOWEST) / np.mean(MEAN))
    # two bins per rank only in step 2, where round robin ({700, 700} vs {700, 100}) and the
    # balanced assignment give the same split; every other step has one bin per rank
    hand = np.mean(IMBALANCE)
    assert result.imbalance_round_robin == pytest.approx(hand)
    assert result.imbalance_balanced == pytest.approx(hand)
    assert result.packer_runs_mean == 1.0 and result.deferred_examples == 0


def test_the_config_simulation_runs_the_same_engine_to_the_same_series():
    packing = PackingConfig.from_dict({
        "global_batch_size": 4, "bin_capacity": 1000, "packing_batch_size_allowed_variation": 0.25,
        "oversize_policy": "truncate", "base_order": "sequential"})
    series = simulate_steps(np.asarray(LENGTHS), packing, 2, 3, align=False)
    direct = run_steps(fixed_b_sampler(), 3, label="fixed B")
    for column in ("batch_size", "tokens", "bins", "padding_bins", "aligned", "truncated"):
        assert getattr(series, column).tolist() == getattr(direct, column).tolist(), column
    assert series.slowest_rank.tolist() == pytest.approx(SLOWEST)
    assert series.summary()["token_cv"] == pytest.approx(0.09753197)


def test_the_pool_simulation_counts_the_examples_its_plans_deferred():
    lengths = mixed_stream(load_pools(find_pool_dir()), 64 * 20, 2048, seed=0)
    options = dict(bin_capacity=2048, allowed_variation=0.1, total_steps=20,
                   oversize_policy="truncate", max_deferred_examples=4)
    sampler = DPAlignedPackingBatchSampler(SequentialSampler(range(len(lengths))), lengths, 64,
                                           8, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deferred = sum(len(batch.plan.deferred) for batch in sampler)
    result = simulate(lengths, batch_size=64, capacity=2048, dp_size=8, steps=20, align=True,
                      variation=0.1, max_deferred_examples=4)
    assert result.deferred_examples == deferred > 0
