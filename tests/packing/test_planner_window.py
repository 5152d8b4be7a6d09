"""The step window at its seam: size range, drift, the epoch's tail and the run's end.

A walk through one epoch takes any size each window allows (hypothesis picks it), on epochs of
N = k x B + r examples with a small remainder r, so that the last steps meet every tail case:
the drift may have carried the stream past k x B before the tail. No step may be empty, no
example lost, and the drift must stay within +-v.
"""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import SequentialSampler

from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.packing.planner.window import (
    STEP_EPOCH_TAIL,
    STEP_NORMAL,
    STEP_RUN_FINAL,
    StepContext,
    Window,
    outward,
)

FAST = settings(max_examples=150, deadline=None)


@st.composite
def epochs(draw):
    """(B, v, N, steps in the run or None, a choice in [0, 1] per step)."""
    batch = draw(st.integers(2, 64))
    variation = draw(st.integers(0, max(0, batch // 4)))
    steps = draw(st.integers(1, 6))
    tail = draw(st.integers(0, 3))
    count = max(1, steps * batch + tail)
    per_epoch = -(-count // batch)
    run = draw(st.one_of(st.none(), st.integers(1, per_epoch + 1)))
    picks = draw(st.lists(st.sampled_from([0.0, 1.0, 0.5]) | st.floats(0, 1),
                          min_size=per_epoch, max_size=per_epoch))
    return batch, variation, count, run, picks


def walk(batch: int, v: int, count: int, run: int | None, picks: list[float]) -> list[tuple[StepContext, int]]:
    """One epoch: each step takes the size its pick points at within its window."""
    per_epoch = -(-count // batch)
    drift, remaining, taken = 0, count, []
    for j in range(per_epoch):
        steps_left_in_run = None if run is None else run - j
        if steps_left_in_run == 0:
            break
        context = StepContext(batch, v, drift, remaining, per_epoch - j, steps_left_in_run)
        lowest, highest, _ = context.window()
        size = lowest + round(picks[j] * (highest - lowest))
        taken.append((context, size))
        drift += size - batch
        remaining -= size
    return taken


@FAST
@given(epochs())
def test_no_step_is_empty_no_example_is_lost_and_the_drift_holds(epoch):
    batch, v, count, run, picks = epoch
    steps = walk(batch, v, count, run, picks)
    assert sum(size for _, size in steps) <= count
    for context, size in steps:
        lowest, highest, target = context.window()
        assert 1 <= lowest <= target <= highest <= context.remaining
        assert size >= 1
        # Every later step of the epoch keeps at least one example.
        assert context.remaining - size >= context.steps_left_in_epoch - 1
        if context.kind == STEP_NORMAL:
            drift = context.drift + size - batch
            # The drift stays within +-v, unless the epoch's end squeezes the window below B - v.
            assert abs(drift) <= v or highest < batch - v
            assert size <= batch + v
    last_context, last_size = steps[-1]
    if last_context.kind == STEP_EPOCH_TAIL:
        assert sum(size for _, size in steps) == count  # the tail takes what remains
    # The run's final step repays the drift, where the epoch leaves room for it.
    if (last_context.kind == STEP_RUN_FINAL
            and last_context.room() >= batch - last_context.drift):
        assert sum(size for _, size in steps) == len(steps) * batch


@settings(max_examples=60, deadline=None)
@given(st.integers(20, 96), st.sampled_from([0.05, 0.1, 0.2]), st.integers(1, 6), st.integers(0, 3),
       st.integers(1, 4), st.integers(0, 2**16))
def test_the_sampler_never_plans_an_empty_step_on_epoch_tails(batch, variation, steps, tail, dp, seed):
    # The whole planner on epochs of k x B + r: every step has examples, each example is
    # emitted exactly once, and |drift| <= v after every step before the tail.
    count = steps * batch + tail
    lengths = np.random.default_rng(seed).integers(1, 700, size=count)
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(count)), lengths, batch, dp, bin_capacity=1024,
        allowed_variation=variation)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = [b.plan for b in sampler]
    assert all(p.num_examples >= 1 for p in plans)
    assert sorted(i for p in plans for i in p.example_indices) == list(range(count))
    assert len(plans) == -(-count // batch)
    assert all(abs(p.drift) <= sampler.v for p in plans[:-1])


def test_worked_windows():
    # B = 64, v = 6: a normal step aims at B - drift within both windows.
    assert StepContext(64, 6, 0, 1000, 10).window() == Window(58, 70, 64)
    assert StepContext(64, 6, 4, 1000, 10).window() == Window(58, 66, 60)
    assert StepContext(64, 6, -6, 1000, 10).window() == Window(64, 70, 70)
    # Two steps left, 66 examples: the first may take at most 65, one stays for the tail.
    assert StepContext(64, 6, 0, 66, 2).window() == Window(58, 65, 64)
    # Two steps left, 3 examples (the drift carried the stream far): the cap squeezes to 2.
    assert StepContext(64, 6, 5, 3, 2).window() == Window(2, 2, 2)
    # The epoch's tail takes what remains; the run's final step repays the drift.
    assert StepContext(64, 6, 5, 3, 1).window() == Window(3, 3, 3)
    assert StepContext(64, 6, 5, 1000, 10, 1).window() == Window(59, 59, 59)
    assert StepContext(64, 6, 5, 1000, 10, 1).kind == STEP_RUN_FINAL


def test_outward_visits_the_window_once_nearest_first():
    assert list(outward(5, 3, 8)) == [5, 6, 4, 7, 3, 8]
    assert Window(3, 8, 5).sizes() == [5, 6, 4, 7, 3, 8]
    assert list(outward(3, 3, 3)) == [3]
