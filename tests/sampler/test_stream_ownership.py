"""Iterators own their stream position; the sampler only remembers where the next one starts."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from torch.utils.data import SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from megatron_packing.config import PackingConfig
from megatron_packing.loader.dataloader import build_sft_dataloader
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.padded.sampler import TokenBudgetBatchSampler

from .synthetic import mixed_lengths

LENGTHS = mixed_lengths(200, seed=4, high=600)


def packed() -> DPAlignedPackingBatchSampler:
    return DPAlignedPackingBatchSampler(SequentialSampler(range(len(LENGTHS))), LENGTHS, 32, 4,
                                        bin_capacity=1024, allowed_variation=0.1)


def padded() -> TokenBudgetBatchSampler:
    return TokenBudgetBatchSampler(SequentialSampler(range(len(LENGTHS))), LENGTHS, 32, 4,
                                   dp_rank=1, max_tokens_per_microbatch=2048)


def steps(iterator, count):
    return [tuple(next(iterator)) for _ in range(count)]


@pytest.mark.parametrize("make", [packed, padded], ids=["packed", "padded"])
def test_two_iterators_do_not_move_each_other(make):
    sampler = make()
    first, second = iter(sampler), iter(sampler)
    from_first = steps(first, 3)
    assert steps(second, 3) == from_first  # the second starts at the stream's start too
    assert steps(first, 1) == steps(iter(make()), 4)[3:]  # and the first kept its own place


@pytest.mark.parametrize("make", [packed, padded], ids=["packed", "padded"])
def test_state_is_the_latest_iterators_and_a_finished_one_hands_its_place_on(make):
    sampler = make()
    iterator = iter(sampler)
    steps(iterator, 2)
    state = sampler.state_dict()
    assert state["step"] == 2
    rest = [tuple(s) for s in iterator]  # finishes the epoch
    resumed = make()
    resumed.load_state_dict(state)
    assert [tuple(s) for s in resumed] == rest
    assert next(iter(sampler)).plan.epoch == 1  # the next iter() begins the next epoch


def test_an_abandoned_iterator_leaves_the_next_one_at_the_last_finished_place():
    sampler = packed()
    whole_epoch = [tuple(s) for s in sampler]
    abandoned = iter(sampler)
    steps(abandoned, 2)  # a second epoch started, then dropped
    assert sampler.state_dict()["step"] == len(whole_epoch) + 2
    del abandoned
    sampler.set_epoch(1)  # a no-op: the next iterator starts epoch 1 from its beginning
    fresh = iter(sampler)
    assert next(fresh).plan.step == len(whole_epoch)


class Examples:
    def __init__(self, lengths):
        self.lengths = np.asarray(lengths)
        self.loss_token_counts = self.lengths - 1

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        return {"input_ids": np.arange(n) % 97 + 1, "loss_mask": np.ones(n, dtype=bool)}


def plain(value):
    """A state with tensors as lists, comparable with ==."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") else value


@pytest.mark.parametrize("resume_workers", [0, 1])
def test_loader_restore_leaves_the_saved_state_as_it_was(monkeypatch, resume_workers):
    config = PackingConfig.from_dict({"global_batch_size": 32, "bin_capacity": 1024,
                                      "align_packing_bins_to_dp": True,
                                      "packing_batch_size_allowed_variation": 0.1})
    dataset = Examples(LENGTHS)
    loader = build_sft_dataloader(dataset, config, dp_rank=0, dp_size=4)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    saved = copy.deepcopy(state)
    received = []
    original = StatefulDataLoader.load_state_dict
    monkeypatch.setattr(StatefulDataLoader, "load_state_dict",
                        lambda self, s: (received.append(s), original(self, s))[1])
    resumed = build_sft_dataloader(dataset, config, dp_rank=0, dp_size=4,
                                   num_workers=resume_workers)
    resumed.load_state_dict(state)
    assert plain(state) == plain(saved)  # nothing of torchdata's state is rewritten
    assert len(received) == 1
    if resume_workers == 0:
        assert received[0] is state  # torchdata's own restore, given the state as saved
    else:
        assert received[0] == {}  # the sampler holds the position; the loader starts fresh
    expected = [b.meta.step for b in iterator]
    assert [b.meta.step for b in resumed] == expected
