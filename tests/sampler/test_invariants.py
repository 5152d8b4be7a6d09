"""Property tests: DESIGN.md's stream invariants over random lengths, B, dp, variation, capacity."""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import SequentialSampler

from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.stream.base_order import SeededRandomOrder

from .helpers import check_stream, run_epochs

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def scenarios(draw):
    capacity = draw(st.sampled_from([64, 100, 256, 1000]))
    n = draw(st.integers(1, 160))
    lengths = draw(st.lists(st.integers(1, capacity), min_size=n, max_size=n))
    batch = draw(st.integers(2, 40))
    variation = draw(st.sampled_from([0.05, 0.1, 0.25, 0.5]))
    variation = max(variation, 1.0 / batch + 1e-6)
    v = int(np.floor(batch * variation + 1e-9))
    dp = draw(st.integers(1, max(1, min(8, batch - v))))
    total_steps = draw(st.one_of(st.none(), st.integers(1, 12)))
    random_order = draw(st.booleans())
    seed = draw(st.integers(0, 3))
    rank_assignment = draw(st.sampled_from(["karmarkar_karp", "rebalanced", "round_robin"]))
    return dict(capacity=capacity, lengths=lengths, batch=batch, variation=variation, dp=dp,
                total_steps=total_steps, random_order=random_order, seed=seed,
                rank_assignment=rank_assignment)


def make(s, **overrides):
    n = len(s["lengths"])
    base = SeededRandomOrder(n, s["seed"]) if s["random_order"] else SequentialSampler(range(n))
    options = dict(bin_capacity=s["capacity"], allowed_variation=s["variation"],
                   total_steps=s["total_steps"], rank_assignment=s["rank_assignment"])
    options.update(overrides)
    return DPAlignedPackingBatchSampler(base, s["lengths"], s["batch"], s["dp"], **options)


@SETTINGS
@given(scenarios())
def test_stream_invariants_hold(s):
    sampler = make(s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        epochs = run_epochs(sampler, 3)
    check_stream(sampler, epochs)


@SETTINGS
@given(scenarios())
def test_fixed_step_run_consumes_exactly_steps_times_batch_without_epoch_tails(s):
    # With N a multiple of B there are no short tails, so a fixed-step run consumes exactly
    # total_steps x B examples: the drift is repaid by the final scheduled step.
    batch = s["batch"]
    n = max(batch, len(s["lengths"]) // batch * batch)
    s = dict(s, lengths=(s["lengths"] * (n // len(s["lengths"]) + 1))[:n], total_steps=7)
    sampler = make(s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        epochs = run_epochs(sampler, 10)
    assert sum(p.num_examples for plans in epochs for p in plans) == 7 * batch
    check_stream(sampler, epochs)


@SETTINGS
@given(scenarios())
def test_bins_divide_by_dp_whenever_some_size_in_the_window_allows_it(s):
    # An unlimited search must find an aligned size whenever one exists (natural packer count),
    # unless the step was evened at its floor, where no size of the window costs fewer bins.
    sampler = make(s, max_packs=None, total_steps=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plans = [b.plan for b in sampler]
    checker = make(s, max_packs=None, total_steps=None)
    order = [int(i) for i in checker.order.sampler]
    emitted, drift = 0, 0
    dp = sampler.dp_size
    for j, plan in enumerate(plans):
        ahead = order[emitted:]
        if plan.evened:
            # Not aligned on purpose: then no size of the window costs fewer bins.
            for size in _window(sampler, drift, len(ahead), len(plans) - j):
                count = len(sampler.packer.pack(sampler.effective_lengths[ahead[:size]]))
                assert max(dp, -(-count // dp) * dp) >= plan.num_bins, (
                    f"step {j} was evened at {plan.num_bins} bins, but size {size} packs "
                    f"into {count}")
        elif not (plan.aligned or plan.hopeless):
            for size in _window(sampler, drift, len(ahead), len(plans) - j):
                count = len(sampler.packer.pack(sampler.effective_lengths[ahead[:size]]))
                assert count % dp != 0 or count < dp, (
                    f"step {j}: size {size} packs into {count} bins, a multiple of dp, "
                    "but the step was not aligned"
                )
        emitted += plan.num_examples
        drift += plan.num_examples - sampler.batch_size


def _window(sampler, drift, remaining, steps_left):
    batch, v = sampler.batch_size, sampler.v
    if steps_left == 1:
        return [remaining]
    lowest = max(batch - v, batch - v - drift, 1)
    highest = min(batch + v, batch + v - drift, remaining - (steps_left - 1))
    return range(min(lowest, highest), highest + 1)
