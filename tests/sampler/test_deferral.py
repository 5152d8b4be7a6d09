"""Bounded deferral (``max_deferred_examples``): a step that cannot align leaves a few examples
of its window to lead the next step. Nothing is dropped, nothing moves by more than one step,
and the stream invariants, the resume and the per-rank plans all still hold."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
from torch.utils.data import SequentialSampler

from megatron_packing.config import ConfigError, PackingConfig
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler

from .helpers import check_plan_shape
from .test_planner_quality import plans_of, pool_stream

BATCH, CAPACITY, DP, LIMIT = 128, 4096, 8, 8


def make(lengths, steps, **options):
    return DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, BATCH, DP, bin_capacity=CAPACITY,
        total_steps=steps, oversize_policy="truncate", max_deferred_examples=LIMIT, **options)


def check_deferred_stream(sampler, plans, lengths_count):
    """Every example once, in order or one step late; deferred examples lead the next step."""
    v = sampler.v
    seen = []
    position, drift = 0, 0
    carried: tuple[int, ...] = ()
    for j, plan in enumerate(plans):
        check_plan_shape(plan, sampler)
        indices = plan.example_indices
        assert indices[:len(carried)] == carried  # last step's deferred examples lead this one
        assert list(indices) == sorted(indices)  # still in base order
        assert len(plan.deferred) <= LIMIT and not set(plan.deferred) & set(carried)
        assert not set(plan.deferred) & set(indices)
        fresh = indices[len(carried):]
        consumed = fresh + plan.deferred
        assert sorted(consumed) == list(range(position, position + len(consumed)))  # contiguous
        position += len(consumed)
        seen.extend(indices)
        carried = plan.deferred
        drift += plan.num_examples - sampler.batch_size
        if j < len(plans) - 1:
            assert abs(plan.num_examples - sampler.batch_size) <= v and abs(drift) <= v
            assert plan.drift == drift
    assert carried == ()  # the last step leaves nothing behind
    assert sorted(seen) == list(range(len(seen))) and len(set(seen)) == len(seen)
    return seen


def test_deferral_aligns_nearly_every_step_with_fewer_bins_and_keeps_every_example():
    steps = 60
    lengths = pool_stream(BATCH * steps, CAPACITY)
    sampler = make(lengths, steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = [b.plan for b in sampler]
    _, contiguous = plans_of(lengths, BATCH, DP, CAPACITY, steps)
    seen = check_deferred_stream(sampler, plans, len(lengths))
    assert len(seen) == steps * BATCH  # the run consumed exactly steps x B: drift repaid, none lost
    assert sum(p.aligned for p in plans) >= 0.95 * steps
    assert sum(p.num_bins for p in plans) < sum(p.num_bins for p in contiguous)
    assert sum(len(p.deferred) for p in plans) > 0


def test_deferral_is_off_by_default_and_deferred_examples_end_an_epoch():
    lengths = pool_stream(BATCH * 12, CAPACITY)[: BATCH * 6 + 50]
    _, plain = plans_of(lengths, BATCH, DP, CAPACITY, None)
    assert all(p.deferred == () for p in plain)
    sampler = make(lengths, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        epochs = [[b.plan for b in sampler] for _ in range(2)]
    for plans in epochs:
        assert sorted(i for p in plans for i in p.example_indices) == list(range(len(lengths)))
        assert plans[-1].deferred == ()


def test_resume_with_deferred_examples_in_the_carry_is_exact():
    steps = 30
    lengths = pool_stream(BATCH * steps, CAPACITY)
    reference = make(lengths, steps)
    states, plans = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in reference:
            plans.append(batch.plan)
            states.append(reference.state_dict())
        cuts = [j for j, p in enumerate(plans[:-1]) if p.deferred][:2]
        assert cuts, "the stream must defer somewhere for this test to mean anything"
        for cut in cuts:
            assert states[cut]["deferred"] == len(plans[cut].deferred)
            resumed = make(lengths, steps)
            resumed.load_state_dict(states[cut])
            rest = [b.plan for b in resumed]
            assert [(p.example_indices, p.bins, p.rank_bins) for p in rest] == [
                (p.example_indices, p.bins, p.rank_bins) for p in plans[cut + 1:]]


def test_every_rank_plans_the_same_steps_and_the_ranks_cover_the_batch():
    steps = 12
    lengths = pool_stream(BATCH * steps, CAPACITY)
    per_rank = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rank in range(DP):
            per_rank.append(list(make(lengths, steps, dp_rank=rank)))
    for step in range(steps):
        plans = [replace(batches[step].plan, plan_ms=0.0) for batches in per_rank]  # timing aside
        assert all(p == plans[0] for p in plans)
        union = sorted(i for batches in per_rank for i in batches[step])
        assert union == sorted(plans[0].example_indices)


def test_the_deferral_key_is_in_the_fingerprint():
    lengths = pool_stream(BATCH * 4, CAPACITY)
    state = make(lengths, 4).state_dict()
    other = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, BATCH, DP, bin_capacity=CAPACITY,
        total_steps=4, oversize_policy="truncate")
    with pytest.raises(ValueError, match="max_deferred_examples: saved 8, now 0"):
        other.load_state_dict(state)


@pytest.mark.parametrize("value,message", [
    (-1, "max_deferred_examples must be an integer >= 0, got -1"),
    (1.5, "max_deferred_examples must be an integer >= 0, got 1.5"),
    (122, "must be below the smallest step size B - v = 122"),
])
def test_config_rejects_a_bad_deferral_limit(value, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        PackingConfig(global_batch_size=128, align_packing_bins_to_dp=True,
                      max_deferred_examples=value)


def test_config_deferral_needs_alignment():
    with pytest.raises(ConfigError, match="needs align_packing_bins_to_dp: true"):
        PackingConfig(global_batch_size=128, align_packing_bins_to_dp=False,
                      max_deferred_examples=4)
    assert PackingConfig(global_batch_size=128, align_packing_bins_to_dp=True,
                         max_deferred_examples=4).validate(8).max_deferred_examples == 4
