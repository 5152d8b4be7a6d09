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
        state = {"loader": self.loader.state_dict(), "counter": self.counter.state_dict()}
        if self.budget is not None:
            state["budget"] = self.budget.state_dict()
        return state

    def save_state(self) -> dict[str, Any]:
        """What Megatron's dataloader hook stores in a checkpoint (``iterable.save_state()``)."""
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state["loader"])
        self.counter.load_state_dict(state["counter"])
        if self.budget is not None and "budget" in state:
            self.budget.load_state_dict(state["budget"])
        self._iterator = None
