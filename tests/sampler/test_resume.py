"""Exact resume of the sampler from any saved state, with any base sampler."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import RandomSampler, SequentialSampler
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

from megatron_packing.packed.sampler import STATE_KEYS, DPAlignedPackingBatchSampler
from megatron_packing.stream.base_order import SeededRandomOrder

from .synthetic import mixed_lengths

LENGTHS = mixed_lengths(230, seed=3, high=700)


def make(base, **options):
    defaults = dict(bin_capacity=1024, allowed_variation=0.1, total_steps=None)
    defaults.update(options)
    return DPAlignedPackingBatchSampler(base, LENGTHS, 40, 4, **defaults)


def stream(sampler, epochs):
    out = []
    for _ in range(epochs):
        out.extend((b.plan.epoch, tuple(b.plan.bins), tuple(b.plan.rank_bins)) for b in sampler)
    return out


BASES = {
    "sequential": lambda: SequentialSampler(range(len(LENGTHS))),
    "seeded_order": lambda: SeededRandomOrder(len(LENGTHS), seed=5),
    "torch_random_with_generator": lambda: RandomSampler(
        range(len(LENGTHS)), generator=torch.Generator().manual_seed(11)),
    "torch_random_global_rng": lambda: RandomSampler(range(len(LENGTHS))),
    "torchdata_stateful_random": lambda: StatefulRandomSampler(
        range(len(LENGTHS)), generator=torch.Generator().manual_seed(13)),
}


@pytest.mark.parametrize("name", sorted(BASES))
def test_resume_at_every_step_of_a_multi_epoch_run_equals_the_uninterrupted_stream(name):
    torch.manual_seed(0)
    reference_sampler = make(BASES[name]())
    states, reference = [], []
    for _ in range(3):
        for batch in reference_sampler:
            reference.append((batch.plan.epoch, tuple(batch.plan.bins)))
            states.append(reference_sampler.state_dict())
    assert len({epoch for epoch, _ in reference}) == 3
    for done, state in enumerate(states[:-1], start=1):
        torch.manual_seed(1234)  # a different global RNG must not matter after a resume
        resumed = make(BASES[name]())
        resumed.load_state_dict(state)
        rest: list = []
        while done + len(rest) < len(reference):
            got = [(b.plan.epoch, tuple(b.plan.bins)) for b in resumed]
            assert got, "the resumed sampler stopped early"
            rest.extend(got)
        assert reference[:done] + rest[: len(reference) - done] == reference, (
            f"resume after {done} steps diverged ({name})"
        )


def test_several_resumes_in_a_row():
    # Resume after every single step, each time into a fresh sampler, across two epochs.
    reference = stream(make(SeededRandomOrder(len(LENGTHS), 2)), 2)
    sampler = make(SeededRandomOrder(len(LENGTHS), 2))
    got = []
    while len(got) < len(reference):
        batch = next(iter(sampler))
        got.append((batch.plan.epoch, tuple(batch.plan.bins), tuple(batch.plan.rank_bins)))
        state = sampler.state_dict()
        sampler = make(SeededRandomOrder(len(LENGTHS), 2))
        sampler.load_state_dict(state)
    assert got == reference


def test_state_dict_is_a_fresh_copy():
    sampler = make(SequentialSampler(range(len(LENGTHS))))
    iterator = iter(sampler)
    next(iterator)
    state = sampler.state_dict()
    frozen = repr(state)
    next(iterator)
    next(iterator)
    assert repr(state) == frozen


def test_mismatched_state_names_what_differs():
    sampler = make(SequentialSampler(range(len(LENGTHS))))
    next(iter(sampler))
    state = sampler.state_dict()
    other = DPAlignedPackingBatchSampler(SequentialSampler(range(len(LENGTHS))), LENGTHS, 40, 2,
                                         bin_capacity=2048, allowed_variation=0.1)
    with pytest.raises(ValueError, match="bin_capacity: saved 1024, now 2048"):
        other.load_state_dict(state)
    resized = DPAlignedPackingBatchSampler(SequentialSampler(range(len(LENGTHS))), LENGTHS, 40,
                                           2, bin_capacity=1024, allowed_variation=0.1)
    resized.load_state_dict(state)  # another dp size continues the global stream
    changed = LENGTHS.copy()
    changed[0] += 1
    other = DPAlignedPackingBatchSampler(SequentialSampler(range(len(LENGTHS))), changed, 40, 4,
                                         bin_capacity=1024, allowed_variation=0.1)
    with pytest.raises(ValueError, match=r"the examples' lengths \(sha256"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="format version"):
        sampler.load_state_dict(dict(state, version=99))


def test_extra_iter_does_not_shift_the_epoch_and_set_epoch_is_explicit():
    sampler = make(SeededRandomOrder(len(LENGTHS), 4))
    iter(sampler)
    iter(sampler)
    first = [tuple(b.plan.example_indices) for b in sampler]
    assert sampler.epoch == 0
    sampler.set_epoch(1)  # between epochs: allowed
    assert sampler.epoch == 1
    iterator = iter(sampler)
    next(iterator)
    with pytest.raises(ValueError, match="set_epoch"):
        sampler.set_epoch(3)
    sampler.set_epoch(1)  # same epoch: no-op
    again = make(SeededRandomOrder(len(LENGTHS), 4))
    assert [tuple(b.plan.example_indices) for b in again] == first
    again.set_epoch(1)
    second = [tuple(b.plan.example_indices) for b in again]
    assert sorted(i for s in second for i in s) == list(range(len(LENGTHS)))
    assert second != first  # reshuffled for the new epoch


def _steps(sampler, stop_after=None):
    """Plans until the run ends (an iteration that yields nothing), or ``stop_after`` of them."""
    out = []
    while True:
        got_any = False
        for batch in sampler:
            got_any = True
            out.append((batch.plan.epoch, tuple(batch.plan.bins), tuple(batch.plan.rank_bins)))
            if stop_after is not None and len(out) == stop_after:
                return out
        if not got_any:
            return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 25), st.integers(1, 6), st.booleans())
def test_resume_from_any_step_property(stop_after, dp, random_order):
    n = len(LENGTHS)

    def build():
        base = SeededRandomOrder(n, 9) if random_order else SequentialSampler(range(n))
        return DPAlignedPackingBatchSampler(base, LENGTHS, 30, dp, bin_capacity=900,
                                            allowed_variation=0.2, total_steps=19)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = _steps(build())
        first = build()
        got = _steps(first, stop_after=stop_after) if stop_after else []
        resumed = build()
        resumed.load_state_dict(first.state_dict())
        got += _steps(resumed)
    assert len(reference) == 19
    assert got == reference


@pytest.mark.parametrize("pad_bins_to_capacity", [False, True])
def test_row_layouts_are_rebuilt_on_resume_not_saved(pad_bins_to_capacity):
    """The plan's row layouts derive from the lengths: the state does not grow with them, and a
    resumed sampler plans the same rows."""
    reference = make(SequentialSampler(range(len(LENGTHS))), tp_size=2, cp_size=2,
                     pad_bins_to_capacity=pad_bins_to_capacity)
    batches = iter(reference)
    next(batches)
    state = reference.state_dict()
    assert set(state) == set(STATE_KEYS)
    assert b"RowLayout" not in pickle.dumps(state)
    rest = [b.plan.layouts for b in batches]
    resumed = make(SequentialSampler(range(len(LENGTHS))), tp_size=2, cp_size=2,
                   pad_bins_to_capacity=pad_bins_to_capacity)
    resumed.load_state_dict(state)
    assert [b.plan.layouts for b in resumed] == rest
    assert all(layout.length == 1024 for step in rest for layout in step) == pad_bins_to_capacity
