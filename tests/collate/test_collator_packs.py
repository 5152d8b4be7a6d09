"""A packed collator that packs on its own: given a plain list of examples and no plan, it packs
them with the same parts the sampler uses, rounds the bins to a multiple of dp with zero-loss
placeholder rows, and hands every rank as many bins."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sampler.synthetic import SyntheticSFT, mixed_lengths
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from megatron_packing.config import PackingConfig
from megatron_packing.packed.collate import PackedCollator
from megatron_packing.packed.components import build_packed_components
from megatron_packing.packing.factory import make_sft_sequence_packer
from megatron_packing.stream.fetch import PlannedDataset

pytestmark = pytest.mark.filterwarnings("ignore:a step of about")

DATASET = SyntheticSFT(mixed_lengths(90, seed=3, high=600))


def rows_of(batch) -> list[tuple]:
    """Every row's tensors as plain values (indices aside)."""
    return [(mb.tokens.tolist(), mb.labels.tolist(), mb.loss_mask.tolist(),
             mb.position_ids.tolist(), mb.cu_seqlens.tolist(), mb.cu_seqlens_padded.tolist(),
             mb.max_seqlen, mb.is_placeholder) for mb in batch.micro_batches]


@pytest.mark.parametrize("rank_assignment", ["karmarkar_karp", "round_robin"])
def test_the_same_examples_give_the_same_rows_where_the_plan_packs_them_alike(rank_assignment):
    """Whole bins to ranks (the plan's bins are then the packer's): on every step the planner
    packed as the collator's packer does, both paths write the same rows for every rank."""
    config = PackingConfig(global_batch_size=24, bin_capacity=1024, align_packing_bins_to_dp=True,
                           packing_batch_size_allowed_variation=0.125, base_order="sequential",
                           tp_size=2, oversize_policy="truncate", rank_assignment=rank_assignment)
    sampler, wrapper, planned = build_packed_components(DATASET, config, dp_rank=None, dp_size=2)
    packer = make_sft_sequence_packer(1024, 2, oversize_policy="truncate")
    compared = 0
    for step in sampler:
        plan = step.plan
        if packer.pack(DATASET.lengths[list(plan.example_indices)]) != [
                [plan.example_indices.index(i) for i in b] for b in plan.bins if b]:
            continue  # the planner packed this step otherwise (a repaired or rounded count)
        examples = [DATASET[i] for i in plan.example_indices]
        for rank in (None, 0, 1):
            own = PackedCollator(packing=config, dp_size=2, dp_rank=rank)(examples)
            via_plan = planned(PlannedDataset(DATASET).__getitems__(
                type(step)(step.indices, plan, rank) if rank is not None else step))
            assert rows_of(own) == rows_of(via_plan)
            assert [[plan.example_indices[p] for p in mb.example_indices]
                    for mb in own.micro_batches] == [list(mb.example_indices)
                                                     for mb in via_plan.micro_batches]
            assert own.meta.num_loss_tokens == via_plan.meta.num_loss_tokens
            assert own.meta.num_bins == via_plan.meta.num_bins
        compared += 1
    assert compared >= 2, "no step was packed alike: the comparison ran on nothing"


def test_with_a_dp_size_the_bins_divide_by_it_and_short_batches_get_placeholder_rows():
    config = PackingConfig(bin_capacity=256)
    examples = [{"input_ids": list(range(1, n + 1)), "loss_mask": [1] * n} for n in (30, 40, 50)]
    shares = [PackedCollator(packing=config, dp_size=4, dp_rank=r)(examples) for r in range(4)]
    assert [len(s.micro_batches) for s in shares] == [1, 1, 1, 1]
    placeholders = [mb for s in shares for mb in s.micro_batches if mb.is_placeholder]
    assert len(placeholders) == 1 and placeholders[0].loss_mask.sum() == 0
    assert sorted(i for s in shares for mb in s.micro_batches for i in mb.example_indices) == [
        0, 1, 2]
    meta = shares[0].meta
    assert (meta.num_bins, meta.num_placeholder_bins, meta.num_examples) == (4, 1, 3)
    assert meta.num_loss_tokens == 29 + 39 + 49
    whole = PackedCollator(packing=config)(examples)
    assert len(whole.micro_batches) == 1 and whole.meta.num_bins == 1


def test_the_oversize_policy_and_the_alignment_apply():
    examples = [{"input_ids": list(range(1, 301))}, {"input_ids": list(range(1, 11))}]
    config = PackingConfig(bin_capacity=256, tp_size=4, oversize_policy="truncate")
    batch = PackedCollator(packing=config)(examples)
    assert batch.meta.num_tokens == 256 + 10
    assert all(mb.tokens.shape[1] % 4 == 0 for mb in batch.micro_batches)
    assert batch.meta.num_loss_tokens == 255 + 9  # the truncated example trains its kept tokens
    with pytest.raises(ValueError, match="exceeds the usable bin capacity 256"):
        PackedCollator(packing=PackingConfig(bin_capacity=256))(examples)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(1, 8))
def test_any_batch_is_packed_whole_into_equal_counts_per_rank(lengths, dp):
    examples = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    config = PackingConfig(bin_capacity=512, tp_size=2)
    shares = [PackedCollator(packing=config, dp_size=dp, dp_rank=r)(examples) for r in range(dp)]
    assert len({len(s.micro_batches) for s in shares}) == 1
    assert shares[0].meta.num_bins % dp == 0
    seen = sorted(i for s in shares for mb in s.micro_batches for i in mb.example_indices)
    assert seen == list(range(len(lengths)))
    for share in shares:
        for mb in share.micro_batches:
            assert mb.tokens.shape[1] <= 512 and mb.tokens.shape[1] % 2 == 0
            assert mb.is_placeholder == (not mb.example_indices)
    assert shares[0].meta.num_loss_tokens == sum(n - 1 for n in lengths)


def test_a_plain_list_without_a_packing_config_or_of_non_mappings_is_refused():
    with pytest.raises(TypeError, match=r"got examples without a plan: build it with "
                                        r"PackedCollator\(packing=PackingConfig"):
        PackedCollator()([{"input_ids": [1, 2]}])
    with pytest.raises(TypeError, match="example 1 is a list without input_ids"):
        PackedCollator(packing=PackingConfig(bin_capacity=64))([{"input_ids": [1]}, [1, 2]])
    with pytest.raises(ValueError, match="dp_rank"):
        PackedCollator(packing=PackingConfig(bin_capacity=64), dp_size=2, dp_rank=2)


def test_a_plain_batch_sampler_feeds_the_collator_in_a_dataloader():
    config = PackingConfig(bin_capacity=1024, oversize_policy="truncate")
    loader = DataLoader(DATASET, batch_sampler=BatchSampler(SequentialSampler(DATASET), 16,
                                                            drop_last=False),
                        collate_fn=PackedCollator(packing=config, dp_size=2, dp_rank=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches = list(loader)
    assert len(batches) == 6
    assert all(b.meta.num_bins % 2 == 0 for b in batches)
    assert sum(b.meta.num_examples for b in batches) == len(DATASET)
    assert all(isinstance(mb.tokens, torch.Tensor) for b in batches for mb in b.micro_batches)
    assert np.all([b.meta.num_loss_tokens > 0 for b in batches])
