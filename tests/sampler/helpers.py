"""Shared checks for sampler tests: run a sampler and verify DESIGN.md's invariants."""

from __future__ import annotations

import numpy as np

from megatron_packing.common.plan_types import StepPlan
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler


def run_epochs(sampler: DPAlignedPackingBatchSampler, epochs: int) -> list[list[StepPlan]]:
    """Iterate ``epochs`` epochs (stopping early at the run's horizon); plans per epoch."""
    out = []
    for _ in range(epochs):
        plans = [batch.plan for batch in sampler]
        if not plans:
            break
        out.append(plans)
    return out


def base_order(sampler: DPAlignedPackingBatchSampler, epoch: int) -> list[int]:
    """The base sampler's order for an epoch, read independently of the packing sampler."""
    base = sampler.order.sampler
    if hasattr(base, "set_epoch"):
        base.set_epoch(epoch)
    return [int(i) for i in base]


def check_plan_shape(plan: StepPlan, sampler: DPAlignedPackingBatchSampler) -> None:
    """Bins: a multiple of dp, equal per rank, every example once, footprints within capacity."""
    dp = sampler.dp_size
    assert plan.num_bins % dp == 0 and plan.num_bins >= dp
    assert [len(r) for r in plan.rank_bins] == [plan.num_bins // dp] * dp
    assert sorted(b for r in plan.rank_bins for b in r) == list(range(plan.num_bins))
    in_bins = sorted(i for b in plan.bins for i in b)
    assert in_bins == sorted(plan.example_indices)
    assert plan.placeholder_bins == sum(1 for b in plan.bins if not b)
    capacity = sampler.bin_capacity
    for b in plan.bins:
        if not b:
            continue
        footprint = sampler.alignment.footprint(sampler.effective_lengths[list(b)])
        own_bin = len(b) == 1 and sampler.padded_lengths[b[0]] > sampler.packer.usable_capacity
        assert footprint <= capacity or own_bin
    assert plan.num_tokens == int(np.sum(sampler.effective_lengths[list(plan.example_indices)]))
    if plan.aligned:
        assert plan.padding_bins == 0
    check_layouts(plan, sampler)


def check_layouts(plan: StepPlan, sampler: DPAlignedPackingBatchSampler) -> None:
    """Each bin's planned row, recomputed from the lengths: kept lengths, TP/CP-aligned
    segments (the last also takes the row's padding), a row on the per-bin multiple."""
    alignment, capacity = sampler.alignment, sampler.bin_capacity
    to_capacity = sampler.config.packer.pad_bins_to_capacity
    assert len(plan.layouts) == plan.num_bins
    for b, layout in zip(plan.bins, plan.layouts, strict=True):
        kept = [int(sampler.effective_lengths[i]) for i in b] or [1]  # a placeholder: 1 pad
        assert layout.real == tuple(kept)
        aligned = [alignment.padded_length(n) for n in kept]
        assert list(layout.segments[:-1]) == aligned[:-1]
        footprint = alignment.footprint(kept)
        assert layout.length == (max(footprint, capacity) if to_capacity else footprint)
        assert layout.segments[-1] == aligned[-1] + layout.length - sum(aligned)


def check_stream(sampler: DPAlignedPackingBatchSampler, epochs: list[list[StepPlan]],
                 first_epoch: int = 0) -> None:
    """Every DESIGN.md stream invariant over a run of whole epochs."""
    batch, v = sampler.batch_size, sampler.v
    total_steps = sampler.total_steps
    step = 0
    for e, plans in enumerate(epochs):
        epoch = first_epoch + e
        order = base_order(sampler, epoch)
        emitted = [i for p in plans for i in p.example_indices]
        run_ended = total_steps is not None and step + len(plans) >= total_steps
        if run_ended:
            assert emitted == order[: len(emitted)]  # contiguous runs of the base order
        else:
            assert emitted == order  # every example exactly once, in order
            assert len(plans) == sampler.steps_per_epoch
        drift = 0
        for j, plan in enumerate(plans):
            check_plan_shape(plan, sampler)
            assert plan.epoch == epoch and plan.step == step
            epoch_last = j == sampler.steps_per_epoch - 1
            drift += plan.num_examples - batch
            if not epoch_last:
                assert abs(plan.num_examples - batch) <= v
                assert abs(drift) <= v
                assert plan.drift == drift
            step += 1
            if total_steps is not None and step == total_steps and not epoch_last:
                assert drift == 0, "the run's final scheduled step repays the drift"
