"""The training loader as an endless stream of steps, with the state a checkpoint stores.

Both step-loop hosts (the Megatron-LM entry point and the CPU demo) read their steps through it:
epochs roll over here, the examples and tokens trained are counted here from the plan's
metadata, and padded mode's live token budget is agreed here before each step is planned.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron_packing.megatron.step_accounting import ConsumedExamples
from megatron_packing.packed.collate import PackedBatch
from megatron_packing.padded.collate import PaddedBatch
from megatron_packing.padded.sync import TokenBudgetController


class EmptyEpoch(RuntimeError):
    """A fresh epoch has no step: the loader has nothing to train on."""


@dataclass
class TrainStream:
    """The training loader as an endless stream of steps (epochs roll over), with its state.

    ``state_dict()`` taken after ``next()`` returned step k resumes at step k + 1: the loop
    pulls exactly one step per iteration and never reads ahead.
    """

    loader: Any
    counter: ConsumedExamples = field(default_factory=ConsumedExamples)
    budget: TokenBudgetController | None = None  # padded mode: the live token budget
    _iterator: Iterator[PackedBatch | PaddedBatch] | None = None

    def step_boundary(self, step: int) -> None:
        """Before planning ``step`` (0-based): agree on a budget change (all ranks call it).

        The loader's iterator is made first: on a resume, making it is what puts the saved
        sampler state in place, and a change set before that would be overwritten by it.
        """
        if self.budget is not None:
            if self._iterator is None:
                self._iterator = iter(self.loader)
            self.budget.step_boundary(step)

    def __next__(self) -> PackedBatch | PaddedBatch:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        try:
            batch = next(self._iterator)
        except StopIteration:  # one pass of the loader is one epoch; the sampler starts the next
            self._iterator = iter(self.loader)
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise EmptyEpoch("a fresh epoch of the training loader yields no step") from None
        self.counter.update(batch.meta)
        return batch

    def close(self) -> None:
        """Drop the epoch's iterator (its loader workers exit); the next step starts a new one."""
        self._iterator = None

    def __iter__(self) -> TrainStream:
        return self

    def state_dict(self) -> dict[str, Any]:
        """This rank's loader state (exact, for a resume at the same size and workers) and the
        stream's global part, the same on every rank (for a resume at any other size)."""
        loader = self.loader.state_dict()
        shared: dict[str, Any] = {"loader": self.loader.stream_state(loader),
                                  "counter": self.counter.state_dict()}
        if self.budget is not None:
            shared["budget"] = self.budget.state_dict()
        return {"loader": loader, "global": shared}

    def save_state(self) -> dict[str, Any]:
        """What Megatron's dataloader hook stores in a checkpoint (``iterable.save_state()``)."""
        return self.state_dict()

    def resumes_exactly(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` (a rank's) loads through torchdata's own restore: saved at this
        data-parallel size and worker count (or by a release without the global part)."""
        shared = state.get("global")
        if shared is None:
            return True
        saved = shared["loader"]
        return (saved["dp_size"], saved["num_workers"]) == (self.loader.batch_sampler.dp_size,
                                                            self.loader.num_workers)

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise `ValueError` unless ``state`` can be loaded (loads nothing): its sampler's setup
        is this run's, and a resume at another size or worker count has the global part."""
        if self.resumes_exactly(state):
            from megatron_packing.loader.state import sampler_state

            self.loader.batch_sampler.check_state(sampler_state(state["loader"]))
            return
        self.loader.check_stream_state(state["global"]["loader"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a rank's saved state: exactly as saved at the same size and workers,
        else from its global part (any rank's), planned at this loader's size."""
        shared = state.get("global")
        if shared is None or self.resumes_exactly(state):
            self.loader.load_state_dict(state["loader"])
        else:
            self.loader.load_stream_state(shared["loader"])
        counts = state if shared is None else shared  # a release without the global part
        self.counter.load_state_dict(counts["counter"])
        if self.budget is not None and "budget" in counts:
            self.budget.load_state_dict(counts["budget"])
        self._iterator = None
