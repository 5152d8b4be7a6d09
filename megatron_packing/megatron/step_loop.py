"""The step loop, written once, that both hosts run: the Megatron-LM entry point and the CPU demo.

A packed SFT step differs from a fixed-batch step in three ways, and those are what this loop
owns: the step's micro-batch count comes from its plan (the host runs forward-backward at that
count), the run is accounted in real examples (the stream counts them from the plan), and the
loader's state is part of every checkpoint. Everything else is the host's, behind
`StepHost`: how a step is computed, how it is saved, where its metrics go, when validation is
due, and how the run decides to stop (the Megatron-LM host asks Megatron's own
``checkpoint_and_decide_exit``; the demo host agrees on a stop signal across its ranks).

One iteration, in order: the token budget is agreed for the step (padded mode), the step is
fetched, the host runs it; a step the host asks to checkpoint first is saved; a step the host
abandons ends the loop before anything is counted; otherwise the step is counted, reported,
validated when due, and the host's end-of-step decision (save, stop) closes it.
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from megatron_packing.loader.metrics import step_metrics
from megatron_packing.megatron.train_stream import TrainStream


@dataclass
class StepDone:
    """What a host's step reports back to the loop."""

    loss: float | None  # the global token-mean loss (None where this rank cannot know it)
    lr: float  # the learning rate the step trained with
    grad_norm: float | None = None
    compute_ms: float = 0.0  # forward, backward and the optimizer step
    should_checkpoint: bool = False  # save this step's state before anything else
    should_exit: bool = False  # abandon the run at this step (not counted, no final save)
    exit_code: int = 0
    detail: Any = None  # the host's own outcome, handed back to it in `StepRecord`


@dataclass
class StepRecord:
    """One finished step, as the loop hands it to the host's `StepHost.report`."""

    step: int  # steps done, this one included (Megatron's iteration number after the step)
    batch: Any
    done: StepDone
    metrics: dict[str, float] = field(default_factory=dict)
    data_ms: float = 0.0  # waiting for the loader
    step_ms: float = 0.0  # fetch, compute and the host's bookkeeping, up to the report


class LoopEnd(enum.Enum):
    """Why the loop returned."""

    COMPLETED = "completed"  # every step up to ``stop`` ran
    STOPPED = "stopped"  # the host's end-of-step decision stopped it (signal, exit flags)
    EXITED = "exited"  # the host abandoned a step (Megatron's rerun state machine)


@dataclass
class LoopResult:
    step: int  # steps done when the loop returned
    end: LoopEnd
    exit_code: int = 0


class StepHost(ABC):
    """What a training program supplies to `run_steps`."""

    @abstractmethod
    def run_step(self, step: int, batch: Any) -> StepDone:
        """Forward-backward over ``batch``'s micro-batches (their count is the plan's), the
        optimizer step and the LR step; ``step`` is the 0-based index of the step run."""

    @abstractmethod
    def save(self, step: int) -> None:
        """Checkpoint the model, optimizer, schedule and the stream's state after ``step`` steps."""

    @abstractmethod
    def report(self, record: StepRecord) -> None:
        """Log one finished step (the loop has counted it already)."""

    @abstractmethod
    def end_of_step(self, step: int, *, last: bool) -> bool:
        """Save when due and decide whether to stop after ``step`` steps (``last``: the loop's
        final step); True stops the loop."""

    def validation_due(self, step: int) -> bool:
        """Whether validation runs after ``step`` steps (never, unless the host says so)."""
        return False

    def validate(self, step: int) -> None:
        """Run validation after ``step`` steps (a host with validation overrides both)."""
        raise NotImplementedError(f"{type(self).__name__} says validation is due but has none")


def run_steps(host: StepHost, stream: TrainStream, *, start: int, stop: int) -> LoopResult:
    """Run steps ``start .. stop - 1`` (0-based) through ``host``; see the module docstring."""
    step = start
    while step < stop:
        began = time.perf_counter()
        stream.step_boundary(step)
        batch = next(stream)
        fetched = time.perf_counter()
        done = host.run_step(step, batch)
        if done.should_checkpoint:
            host.save(step)
        if done.should_exit:
            return LoopResult(step, LoopEnd.EXITED, done.exit_code)
        step += 1
        metrics = step_metrics(batch.meta, loss=done.loss, lr=done.lr)
        if done.grad_norm is not None:
            metrics["train/grad_norm"] = float(done.grad_norm)
        metrics["train/consumed_examples"] = int(stream.counter.examples)
        metrics["perf/step_seconds"] = done.compute_ms / 1000
        metrics["perf/batch_wait_seconds"] = fetched - began
        host.report(StepRecord(step, batch, done, metrics, data_ms=(fetched - began) * 1000,
                               step_ms=(time.perf_counter() - began) * 1000))
        if host.validation_due(step):
            host.validate(step)
        if host.end_of_step(step, last=step == stop):
            return LoopResult(step, LoopEnd.STOPPED)
    return LoopResult(step, LoopEnd.COMPLETED)
