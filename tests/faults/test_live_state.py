"""A state loaded while an iterator is running applies to the next iterator and says so once;
it is never ignored without a word."""

from __future__ import annotations

import warnings

import pytest
from sampler.synthetic import SyntheticSFT, mixed_lengths
from torch.utils.data import SequentialSampler

from megatron_packing.config import PackingConfig
from megatron_packing.loader.dataloader import build_sft_dataloader
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.stream.step_stream import LiveIteratorWarning

DATASET = SyntheticSFT(mixed_lengths(80, seed=2, high=600))
CONFIG = PackingConfig(global_batch_size=16, bin_capacity=1024, align_packing_bins_to_dp=True,
                       packing_batch_size_allowed_variation=0.25)


def loader(**options):
    return build_sft_dataloader(DATASET, CONFIG, dp_rank=0, dp_size=2, seed=5, **options)


def first_examples(batch) -> list[int]:
    return [i for mb in batch.micro_batches for i in mb.example_indices]


@pytest.mark.parametrize("workers", [0, 2])
def test_loading_under_a_live_loader_iterator_applies_next_and_says_so_once(workers):
    start = loader().state_dict()
    live = loader(num_workers=workers)
    running = iter(live)
    first = first_examples(next(running))
    with pytest.warns(LiveIteratorWarning, match=r"applies from the next iter\(loader\)"):
        live.load_state_dict(start)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LiveIteratorWarning)
        live.load_state_dict(start)  # said once per loader
    assert first_examples(next(iter(live))) == first  # the next iterator reads the loaded state
    del running


def test_the_global_part_and_a_sampler_say_it_too():
    resized = loader()
    running = iter(resized)
    next(running)
    with pytest.warns(LiveIteratorWarning, match="load_stream_state while an iterator"):
        resized.load_stream_state(loader().stream_state())
    lengths = mixed_lengths(60, seed=1, high=300)
    sampler = DPAlignedPackingBatchSampler(SequentialSampler(range(60)), lengths, 8, 2,
                                           bin_capacity=512, allowed_variation=0.25)
    state = sampler.state_dict()
    steps = iter(sampler)
    taken = list(next(steps))
    with pytest.warns(LiveIteratorWarning, match=r"applies from the next iter\(sampler\)"):
        sampler.load_state_dict(state)
    assert list(next(steps)) != taken  # the running iterator keeps its own position
    assert list(next(iter(sampler))) == taken  # a new one reads the loaded state


def test_no_word_where_no_iterator_runs():
    quiet = loader()
    state = quiet.state_dict()  # makes an iterator for the state, which never ran
    with warnings.catch_warnings():
        warnings.simplefilter("error", LiveIteratorWarning)
        quiet.load_state_dict(state)
        done = loader()
        for _ in done:  # an iterator that ran to its end is not live
            pass
        done.load_state_dict(state)
