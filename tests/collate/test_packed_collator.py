"""PackedCollator: THD rows worked by hand and checked as properties against the raw examples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sampler.synthetic import SyntheticSFT
from torch.utils.data import SequentialSampler

from megatron_packing.common.plan_types import StepPlan
from megatron_packing.config import PackingConfig
from megatron_packing.packed.collate import PackedCollator
from megatron_packing.packed.components import build_packing_sampler
from megatron_packing.packed.layout import RowPlanner
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler, PlannedBatch
from megatron_packing.packing.alignment import make_alignment
from megatron_packing.stream.fetch import PlannedDataset

PAD = 0
pytestmark = pytest.mark.filterwarnings("ignore:a step of about")


class ListSFT:
    """Examples given as explicit (input_ids, loss_mask) pairs."""

    def __init__(self, examples):
        self.examples = [(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8))
                         for ids, mask in examples]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        ids, mask = self.examples[i]
        return {"input_ids": ids, "loss_mask": mask}


def hand_plan(dataset, bins, rank_bins, alignment, capacity=4096, pad_to_capacity=False,
              dp_size=1, truncated=None, num_loss_tokens=None):
    """A `StepPlan` written out by hand; its rows laid out as the sampler lays them out."""
    indices = tuple(i for b in bins for i in b)
    kept = [dict(truncated or {}).get(i, len(dataset[i]["input_ids"])) for i in range(len(dataset))]
    rows = RowPlanner(alignment, capacity, pad_to_capacity=pad_to_capacity)
    return StepPlan(
        step=0, epoch=0, step_in_epoch=0, dp_size=dp_size, bin_capacity=capacity,
        example_indices=indices, bins=tuple(tuple(b) for b in bins),
        layouts=rows.rows(bins, kept, alignment.padded_lengths(kept).tolist()),
        rank_bins=tuple(tuple(r) for r in rank_bins), truncated=dict(truncated or {}),
        num_tokens=0, num_loss_tokens=num_loss_tokens, packed_bins=len(bins), padding_bins=0,
        placeholder_bins=sum(1 for b in bins if not b), aligned=True, hopeless=False,
        token_fill=0.0, dp_imbalance=1.0, plan_ms=0.0, drift=0,
    )


def collate(dataset, plan, rank, collator):
    indices = plan.examples_of_rank(rank) if rank is not None else list(plan.example_indices)
    fetched = PlannedDataset(dataset).__getitems__(PlannedBatch(indices, plan, rank))
    return collator(fetched)


def row_lists(mb):
    return {name: getattr(mb, name)[0].tolist()
            for name in ("tokens", "labels", "loss_mask", "position_ids")}


# ---------------------------------------------------------------------------- worked by hand
def test_two_sequences_without_alignment_worked_by_hand():
    ds = ListSFT([([11, 12, 13], [0, 1, 1]), ([21, 22], [1, 1])])
    plan = hand_plan(ds, [(0, 1)], [(0,)], make_alignment())
    batch = collate(ds, plan, 0, PackedCollator())
    (mb,) = batch.micro_batches
    assert row_lists(mb) == {
        "tokens": [11, 12, 13, 21, 22],
        "labels": [12, 13, PAD, 22, PAD],  # never the next sequence's first token
        "loss_mask": [1, 1, 0, 1, 0],  # labels[t] is trained iff mask[t + 1]
        "position_ids": [0, 1, 2, 0, 1],
    }
    assert mb.cu_seqlens.tolist() == [0, 3, 5] and mb.cu_seqlens.dtype == torch.int32
    assert mb.cu_seqlens_padded.tolist() == [0, 3, 5] and mb.cu_seqlens_padded.dtype == torch.int32
    assert mb.max_seqlen == 3
    assert mb.example_indices == (0, 1) and not mb.is_placeholder
    assert mb.num_tokens == 5 and mb.num_loss_tokens == 3


def test_context_parallel_pads_every_sequence_to_2_tp_cp():
    alignment = make_alignment(tp_size=2, cp_size=2)
    assert (alignment.seq_multiple, alignment.bin_multiple) == (8, 8)
    ds = ListSFT([([5, 6, 7], [1, 1, 1]), (list(range(30, 40)), [0] * 5 + [1] * 5)])
    (mb,) = collate(ds, hand_plan(ds, [(0, 1)], [(0,)], alignment, 64), 0,
                    PackedCollator()).micro_batches
    assert mb.cu_seqlens.tolist() == [0, 3, 13]
    assert mb.cu_seqlens_padded.tolist() == [0, 8, 24]
    assert mb.tokens.shape == (1, 24) and mb.max_seqlen == 16
    row = row_lists(mb)
    assert row["tokens"][:8] == [5, 6, 7] + [PAD] * 5
    assert row["tokens"][8:18] == list(range(30, 40)) and row["tokens"][18:] == [PAD] * 6
    assert row["labels"][:3] == [6, 7, PAD] and row["labels"][8:18] == list(range(31, 40)) + [PAD]
    assert row["loss_mask"] == [1, 1] + [0] * 6 + [0] * 4 + [1] * 5 + [0] * 7
    assert row["position_ids"] == list(range(8)) + list(range(16))


def test_fp8_bin_padding_is_paid_once_by_the_last_segment():
    alignment = make_alignment(tp_size=2, cp_size=1, fp8_enabled=True)
    assert (alignment.seq_multiple, alignment.bin_multiple) == (1, 32)  # lcm(tp, 16 x tp x cp)
    ds = ListSFT([([1] * 5, [1] * 5), ([2] * 7, [1] * 7), ([3] * 4, [1] * 4)])
    (mb,) = collate(ds, hand_plan(ds, [(0, 1, 2)], [(0,)], alignment, 64), 0,
                    PackedCollator()).micro_batches
    assert mb.cu_seqlens.tolist() == [0, 5, 12, 16]
    assert mb.cu_seqlens_padded.tolist() == [0, 5, 12, 32]  # only the last segment grows
    assert mb.max_seqlen == 20
    assert mb.position_ids[0].tolist() == list(range(5)) + list(range(7)) + list(range(20))
    assert mb.loss_mask.sum().item() == 4 + 6 + 3


def test_placeholder_row_is_a_valid_aligned_one_token_row_with_zero_loss():
    alignment = make_alignment(tp_size=2, cp_size=2, fp8_enabled=True)  # seq 8, bin lcm(8, 64)
    ds = ListSFT([([4, 5, 6], [1, 1, 1])])
    plan = hand_plan(ds, [(0,), ()], [(0,), (1,)], alignment, 128, dp_size=2)
    batch = collate(ds, plan, 1, PackedCollator())
    (mb,) = batch.micro_batches
    length = alignment.bin_multiple
    assert mb.is_placeholder and mb.example_indices == ()
    assert mb.tokens.shape == (1, length) and mb.tokens.dtype == torch.int64
    assert mb.cu_seqlens.tolist() == [0, 1] and mb.cu_seqlens_padded.tolist() == [0, length]
    assert mb.cu_seqlens.dtype == mb.cu_seqlens_padded.dtype == torch.int32
    assert mb.num_loss_tokens == 0 and mb.num_tokens == 0 and mb.max_seqlen == length
    assert mb.position_ids[0].tolist() == list(range(length))
    assert batch.meta.num_placeholder_bins == 1


def test_pad_bins_to_capacity_gives_rows_of_exactly_the_capacity():
    alignment = make_alignment(tp_size=2, cp_size=2)
    ds = ListSFT([([1] * 9, [1] * 9), ([2] * 3, [1] * 3)])
    plan = hand_plan(ds, [(0, 1), ()], [(0,), (1,)], alignment, 64, pad_to_capacity=True,
                     dp_size=2)
    collator = PackedCollator()
    (real,) = collate(ds, plan, 0, collator).micro_batches
    (placeholder,) = collate(ds, plan, 1, collator).micro_batches
    assert real.tokens.shape == placeholder.tokens.shape == (1, 64)
    assert real.cu_seqlens_padded.tolist() == [0, 16, 64]
    assert placeholder.cu_seqlens_padded.tolist() == [0, 64]


def test_pad_bins_to_capacity_needs_a_capacity_on_the_bin_multiple():
    """A row of C tokens must still divide by the per-bin multiple (tp=2 here)."""
    with pytest.raises(ValueError, match="bin_capacity=1023.*per-bin multiple 2"):
        DPAlignedPackingBatchSampler(range(4), [5] * 4, 2, 1, bin_capacity=1023, tp_size=2,
                                     pad_bins_to_capacity=True)
    with pytest.raises(ValueError, match="bin_capacity=1023.*use a multiple of 2, e.g. 1022"):
        PackingConfig(bin_capacity=1023, tp_size=2, pad_bins_to_capacity=True).validate()
    PackingConfig(bin_capacity=1023, tp_size=2).validate()  # unpadded rows use 1022 tokens


def test_collator_without_a_plan_is_rejected():
    with pytest.raises(TypeError, match="PlannedDataset"):
        PackedCollator()([{"input_ids": [1, 2]}])


# ---------------------------------------------------------------------------- properties
def check_row(mb, dataset, alignment, truncated, capacity, pad_to_capacity):
    """Every THD rule for one real row, checked against the raw examples."""
    tokens, labels = mb.tokens[0].numpy(), mb.labels[0].numpy()
    loss, positions = mb.loss_mask[0].numpy(), mb.position_ids[0].numpy()
    row_length = tokens.shape[0]
    assert mb.tokens.dtype == mb.labels.dtype == mb.position_ids.dtype == torch.int64
    assert mb.loss_mask.dtype == torch.float32
    assert mb.cu_seqlens.dtype == mb.cu_seqlens_padded.dtype == torch.int32
    cu, cu_padded = mb.cu_seqlens.tolist(), mb.cu_seqlens_padded.tolist()
    assert len(cu) == len(cu_padded) == len(mb.example_indices) + 1
    assert cu[0] == cu_padded[0] == 0 and cu_padded[-1] == row_length
    assert row_length % alignment.bin_multiple == 0
    kept = []
    segments = []
    last = len(mb.example_indices) - 1
    for i, index in enumerate(mb.example_indices):
        example = dataset[index]
        keep = truncated.get(index, len(example["input_ids"]))
        ids = np.asarray(example["input_ids"])[:keep]
        mask = np.asarray(example["loss_mask"], dtype=np.float32)[:keep]
        kept.append(keep)
        start, seg = cu_padded[i], cu_padded[i + 1] - cu_padded[i]
        segments.append(seg)
        assert cu[i + 1] - cu[i] == keep
        assert seg % alignment.seq_multiple == 0
        if i < last:
            assert seg == alignment.padded_length(keep)  # only the last segment grows
        else:
            assert seg >= alignment.padded_length(keep)
        np.testing.assert_array_equal(tokens[start:start + keep], ids)
        assert (tokens[start + keep:start + seg] == PAD).all()
        np.testing.assert_array_equal(labels[start:start + keep - 1], ids[1:])
        assert (labels[start + keep - 1:start + seg] == PAD).all()
        np.testing.assert_array_equal(loss[start:start + keep - 1], mask[1:])
        assert (loss[start + keep - 1:start + seg] == 0).all()
        np.testing.assert_array_equal(positions[start:start + seg], np.arange(seg))
    assert mb.max_seqlen == max(segments)
    footprint = alignment.footprint(kept)
    assert row_length == (max(footprint, capacity) if pad_to_capacity else footprint)
    if pad_to_capacity:
        assert row_length == capacity
    return sum(kept), int(loss.sum()), len(kept)


def check_step(dataset, plans_by_rank, alignment, capacity, pad_to_capacity):
    """Collate every rank's share; rows are valid and add up to the step's metadata."""
    collator = PackedCollator()
    metas, tokens, loss_tokens, examples, counts = [], 0, 0, [], set()
    for rank, plan in enumerate(plans_by_rank):
        batch = collate(dataset, plan, rank, collator)
        counts.add(len(batch))
        metas.append(dataclasses.replace(batch.meta, plan_ms=0.0))
        for mb in batch.micro_batches:
            if mb.is_placeholder:
                assert mb.num_loss_tokens == 0 and mb.example_indices == ()
                assert mb.cu_seqlens.tolist() == [0, 1]
                assert mb.cu_seqlens_padded.tolist() == [0, mb.tokens.shape[1]]
                assert mb.tokens.shape[1] % alignment.bin_multiple == 0
                assert mb.tokens.shape[1] == (capacity if pad_to_capacity else
                                              alignment.footprint([1]))
                continue
            n_tokens, n_loss, _ = check_row(mb, dataset, alignment, plan.truncated, capacity,
                                            pad_to_capacity)
            tokens += n_tokens
            loss_tokens += n_loss
            examples.extend(mb.example_indices)
    meta = metas[0]
    assert all(m == meta for m in metas), "metadata differs between ranks"
    assert len(counts) == 1 and counts.pop() == meta.micro_batches_per_rank
    assert sorted(examples) == sorted(plans_by_rank[0].example_indices)
    assert meta.num_examples == len(examples)
    assert meta.num_tokens == tokens
    assert meta.num_loss_tokens == loss_tokens
    return meta


SETUPS = st.sampled_from([
    (1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False), (2, 2, False), (1, 1, True),
    (2, 2, True),
])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(2, 300), min_size=4, max_size=40),
    setup=SETUPS,
    dp=st.sampled_from([1, 2, 3]),
    pad_to_capacity=st.booleans(),
    data=st.data(),
)
def test_rows_follow_the_thd_rules_and_add_up_to_the_metadata(lengths, setup, dp, pad_to_capacity,
                                                              data):
    tp, cp, fp8 = setup
    alignment = make_alignment(tp, cp, fp8)
    capacity = 512 - 512 % alignment.bin_multiple
    dataset = SyntheticSFT(lengths)
    batch = data.draw(st.integers(max(dp, 2), len(lengths)), label="batch_size")
    config = PackingConfig(global_batch_size=batch, bin_capacity=capacity,
                           align_packing_bins_to_dp=True,
                           packing_batch_size_allowed_variation=0.5, tp_size=tp, cp_size=cp,
                           fp8_enabled=fp8, base_order="sequential",
                           pad_bins_to_capacity=pad_to_capacity)
    samplers = [build_packing_sampler(dataset, config, dp_rank=r, dp_size=dp, seed=3)
                for r in range(dp)]
    for steps in zip(*samplers, strict=True):
        check_step(dataset, [s.plan for s in steps], alignment, capacity, pad_to_capacity)


class _AlternatingMaskSFT(SyntheticSFT):
    """Loss on every other token: a truncated example keeps some loss targets (one that keeps
    none is refused at fetch time, see tests/faults/test_data_faults.py)."""

    @staticmethod
    def _mask(n: int) -> np.ndarray:
        mask = np.zeros(n, dtype=np.uint8)
        mask[1::2] = 1
        return mask


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(2, 900), min_size=6, max_size=30),
    setup=SETUPS,
    dp=st.sampled_from([1, 2, 4]),
)
def test_truncated_rows_match_the_plans_loss_count(lengths, setup, dp):
    tp, cp, fp8 = setup
    alignment = make_alignment(tp, cp, fp8)
    capacity = 256
    dataset = _AlternatingMaskSFT(lengths)
    config = PackingConfig(global_batch_size=max(dp, 6), bin_capacity=capacity,
                           packing_batch_size_allowed_variation=0.5, tp_size=tp, cp_size=cp,
                           fp8_enabled=fp8, base_order="sequential", oversize_policy="truncate")
    samplers = [build_packing_sampler(dataset, config, dp_rank=r, dp_size=dp, seed=3)
                for r in range(dp)]
    limit = alignment.max_sequence_length(capacity)
    seen_truncated = {}
    for steps in zip(*samplers, strict=True):
        plans = [s.plan for s in steps]
        check_step(dataset, plans, alignment, capacity, False)
        seen_truncated.update(plans[0].truncated)
    expected = {i: limit for i, n in enumerate(lengths) if n > limit}
    assert seen_truncated == expected


def test_placeholder_rows_fill_ranks_when_a_step_has_too_few_examples():
    dataset = SyntheticSFT([20, 30, 40, 25, 35, 22])
    alignment = make_alignment(2, 2)
    samplers = [
        DPAlignedPackingBatchSampler(
            SequentialSampler(range(6)), dataset.lengths, 3, 8, bin_capacity=512,
            allowed_variation=0.5, tp_size=2, cp_size=2, dp_rank=r,
            loss_token_counts=dataset.loss_token_counts)
        for r in range(8)
    ]
    placeholders = 0
    for steps in zip(*samplers, strict=True):
        meta = check_step(dataset, [s.plan for s in steps], alignment, 512, False)
        placeholders += meta.num_placeholder_bins
        assert meta.num_bins == 8
    assert placeholders > 0


def test_a_step_shares_three_storages_so_worker_hand_off_stays_cheap():
    # Tensors cross loader worker processes one storage at a time: a step's rows are views of
    # three buffers (ids, loss mask, boundaries), however many rows and sequences it has.
    rng = np.random.default_rng(4)
    dataset = SyntheticSFT(rng.integers(8, 400, size=120))
    sampler = DPAlignedPackingBatchSampler(SequentialSampler(range(120)), dataset.lengths, 60, 2,
                                           bin_capacity=512, allowed_variation=0.1)
    plan = next(iter(sampler)).plan
    batch = PackedCollator()(
        PlannedDataset(dataset).__getitems__(PlannedBatch(plan.examples_of_rank(0), plan, 0)))
    assert len(batch.micro_batches) >= 3
    storages = {
        t.untyped_storage().data_ptr()
        for mb in batch.micro_batches
        for t in (mb.tokens, mb.labels, mb.position_ids, mb.loss_mask, mb.cu_seqlens,
                  mb.cu_seqlens_padded)
    }
    assert len(storages) == 3
