"""Resuming at another data-parallel size: the saved global stream continues, planned at the new
size, and every example of the epoch is trained exactly once across both runs."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_packing.packed.components import build_packing_sampler

from .streams import BATCH, DATASET, config, examples_of, make_loader, record

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
V = int(BATCH * 0.1)  # the window of `streams.config`: every dp <= B - v is allowed


def global_steps(loaders, steps: int | None = None):
    """The next ``steps`` steps (all, by default) of one epoch, read from every rank's loader:
    per step, each rank's examples."""
    iterators = [iter(loader) for loader in loaders]
    out = []
    while steps is None or len(out) < steps:
        try:
            batches = [next(iterator) for iterator in iterators]
        except StopIteration:
            break
        assert len({len(b.micro_batches) for b in batches}) == 1  # the same count on every rank
        out.append([examples_of(b) for b in batches])
    return out, iterators


def saved_mid_epoch(dp: int, done: int, workers: int = 0):
    """``done`` steps of an epoch at size ``dp``: their examples and each rank's loader state."""
    loaders = [make_loader(dp_rank=r, dp_size=dp, num_workers=workers) for r in range(dp)]
    head, live = global_steps(loaders, done)
    for loader, iterator in zip(loaders, live, strict=True):
        loader.live = iterator  # the epoch's iterator, to read on from
    return head, [loader.state_dict() for loader in loaders], loaders


def resumed(states, dp_new: int, workers: int = 0):
    """The rest of the epoch at size ``dp_new``, every rank from DP rank 0's global part."""
    loaders = [make_loader(dp_rank=r, dp_size=dp_new, num_workers=workers)
               for r in range(dp_new)]
    for loader in loaders:
        loader.load_stream_state(states[0])
    return loaders


def flat(steps) -> list[int]:
    return [i for step in steps for rank in step for i in rank]


@pytest.mark.parametrize(("dp", "dp_new"), [(4, 2), (2, 4), (4, 3), (3, 2)])
def test_the_epoch_is_trained_exactly_once_across_a_resize(dp, dp_new):
    head, _, loaders = saved_mid_epoch(dp, 2)
    part = loaders[1].stream_state()  # any rank's global part: they are the same
    assert repr(part) == repr(loaders[0].stream_state()) and part["dp_size"] == dp
    tail, _ = global_steps(resumed([part], dp_new))
    assert all(len(step) == dp_new for step in tail)
    assert sorted(flat(head) + flat(tail)) == list(range(len(DATASET)))


def test_the_resumed_steps_are_a_fresh_sampler_at_the_new_size_from_the_saved_state():
    _, _, loaders = saved_mid_epoch(4, 2)
    part = loaders[0].stream_state()
    tail, _ = global_steps(resumed([part], 2))
    # The plan of a global sampler at size 2 loaded with the saved sampler state.
    fresh = build_packing_sampler(DATASET, config(), dp_rank=None, dp_size=2, seed=11)
    fresh.load_state_dict(part["sampler"])
    plans = [batch.plan for batch in fresh]
    assert len(plans) == len(tail)
    for plan, step in zip(plans, tail, strict=True):
        assert [plan.examples_of_rank(r) for r in range(2)] == step
    assert plans[0].dp_size == 2 and plans[0].step == 2


def test_a_rank_loader_state_loads_at_another_size_where_no_step_lags_its_snapshot():
    head, states, _ = saved_mid_epoch(2, 3)
    loaders = [make_loader(dp_rank=r, dp_size=4) for r in range(4)]
    for loader in loaders:
        loader.load_state_dict(states[1])  # a rank's own state, not the global part
    tail, _ = global_steps(loaders)
    assert sorted(flat(head) + flat(tail)) == list(range(len(DATASET)))


def test_the_same_size_resumes_exactly_through_the_global_part_too():
    _, _, loaders = saved_mid_epoch(2, 2)
    expect = [[record(b) for b in loader.live] for loader in loaders]
    _, _, again = saved_mid_epoch(2, 2)
    parts = [make_loader(dp_rank=r, dp_size=2) for r in range(2)]
    for loader in parts:
        loader.load_stream_state(again[0].stream_state())
    assert [[record(b) for b in loader] for loader in parts] == expect


def test_a_global_part_of_another_setup_is_refused_naming_the_field():
    _, _, loaders = saved_mid_epoch(2, 1)
    other = make_loader(dp_size=4, global_batch_size=BATCH + 2)
    with pytest.raises(ValueError, match=f"batch_size: saved {BATCH}, now {BATCH + 2}"):
        other.load_stream_state(loaders[0].stream_state())
    with pytest.raises(ValueError, match="not the global part of a loader state"):
        other.load_stream_state(loaders[0].state_dict())
    part = {**loaders[0].stream_state(), "version": 0}
    with pytest.raises(ValueError, match="format version 0"):
        make_loader(dp_size=4).load_stream_state(part)


def test_a_size_outside_the_window_is_refused_when_the_loader_is_built():
    from megatron_packing.config import ConfigError

    with pytest.raises(ConfigError, match="smaller than the data-parallel size"):
        make_loader(dp_size=BATCH - V + 1)


def global_sampler(dp: int):
    return build_packing_sampler(DATASET, config(), dp_rank=None, dp_size=dp, seed=11)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dp=st.integers(1, 6), dp_new=st.integers(1, BATCH - V), done=st.integers(0, 6))
def test_any_mid_epoch_state_and_any_allowed_size_cover_the_epoch_once(dp, dp_new, done):
    saving = global_sampler(dp)
    steps = iter(saving)
    head = [list(next(steps)) for _ in range(done)]
    resumed_sampler = global_sampler(dp_new)
    resumed_sampler.load_state_dict(saving.state_dict())
    tail_steps = list(resumed_sampler)
    assert all(step.plan.dp_size == dp_new for step in tail_steps)
    tail = [list(step) for step in tail_steps]
    if done == len(saving):  # saved at the epoch's end: the next iteration is the next epoch
        assert sorted(sum(head, [])) == sorted(sum(tail, [])) == list(range(len(DATASET)))
    else:
        assert sorted(sum(head, []) + sum(tail, [])) == list(range(len(DATASET)))


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dp=st.integers(1, 4), dp_new=st.integers(1, 4), done=st.integers(1, 6),
       workers_new=st.sampled_from([0, 2]))
def test_with_two_workers_any_state_and_size_cover_the_epoch_once(dp, dp_new, done,
                                                                 workers_new):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        head, _, loaders = saved_mid_epoch(dp, done, workers=2)
        part = loaders[0].stream_state()
        assert part["num_workers"] == 2
        tail, _ = global_steps(resumed([part], dp_new, workers=workers_new))
    if len(head) == len(loaders[0]):  # saved at the epoch's end: the next epoch follows
        assert sorted(flat(tail)) == list(range(len(DATASET)))
    else:
        assert sorted(flat(head) + flat(tail)) == list(range(len(DATASET)))


@pytest.mark.parametrize("layout", [dict(tp_size=2), dict(tp_size=2, cp_size=2)])
def test_a_tensor_or_context_parallel_change_continues_the_stream(layout):
    """TP and CP decide how rows align, not what the stream holds: the rest of the epoch is
    planned under the new alignment, each example once; FP8 stays part of the setup."""
    head, _, loaders = saved_mid_epoch(2, 2)
    part = loaders[0].stream_state()
    resized = [make_loader(dp_rank=r, dp_size=2, **layout) for r in range(2)]
    for loader in resized:
        loader.load_stream_state(part)
    tail, _ = global_steps(resized)
    assert sorted(flat(head) + flat(tail)) == list(range(len(DATASET)))
    with pytest.raises(ValueError, match="tp_size, cp_size, fp8_enabled, fp8_recipe: saved"):
        make_loader(dp_size=2, fp8_enabled=True).load_stream_state(part)
