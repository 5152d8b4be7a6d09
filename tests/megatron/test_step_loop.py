"""The shared step loop at its seam: a recording host and a real `TrainStream` over fake steps.

Both training programs (the Megatron-LM entry point and the CPU demo) run `run_steps`; these
tests pin what the loop itself owns, in milliseconds: the order of a step's phases, accounting
in real examples, the checkpoint-first and abandon-step decisions, stopping, validation and
epoch rollover.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.common.plan_types import StepMetadata
from megatron_packing.megatron.step_loop import (
    LoopEnd,
    StepDone,
    StepHost,
    StepRecord,
    run_steps,
)
from megatron_packing.megatron.train_stream import EmptyEpoch, TrainStream


@dataclass
class FakeBatch:
    meta: StepMetadata
    micro_batches: list[Any]


def _meta(step: int, examples: int, bins: int) -> StepMetadata:
    return StepMetadata(step=step, epoch=0, num_examples=examples, num_tokens=10 * examples,
                        num_loss_tokens=5 * examples, num_bins=bins, num_padding_bins=0,
                        num_placeholder_bins=0, micro_batches_per_rank=bins, token_fill=1.0,
                        dp_imbalance=1.0, plan_ms=0.0, aligned=True)


class FakeLoader:
    """An epoch of steps with the given example counts (each step has 2 rows)."""

    def __init__(self, examples_per_step: list[int]) -> None:
        self.examples_per_step = examples_per_step
        self.epochs = 0

    def __iter__(self) -> Any:
        self.epochs += 1
        for i, n in enumerate(self.examples_per_step):
            yield FakeBatch(_meta(i, n, 2), [None, None])

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epochs = state["epochs"]


class RecordingHost(StepHost):
    def __init__(self, *, stop_at: int | None = None, exit_at: int | None = None,
                 checkpoint_at: int | None = None, eval_every: int = 0) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.records: list[StepRecord] = []
        self.stop_at, self.exit_at, self.checkpoint_at = stop_at, exit_at, checkpoint_at
        self.eval_every = eval_every

    def run_step(self, step: int, batch: Any) -> StepDone:
        self.events.append(("run", step, batch.meta.num_examples))
        return StepDone(loss=1.0, lr=0.1, grad_norm=2.0, compute_ms=1.0,
                        should_checkpoint=step == self.checkpoint_at,
                        should_exit=step == self.exit_at, exit_code=7 if step == self.exit_at else 0)

    def save(self, step: int) -> None:
        self.events.append(("save", step))

    def report(self, record: StepRecord) -> None:
        self.events.append(("report", record.step))
        self.records.append(record)

    def validation_due(self, step: int) -> bool:
        return bool(self.eval_every) and step % self.eval_every == 0

    def validate(self, step: int) -> None:
        self.events.append(("validate", step))

    def end_of_step(self, step: int, *, last: bool) -> bool:
        self.events.append(("end", step, last))
        return step == self.stop_at


def test_a_step_runs_then_is_counted_reported_validated_and_closed_in_that_order():
    host = RecordingHost(eval_every=2)
    result = run_steps(host, TrainStream(FakeLoader([3, 4, 5])), start=0, stop=3)
    assert result.end is LoopEnd.COMPLETED and result.step == 3
    assert host.events == [
        ("run", 0, 3), ("report", 1), ("end", 1, False),
        ("run", 1, 4), ("report", 2), ("validate", 2), ("end", 2, False),
        ("run", 2, 5), ("report", 3), ("end", 3, True),
    ]


def test_consumed_examples_are_real_examples_not_rows_or_steps():
    host = RecordingHost()
    stream = TrainStream(FakeLoader([3, 4, 5]))
    run_steps(host, stream, start=0, stop=3)
    assert [r.metrics["train/consumed_examples"] for r in host.records] == [3, 7, 12]
    assert [r.metrics["train/actual_batch_size"] for r in host.records] == [3, 4, 5]
    assert host.records[0].metrics["train/grad_norm"] == 2.0
    assert stream.counter.examples == 12 and stream.counter.steps == 3


def test_a_checkpoint_the_step_asks_for_is_saved_before_the_step_is_counted():
    host = RecordingHost(checkpoint_at=1)
    run_steps(host, TrainStream(FakeLoader([3, 4, 5])), start=0, stop=3)
    assert host.events.index(("save", 1)) == host.events.index(("run", 1, 4)) + 1
    assert host.events.index(("save", 1)) < host.events.index(("report", 2))


def test_an_abandoned_step_ends_the_loop_uncounted_with_its_exit_code():
    host = RecordingHost(exit_at=1)
    result = run_steps(host, TrainStream(FakeLoader([3, 4, 5])), start=0, stop=3)
    assert (result.end, result.step, result.exit_code) == (LoopEnd.EXITED, 1, 7)
    assert ("report", 2) not in host.events and [r.step for r in host.records] == [1]


def test_the_end_of_step_decision_stops_before_the_next_step_is_fetched():
    host = RecordingHost(stop_at=2)
    stream = TrainStream(FakeLoader([3, 4, 5, 6]))
    result = run_steps(host, stream, start=0, stop=4)
    assert (result.end, result.step) == (LoopEnd.STOPPED, 2)
    assert host.events[-1] == ("end", 2, False)
    assert stream.counter.examples == 7  # the third step was never fetched


def test_epochs_roll_over_and_an_empty_epoch_is_refused():
    loader = FakeLoader([3, 4])
    host = RecordingHost()
    run_steps(host, TrainStream(loader), start=0, stop=5)
    assert [e[2] for e in host.events if e[0] == "run"] == [3, 4, 3, 4, 3]
    assert loader.epochs == 3
    with pytest.raises(EmptyEpoch):
        run_steps(RecordingHost(), TrainStream(FakeLoader([])), start=0, stop=1)


def test_a_resumed_loop_numbers_steps_from_its_start():
    host = RecordingHost()
    result = run_steps(host, TrainStream(FakeLoader([3, 4, 5])), start=5, stop=7)
    assert [e[1] for e in host.events if e[0] == "run"] == [5, 6]
    assert [r.step for r in host.records] == [6, 7] and result.step == 7


class BudgetSpy:
    def __init__(self) -> None:
        self.boundaries: list[int] = []

    def step_boundary(self, step: int) -> None:
        self.boundaries.append(step)


def test_the_token_budget_is_agreed_before_each_step_is_fetched():
    spy = BudgetSpy()
    stream = TrainStream(FakeLoader([3, 4, 5]), budget=spy)  # type: ignore[arg-type]
    run_steps(RecordingHost(), stream, start=2, stop=5)
    assert spy.boundaries == [2, 3, 4]


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 9), min_size=1, max_size=6),
       steps=st.integers(1, 15), stop_at=st.one_of(st.none(), st.integers(1, 15)))
def test_every_step_run_is_reported_once_and_counted_once(counts, steps, stop_at):
    host = RecordingHost(stop_at=stop_at)
    stream = TrainStream(FakeLoader(counts))
    result = run_steps(host, stream, start=0, stop=steps)
    ran = [e for e in host.events if e[0] == "run"]
    assert [r.step for r in host.records] == list(range(1, len(ran) + 1))
    assert result.step == len(ran) == (min(steps, stop_at) if stop_at else steps)
    assert stream.counter.examples == sum(e[2] for e in ran)
    assert host.records[-1].metrics["train/consumed_examples"] == stream.counter.examples
    assert [e for e in host.events if e[0] == "end"][-1][2] == (result.step == steps)
