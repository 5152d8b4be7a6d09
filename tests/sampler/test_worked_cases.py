"""Worked examples of the DP-aligned sampler, small enough to check by hand."""

from __future__ import annotations

import pytest
from torch.utils.data import SequentialSampler

from megatron_packing.packed.collate import PackedCollator
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.stream.fetch import PlannedDataset

from .helpers import check_stream, run_epochs
from .synthetic import SyntheticSFT


def test_44_examples_of_300_tokens_give_sizes_22_18_4():
    # Three examples fill a 1000-token bin. Step 1: 20 examples need 7 bins (odd), 22 need 8.
    # Step 2 (target 18) needs 6 bins. The tail of 4 examples needs 2 bins.
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(44)), [300] * 44, 20, 2, bin_capacity=1000, allowed_variation=0.10
    )
    plans = [batch.plan for batch in sampler]
    assert [p.num_examples for p in plans] == [22, 18, 4]
    assert [p.num_bins for p in plans] == [8, 6, 2]
    assert all(p.aligned and p.padding_bins == 0 for p in plans)
    assert [p.drift for p in plans] == [2, 0, -16]  # the tail takes what remains
    check_stream(sampler, [plans])


def test_tail_shorter_than_dp_gets_placeholder_rows():
    # Five 3-token examples fit in one 16-token bin, fewer bins than 4 ranks: alignment is
    # hopeless, so the step keeps its target size 4 and the rows are spread one per rank.
    dataset = SyntheticSFT([3] * 5)
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(5)), [3] * 5, 4, 4, bin_capacity=16, allowed_variation=0.25,
        loss_token_counts=dataset.loss_token_counts,
    )
    with pytest.warns(UserWarning, match="fewer bins than the data-parallel size"):
        batches = list(sampler)
    plans = [b.plan for b in batches]
    assert [p.num_examples for p in plans] == [4, 1]
    assert [p.num_bins for p in plans] == [4, 4]
    assert [p.placeholder_bins for p in plans] == [0, 3]
    assert plans[0].hopeless

    collate = PackedCollator()
    tail = plans[1]
    rows_per_rank = []
    for rank in range(4):
        indices = tail.examples_of_rank(rank)
        fetched = PlannedDataset(dataset).__getitems__(_planned(indices, tail, rank))
        batch = collate(fetched)
        assert batch.meta.num_examples == 1 and batch.meta.num_loss_tokens == 2  # mask 0,1,1
        rows_per_rank.append(batch.micro_batches)
    assert [len(rows) for rows in rows_per_rank] == [1, 1, 1, 1]
    placeholders = [rows[0] for rows in rows_per_rank if rows[0].is_placeholder]
    assert len(placeholders) == 3
    for row in placeholders:
        assert row.tokens.shape == (1, 1) and row.loss_mask.sum() == 0 and row.example_indices == ()


def test_run_final_step_repays_drift_in_a_later_epoch():
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(44)), [300] * 44, 20, 2, bin_capacity=1000,
        allowed_variation=0.10, total_steps=5,
    )
    epochs = run_epochs(sampler, 3)
    sizes = [[p.num_examples for p in plans] for plans in epochs]
    # The run's last step falls in the second epoch, after a step of 22: it takes exactly
    # B - drift = 18 examples, so the five steps consume 5 x 20 - 4 (the first epoch's short tail).
    assert sizes == [[22, 18, 4], [22, 18]]
    assert epochs[1][-1].drift == 0
    assert list(sampler) == []  # the run is over
    check_stream(sampler, epochs)


def _planned(indices, plan, rank):
    from megatron_packing.packed.sampler import PlannedBatch

    return PlannedBatch(indices, plan, rank)
