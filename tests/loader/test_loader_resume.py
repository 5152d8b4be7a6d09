"""build_sft_dataloader: exact resume from any saved state, with and without workers."""

from __future__ import annotations

import warnings

import pytest

from megatron_packing.packed.components import build_packing_sampler

from .streams import BATCH, DATASET, config, epochs, examples_of, make_loader, record

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
EPOCHS = 3


def reference_with_states(**options):
    """An uninterrupted run of EPOCHS + 1 epochs, and the loader state after each of the first
    EPOCHS epochs' steps as (epoch, position in epoch, state)."""
    loader = make_loader(**options)
    reference, states = [], []
    for epoch in range(EPOCHS + 1):
        records = []
        for position, batch in enumerate(loader):
            records.append(record(batch))
            if epoch < EPOCHS:
                states.append((epoch, position, loader.state_dict()))
        reference.append(records)
    return reference, states


def expected_after(reference, epoch, position):
    """What the loader's next iterations yield after step ``position`` of ``epoch``."""
    rest = reference[epoch][position + 1:]
    if rest:
        return [rest, *reference[epoch + 1:]]
    return reference[epoch + 1:]  # at an epoch's end the next iteration is the next epoch


def check_resumes(reference, states, **options):
    for epoch, position, state in states:
        resumed = make_loader(**options)
        resumed.load_state_dict(state)
        expected = expected_after(reference, epoch, position)
        got = epochs(resumed, len(expected))
        assert got == expected, f"resume after epoch {epoch} step {position} diverged"


@pytest.mark.parametrize("dp_size", [2, 4])
def test_resume_after_every_step_equals_the_uninterrupted_run(dp_size):
    reference, states = reference_with_states(dp_size=dp_size, dp_rank=dp_size - 1)
    assert [len(e) for e in reference] == [6] * (EPOCHS + 1)
    assert len({r[1].epoch for e in reference for r in e}) == EPOCHS + 1
    check_resumes(reference, states, dp_size=dp_size, dp_rank=dp_size - 1)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_resume_after_every_step_with_workers(persistent):
    options = dict(dp_size=2, dp_rank=1, num_workers=2, persistent_workers=persistent)
    reference, states = reference_with_states(**options)
    serial, _ = reference_with_states(dp_size=2, dp_rank=1)
    assert reference == serial  # workers change nothing
    check_resumes(reference, states, **options)


@pytest.mark.parametrize(
    "options",
    [dict(), pytest.param(dict(num_workers=2), marks=pytest.mark.slow),
     pytest.param(dict(num_workers=2, persistent_workers=True), marks=pytest.mark.slow)],
    ids=["serial", "workers", "persistent_workers"],
)
def test_state_saved_after_an_epoch_loop_ended_resumes_into_the_next_epoch(options):
    """A state taken once the epoch's iterator is exhausted (the ``for`` loop is over)."""
    loader = make_loader(**options)
    reference, ended = [], []
    for _ in range(EPOCHS + 1):
        reference.append([record(b) for b in loader])
        ended.append(loader.state_dict())
    for epoch, state in enumerate(ended[:EPOCHS]):
        resumed = make_loader(**options)
        resumed.load_state_dict(state)
        assert epochs(resumed, EPOCHS - epoch) == reference[epoch + 1:]


@pytest.mark.parametrize("num_workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_several_resumes_in_a_row_give_the_uninterrupted_stream(num_workers):
    """A trainer-like loop (``iter`` again on StopIteration) that restarts at uneven points."""
    total = 6 * EPOCHS + 2
    reference = [r for e in epochs(make_loader(), EPOCHS + 1) for r in e][:total]
    stream, state = [], None
    for stop in (1, 5, 6, 7, 12, 17, total):  # includes a stop right at each epoch's end
        loader = make_loader(num_workers=num_workers)
        if state is not None:
            loader.load_state_dict(state)
        iterator = iter(loader)
        while len(stream) < stop:
            try:
                batch = next(iterator)
            except StopIteration:
                iterator = iter(loader)
                batch = next(iterator)
            stream.append(record(batch))
        state = loader.state_dict()
        del iterator, loader
    assert stream == reference


def test_every_rank_runs_the_same_micro_batches_and_ranks_partition_the_global_batch():
    dp = 4
    loaders = [make_loader(dp_rank=r, dp_size=dp) for r in range(dp)]
    plans = build_packing_sampler(DATASET, config(), dp_rank=None, dp_size=dp, seed=11)
    for _ in range(2):
        steps = list(zip(*loaders, strict=True))
        global_steps = list(plans)
        assert len(steps) == len(global_steps) == 6
        for batches, global_batch in zip(steps, global_steps, strict=True):
            plan = global_batch.plan
            metas = [record(b)[1] for b in batches]
            assert all(m == metas[0] for m in metas)
            assert {len(b) for b in batches} == {plan.micro_batches_per_rank}
            assert metas[0].num_bins == plan.num_bins and plan.num_bins % dp == 0
            shares = [examples_of(b) for b in batches]
            assert sorted(i for s in shares for i in s) == sorted(plan.example_indices)
            assert metas[0].num_examples == plan.num_examples == sum(map(len, shares))
            assert abs(plan.num_examples - BATCH) <= 3 or plan.step_in_epoch == 5


@pytest.mark.parametrize("total_steps", [4, 9])
def test_total_steps_stops_the_stream_and_the_last_step_repays_the_drift(total_steps):
    loader = make_loader(total_steps=total_steps)
    sizes = []
    for _ in range(3):
        sizes.extend((b.meta.epoch, b.meta.num_examples) for b in loader)
    assert len(sizes) == total_steps
    last_epoch = sizes[-1][0]
    in_last_epoch = [n for epoch, n in sizes if epoch == last_epoch]
    assert sum(in_last_epoch) == len(in_last_epoch) * BATCH
    assert [r for e in epochs(loader, 1) for r in e] == []  # nothing after the horizon


def test_total_steps_holds_across_a_resume():
    reference = [r for e in epochs(make_loader(total_steps=9), 3) for r in e]
    loader = make_loader(total_steps=9)
    iterator = iter(loader)
    head = [record(next(iterator)) for _ in range(3)]
    state = loader.state_dict()
    resumed = make_loader(total_steps=9)
    resumed.load_state_dict(state)
    tail = [r for e in epochs(resumed, 3) for r in e]
    assert head + tail == reference and len(reference) == 9


def test_a_state_from_another_setup_is_refused():
    loader = make_loader()
    next(iter(loader))
    state = loader.state_dict()
    other = make_loader(global_batch_size=BATCH + 2)
    with warnings.catch_warnings(), pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(state)
        next(iter(other))
