"""The plan lays out every row (`StepPlan.layouts`); the collator writes tokens where it says.

The THD outputs must be bit-identical to those of the collator that computed the layout itself
(the digests below were recorded with it), the collator's boundaries must be the plan's, and an
example whose length changed after planning must be refused, not silently re-laid out.
"""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sampler.synthetic import SyntheticSFT, mixed_lengths
from torch.utils.data import SequentialSampler

from megatron_packing.config import PackingConfig
from megatron_packing.packed.collate import PackedCollator
from megatron_packing.packed.components import build_packed_components, build_packing_sampler
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler, PlannedBatch
from megatron_packing.stream.fetch import FetchedExampleError, PlannedDataset

pytestmark = pytest.mark.filterwarnings("ignore:a step of about")

# Recorded with the collator that laid out each row itself (before plans carried layouts), when
# whole bins went to ranks: `thd_digest` keeps `rank_assignment: karmarkar_karp` for them.
RECORDED = {
    "tp2 cp2 truncate": ({"tp_size": 2, "cp_size": 2, "oversize_policy": "truncate"},
                         "bad93f3f509644ca463d9d09f8644ad0"),
    "tp2 fp8 to capacity": ({"tp_size": 2, "fp8_enabled": True, "oversize_policy": "truncate",
                             "pad_bins_to_capacity": True}, "df07981cc467295b7be0a7dd208e056d"),
    "tp4 cp2 own_bin": ({"tp_size": 4, "cp_size": 2, "oversize_policy": "own_bin"},
                        "868370f9559ce381cf9d1a1d32cb33b6"),
    "plain truncate": ({"oversize_policy": "truncate"}, "441c34eaf690e9951095a716a75da3a2"),
}


def thd_digest(keys: dict, dp: int = 4) -> tuple[str, dict[str, int]]:
    """Every tensor and field of every rank's rows over a run (98 examples up to 1,400 tokens,
    capacity 1,024: truncated or own-bin examples, and placeholder rows at the tail)."""
    dataset = SyntheticSFT(mixed_lengths(98, seed=5, low=4, high=1400))
    config = PackingConfig(global_batch_size=24, bin_capacity=1024, align_packing_bins_to_dp=True,
                           packing_batch_size_allowed_variation=0.25, base_order="sequential",
                           rank_assignment="karmarkar_karp", **keys)
    digest = hashlib.sha256()
    seen = {"rows": 0, "placeholders": 0, "truncated": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rank in range(dp):
            sampler, wrapper, collator = build_packed_components(dataset, config, dp_rank=rank,
                                                                 dp_size=dp, seed=1)
            for step in sampler:
                seen["truncated"] += len(step.plan.truncated) if rank == 0 else 0
                for mb in collator(wrapper.__getitems__(step)).micro_batches:
                    seen["rows"] += 1
                    seen["placeholders"] += mb.is_placeholder
                    for t in (mb.tokens, mb.labels, mb.loss_mask, mb.position_ids, mb.cu_seqlens,
                              mb.cu_seqlens_padded):
                        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
                        digest.update(t.numpy().tobytes())
                    digest.update(repr((mb.max_seqlen, mb.example_indices,
                                        mb.is_placeholder)).encode())
    return digest.hexdigest()[:32], seen


@pytest.mark.parametrize("name", list(RECORDED))
def test_thd_rows_are_bit_identical_to_the_recorded_ones(name):
    keys, recorded = RECORDED[name]
    digest, seen = thd_digest(keys)
    assert seen["placeholders"] > 0 and seen["rows"] == 32  # the run covers what it claims
    assert (seen["truncated"] > 0) == (keys["oversize_policy"] == "truncate")
    assert digest == recorded


def test_worked_step_with_tp_cp_alignment_and_truncation():
    # tp=2, cp=2: every sequence rounds up to 8 tokens, rows to 8. Example 1 (70 tokens) is cut
    # to the capacity, 64; the bins are (1,), (4,), (0,), (2, 3), two per rank.
    dataset = SyntheticSFT([3, 70, 10, 13, 30])
    expected = {  # bin: (cu_seqlens, cu_seqlens_padded), as the old collator made them
        False: {(1,): ([0, 64], [0, 64]), (0,): ([0, 3], [0, 8]), (4,): ([0, 30], [0, 32]),
                (2, 3): ([0, 10, 23], [0, 16, 32])},
        True: {(1,): ([0, 64], [0, 64]), (0,): ([0, 3], [0, 64]), (4,): ([0, 30], [0, 64]),
               (2, 3): ([0, 10, 23], [0, 16, 64])},
    }
    for pad_to_capacity, rows in expected.items():
        sampler = DPAlignedPackingBatchSampler(
            SequentialSampler(range(5)), dataset.lengths, 5, 2, bin_capacity=64,
            allowed_variation=0.25, tp_size=2, cp_size=2, oversize_policy="truncate",
            pad_bins_to_capacity=pad_to_capacity, loss_token_counts=dataset.loss_token_counts)
        (step,) = list(sampler)
        plan = step.plan
        assert plan.bins == ((1,), (4,), (0,), (2, 3)) and plan.truncated == {1: 64}
        got = {}
        for rank in range(2):
            fetched = PlannedDataset(dataset).__getitems__(
                PlannedBatch(plan.examples_of_rank(rank), plan, rank))
            for mb in PackedCollator()(fetched).micro_batches:
                got[mb.example_indices] = (mb.cu_seqlens.tolist(), mb.cu_seqlens_padded.tolist())
                assert mb.tokens.shape[1] == mb.cu_seqlens_padded[-1]
        assert got == rows
        truncated_row = plan.layouts[plan.bins.index((1,))]
        assert truncated_row.real == (64,) and truncated_row.length == 64


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(2, 700), min_size=4, max_size=40),
    setup=st.sampled_from([(1, 1, False), (2, 1, True), (2, 2, False), (4, 2, False),
                           (2, 2, True)]),
    dp=st.sampled_from([1, 2, 3]),
    pad_to_capacity=st.booleans(),
    oversize=st.sampled_from(["truncate", "own_bin"]),
    data=st.data(),
)
def test_the_collators_boundaries_are_the_plans_layout(lengths, setup, dp, pad_to_capacity,
                                                       oversize, data):
    tp, cp, fp8 = setup
    dataset = SyntheticSFT(lengths)
    config = PackingConfig(global_batch_size=data.draw(st.integers(max(dp, 2), len(lengths))),
                           bin_capacity=512, align_packing_bins_to_dp=True,
                           packing_batch_size_allowed_variation=0.5, tp_size=tp, cp_size=cp,
                           fp8_enabled=fp8, base_order="sequential", oversize_policy=oversize,
                           pad_bins_to_capacity=pad_to_capacity)
    rank = data.draw(st.sampled_from([None, *range(dp)]), label="rank")
    sampler = build_packing_sampler(dataset, config, dp_rank=rank, dp_size=dp, seed=3)
    for step in sampler:
        plan = step.plan
        bins = range(plan.num_bins) if rank is None else plan.rank_bins[rank]
        batch = PackedCollator()(PlannedDataset(dataset).__getitems__(step))
        assert len(batch.micro_batches) == len(bins)
        for b, mb in zip(bins, batch.micro_batches, strict=True):
            layout = plan.layouts[b]
            assert mb.cu_seqlens_padded.tolist() == [0, *np.cumsum(layout.segments).tolist()]
            assert mb.cu_seqlens.tolist() == [0, *np.cumsum(layout.real).tolist()]
            assert mb.tokens.shape == (1, layout.length) and mb.max_seqlen == max(layout.segments)
            assert mb.example_indices == plan.bins[b]


class Changeable:
    """Examples without a length index (nothing checks them at fetch time), editable later."""

    def __init__(self, lengths):
        self.examples = [SyntheticSFT(lengths)[i] for i in range(len(lengths))]

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        return self.examples[i]


def planned_step(lengths, **options):
    sampler = DPAlignedPackingBatchSampler(SequentialSampler(range(len(lengths))), lengths,
                                           len(lengths), 1, bin_capacity=64,
                                           allowed_variation=0.5, **options)
    return next(iter(sampler))


@pytest.mark.parametrize("new_length", [9, 11])
def test_an_example_whose_length_changed_after_planning_is_refused(new_length):
    lengths = [10, 20, 30]
    dataset = Changeable(lengths)
    step = planned_step(lengths)
    dataset.examples[1] = SyntheticSFT([new_length])[0]
    with pytest.raises(FetchedExampleError, match=rf"dataset example 1: the step's plan laid out "
                       rf"20 tokens.*but {new_length} tokens were fetched"):
        PackedCollator()(PlannedDataset(dataset).__getitems__(step))


def test_a_truncated_example_must_still_hold_the_tokens_the_plan_keeps():
    lengths = [10, 90]
    dataset = Changeable(lengths)
    step = planned_step(lengths, oversize_policy="truncate")
    assert step.plan.truncated == {1: 64}
    dataset.examples[1] = SyntheticSFT([80])[0]  # still longer than what is kept: same row
    PackedCollator()(PlannedDataset(dataset).__getitems__(step))
    dataset.examples[1] = SyntheticSFT([50])[0]
    with pytest.raises(FetchedExampleError, match=r"dataset example 1: the step's plan laid out "
                       r"the first 64 of its tokens.*but 50 tokens were fetched"):
        PackedCollator()(PlannedDataset(dataset).__getitems__(step))
