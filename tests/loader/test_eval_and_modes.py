"""Eval mode, unaligned packing, padded mode and base-sampler checks of build_sft_dataloader."""

from __future__ import annotations

import numpy as np
import pytest
from sampler.synthetic import SyntheticSFT, mixed_lengths
from torchdata.stateful_dataloader import StatefulDataLoader

from megatron_packing.loader.dataloader import build_sft_dataloader
from megatron_packing.packed.collate import PackedBatch
from megatron_packing.padded.collate import PaddedBatch
from megatron_packing.padded.components import build_padded_components

from .streams import config, examples_of, record

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
DATASET = SyntheticSFT(mixed_lengths(155, seed=9, high=800))


def rank_streams(dp, **kwargs):
    """One epoch of every rank's loader, step by step."""
    cfg = kwargs.pop("cfg")
    loaders = [build_sft_dataloader(DATASET, cfg, dp_rank=r, dp_size=dp, seed=4, **kwargs)
               for r in range(dp)]
    return list(zip(*loaders, strict=True))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_eval_mode_uses_a_fixed_batch_in_sequential_order(dp):
    steps = rank_streams(dp, cfg=config(global_batch_size=20), eval_mode=True)
    assert len(steps) == 8  # 7 x 20 + 15
    start = 0
    for s, batches in enumerate(steps):
        meta = batches[0].meta
        assert all(record(b)[1] == record(batches[0])[1] for b in batches)
        assert meta.is_eval and meta.step == s
        size = 20 if s < 7 else 15
        assert meta.num_examples == size
        assert sorted(i for b in batches for i in examples_of(b)) == list(range(start, start + size))
        assert len({len(b) for b in batches}) == 1 and meta.num_bins % dp == 0
        start += size
    assert start == len(DATASET)


def test_unaligned_packing_keeps_every_step_at_b_and_pads_bins_to_dp():
    dp = 4
    steps = rank_streams(dp, cfg=config(global_batch_size=20, align_packing_bins_to_dp=False))
    sizes = [batches[0].meta.num_examples for batches in steps]
    assert sizes == [20] * 7 + [15]
    seen = []
    for batches in steps:
        meta = batches[0].meta
        assert meta.num_bins % dp == 0 and {len(b) for b in batches} == {meta.num_bins // dp}
        assert not meta.is_eval
        seen.extend(i for b in batches for i in examples_of(b))
    assert sorted(seen) == list(range(len(DATASET)))


def padded_records(batch):
    rows = tuple(None if mb is None else
                 (mb.tokens.numpy().tobytes(), mb.loss_mask.numpy().tobytes(), mb.example_indices)
                 for mb in batch.micro_batches)
    return rows, batch.meta.num_examples, batch.meta.step


def test_padded_mode_goes_through_build_sft_dataloader():
    budget = 2048
    cfg = config(use_sequence_packing=False, align_packing_bins_to_dp=False,
                 max_tokens_per_microbatch=budget, global_batch_size=24)
    dp = 2
    loaders = [build_sft_dataloader(DATASET, cfg, dp_rank=r, dp_size=dp, seed=4) for r in range(dp)]
    assert all(isinstance(loader, StatefulDataLoader) for loader in loaders)
    direct = []
    for r in range(dp):
        sampler, wrapped, collate = build_padded_components(DATASET, cfg, dp_rank=r, dp_size=dp,
                                                            seed=4)
        direct.append(StatefulDataLoader(wrapped, batch_sampler=sampler, collate_fn=collate))
    seen = []
    for batches, expected in zip(zip(*loaders, strict=True), zip(*direct, strict=True),
                                 strict=True):
        assert all(isinstance(b, PaddedBatch) and not isinstance(b, PackedBatch) for b in batches)
        assert [padded_records(b) for b in batches] == [padded_records(b) for b in expected]
        assert len({len(b) for b in batches}) == 1
        for b in batches:
            for mb in b.micro_batches:
                if mb is None:
                    continue
                rows, width = mb.tokens.shape
                assert rows * width <= budget or rows == 1
                seen.extend(mb.example_indices)
    assert sorted(seen) == list(range(len(DATASET)))


class NoLength:
    def __iter__(self):
        return iter(range(len(DATASET)))


def test_a_base_sampler_without_len_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"NoLength has no __len__.*epoch length"):
        build_sft_dataloader(DATASET, config(), dp_rank=0, dp_size=2, base_sampler=NoLength())


def test_a_custom_base_sampler_with_len_is_followed():
    order = list(np.random.default_rng(0).permutation(len(DATASET)))

    class Fixed:
        def __len__(self):
            return len(order)

        def __iter__(self):
            return iter(order)

    loader = build_sft_dataloader(DATASET, config(global_batch_size=20), dp_rank=0, dp_size=1,
                                  base_sampler=Fixed())
    start = 0
    for batch in loader:  # every step is the next contiguous run of the custom order
        size = batch.meta.num_examples
        assert sorted(examples_of(batch)) == sorted(order[start:start + size])
        start += size
    assert start == len(DATASET)
