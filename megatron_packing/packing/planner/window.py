"""Where the stream stands before a step, and the sizes that step may take.

The examples arrive in a fixed order; a step takes a prefix of what is left. Its size may differ
from the nominal batch size B by at most v examples, and the running drift
``emitted - steps x B`` (counted within the epoch) stays within +-v. The epoch's last step takes
what remains; the run's last scheduled step repays the drift exactly; every earlier step of the
epoch leaves at least one example for each step after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

StepKind = Literal["normal", "epoch_tail", "run_final"]

STEP_NORMAL: StepKind = "normal"
STEP_EPOCH_TAIL: StepKind = "epoch_tail"  # the epoch's last step: takes what remains
STEP_RUN_FINAL: StepKind = "run_final"  # the run's last scheduled step: repays the drift exactly


class Window(NamedTuple):
    """The sizes a step may take, ``lowest..highest``, and the one that repays the drift
    (a tuple, so ``lowest, highest, target = context.window()`` reads it)."""

    lowest: int
    highest: int
    target: int

    @property
    def forced(self) -> bool:
        return self.lowest == self.highest

    def sizes(self) -> list[int]:
        """Every size of the window, nearest the target first (`outward`)."""
        return list(outward(self.target, self.lowest, self.highest))


@dataclass(frozen=True)
class StepContext:
    """Where the stream stands before a step; everything the window depends on."""

    batch_size: int  # B
    v: int  # the window half-width floor(B x allowed_variation), in examples
    drift: int  # examples emitted in this epoch minus steps taken x B
    remaining: int  # examples left in the epoch, >= 1
    steps_left_in_epoch: int  # including this step, >= 1
    steps_left_in_run: int | None = None  # including this step; None when there is no horizon

    @property
    def kind(self) -> StepKind:
        if self.steps_left_in_epoch <= 1:
            return STEP_EPOCH_TAIL
        if self.steps_left_in_run == 1:
            return STEP_RUN_FINAL
        return STEP_NORMAL

    def room(self) -> int:
        """The most this step may take: one example stays for each later step of the epoch."""
        return self.remaining - (self.steps_left_in_epoch - 1)

    def window(self) -> Window:
        """The sizes this step may take; lowest == highest when it is forced."""
        batch, v, drift = self.batch_size, self.v, self.drift
        if self.kind == STEP_EPOCH_TAIL:
            return Window(self.remaining, self.remaining, self.remaining)
        cap = self.room()
        if self.kind == STEP_RUN_FINAL:
            size = max(1, min(batch - drift, cap))
            return Window(size, size, size)
        # Two windows intersect: the size itself within B +- v, and the drift after the step,
        # drift + size - B, within +-v. The cap may squeeze the window below B - v near the
        # epoch's end; lowest then follows it down.
        lowest = max(batch - v, batch - v - drift, 1)
        highest = min(batch + v, batch + v - drift, cap)
        lowest = min(lowest, highest)
        # B - drift would bring the drift back to 0: the nominal size, clipped into the window.
        target = min(max(batch - drift, lowest), highest)
        return Window(lowest, highest, target)

    def after(self, size: int) -> StepContext | None:
        """The next step's context after taking ``size`` examples (None if the epoch ends)."""
        if self.steps_left_in_epoch <= 1:
            return None
        steps_left_in_run = None if self.steps_left_in_run is None else self.steps_left_in_run - 1
        if steps_left_in_run == 0:
            return None
        return replace(
            self,
            drift=self.drift + size - self.batch_size,
            remaining=self.remaining - size,
            steps_left_in_epoch=self.steps_left_in_epoch - 1,
            steps_left_in_run=steps_left_in_run,
        )

    def lookahead_need(self, steps: int = 2) -> int:
        """Examples to read ahead so that this step and the ``steps - 1`` after it can be judged."""
        highest = self.window().highest
        if steps <= 1 or self.after(highest) is None:
            return min(self.remaining, highest)
        # Any later step's window ends at most B + v past the previous boundary.
        return min(self.remaining, highest + (steps - 1) * (self.batch_size + self.v))


def outward(target: int, lowest: int, highest: int) -> Iterator[int]:
    """target, target+1, target-1, target+2, ... within [lowest, highest]."""
    yield target
    for offset in range(1, max(highest - target, target - lowest) + 1):
        if target + offset <= highest:
            yield target + offset
        if target - offset >= lowest:
            yield target - offset
