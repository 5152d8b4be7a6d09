"""Evened steps through the sampler: marked in the plan, in the step's metadata and its metric."""

from __future__ import annotations

import numpy as np
from torch.utils.data import SequentialSampler

from megatron_packing.loader.metrics import step_metrics
from megatron_packing.packed.collate import step_metadata
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler


def test_the_sampler_marks_evened_steps_and_their_metrics_say_so():
    # Short examples, capacity 2K, B 570 at dp 16: about 61 bins a step, none can fall to 48.
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 420, size=570 * 12)
    sampler = DPAlignedPackingBatchSampler(SequentialSampler(range(len(lengths))), lengths, 570,
                                           16, bin_capacity=2_048, total_steps=12)
    plans = [batch.plan for batch in sampler]
    evened = [p for p in plans if p.evened]
    assert evened and len(evened) < len(plans)
    for plan in plans:
        meta = step_metadata(plan)
        assert meta.evened == plan.evened
        assert step_metrics(meta)["train/evened"] == int(plan.evened)
    for plan in evened:
        assert plan.num_bins % 16 == 0 and plan.placeholder_bins == 0 and not plan.deferred
