"""Batch samplers whose stream position lives in the iterators they make.

A step sampler plans one step at a time from a cursor: the epoch's base order, examples read
ahead, step counters. Each ``iter(sampler)`` makes a `StepIterator` that owns its cursor, so two
iterators never move each other. The sampler itself remembers only where the next iterator
starts: the start of the stream, a loaded state, or where its latest iterator finished. An
iterator that finishes its epoch hands its cursor back, so the next ``iter()`` begins the next
epoch, as a DataLoader expects.

``state_dict()`` reports the position of the latest unfinished iterator (the stream the loader
is reading), else where the next iterator starts. Both the sampler and its iterators are
torchdata ``Stateful``: a ``StatefulDataLoader`` saves and restores them through its own
protocol, with nothing of its state rewritten. A base sampler with state of its own is shared by
all cursors; iterate one iterator at a time.
"""

from __future__ import annotations

import copy
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from torch.utils.data import SequentialSampler

from megatron_packing.common.user_warnings import UserFacingWarning
from megatron_packing.stream.base_order import EpochOrder, SeededRandomOrder

# Base orders whose epochs draw nothing that a later epoch depends on.
_INDEPENDENT_EPOCHS = (SeededRandomOrder, SequentialSampler)

CursorT = TypeVar("CursorT")
StepT = TypeVar("StepT")


class StepStream(ABC, Generic[CursorT, StepT]):
    """The iterator-making half of a step sampler; subclasses plan steps from a cursor."""

    def _init_stream(self) -> None:
        self._resume_state: dict[str, Any] | None = None  # None: the stream's very start
        self._idle_cursor: CursorT | None = None  # a live cursor at _resume_state, owned by none
        self._latest: StepIterator[CursorT, StepT] | None = None

    # ---------------------------------------------------------------- what subclasses provide
    @abstractmethod
    def _new_cursor(self) -> CursorT:
        """A cursor at the stream's start."""

    @abstractmethod
    def _cursor_from_state(self, state: dict[str, Any]) -> CursorT:
        """A cursor at a saved position (the state was checked by `check_state`)."""

    @abstractmethod
    def _cursor_state(self, cursor: CursorT) -> dict[str, Any]:
        """A fresh, self-contained copy of a cursor's position."""

    @abstractmethod
    def _begin(self, cursor: CursorT) -> None:
        """At an iterator's first step: move a cursor whose epoch is complete to the next one."""

    @abstractmethod
    def _next_step(self, cursor: CursorT) -> StepT | None:
        """Plan the cursor's next step and advance it; None ends the iterator (epoch or run end)."""

    @abstractmethod
    def check_state(self, state: Any) -> None:
        """Raise unless ``state`` is a complete state of this sampler's setup."""

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> StepIterator[CursorT, StepT]:
        cursor = self._idle_cursor
        if cursor is None:
            cursor = self._new_cursor() if self._resume_state is None else \
                self._cursor_from_state(self._resume_state)
        self._idle_cursor = None
        iterator = StepIterator(self, cursor)
        self._latest = iterator
        return iterator

    def _finished(self, iterator: StepIterator[CursorT, StepT]) -> None:
        """The latest iterator ended: the next one starts where it stopped."""
        if iterator is self._latest:
            self._resume_state = self._cursor_state(iterator.cursor)
            self._idle_cursor = iterator.cursor
            self._latest = None

    def _position(self) -> CursorT:
        """The cursor that `state_dict` describes (materialised when no iterator holds one)."""
        if self._latest is not None and not self._latest.finished:
            return self._latest.cursor
        if self._idle_cursor is None:
            self._idle_cursor = self._new_cursor() if self._resume_state is None else \
                self._cursor_from_state(self._resume_state)
        return self._idle_cursor

    def _position_changed(self) -> None:
        """Record an edit of an idle position (e.g. `set_epoch`) as where the next iterator starts."""
        if self._idle_cursor is not None and (self._latest is None or self._latest.finished):
            self._resume_state = self._cursor_state(self._idle_cursor)

    def replica(self) -> StepStream[CursorT, StepT]:
        """This sampler with a stream of its own, starting at the stream's start: for replaying
        plans (e.g. reading a saved position) without moving this sampler's iterators."""
        clone = copy.copy(self)
        clone._init_stream()
        return clone

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """A fresh copy of the stream position: safe to hold while iteration continues."""
        return self._cursor_state(self._position())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly where ``state`` (from `state_dict`) was taken: the next ``iter()``
        continues from there. A state from another setup is refused, naming what differs.

        An iterator already running keeps its own position: loading while one is live says so
        once (`LiveIteratorWarning`), never silently.
        """
        self.check_state(state)
        if self._latest is not None and not self._latest.finished:
            warn_live_iterator(self, f"{type(self).__name__}.load_state_dict", "iter(sampler)")
        self._resume_state = copy.deepcopy(state)
        self._idle_cursor = None
        self._latest = None


class LiveIteratorWarning(UserFacingWarning):
    """A state was loaded while an iterator was running: it applies from the next iterator."""


def warn_live_iterator(owner: Any, call: str, next_iterator: str) -> None:
    """Say once per ``owner`` that a state loaded now applies from the next iterator."""
    if getattr(owner, "_warned_live_iterator", False):
        return
    owner._warned_live_iterator = True
    warnings.warn(
        f"{call} while an iterator is running: the loaded state applies from the next "
        f"{next_iterator}; the iterator already running continues from its own position (make "
        "a new iterator to read from the loaded state)", LiveIteratorWarning, stacklevel=3)


class StepIterator(Iterator[StepT], Generic[CursorT, StepT]):
    """One pass over a step sampler's stream, owning its cursor; torchdata-``Stateful``."""

    def __init__(self, stream: StepStream[CursorT, StepT], cursor: CursorT) -> None:
        self._stream = stream
        self.cursor = cursor
        self.finished = False
        self._begun = False

    def __iter__(self) -> StepIterator[CursorT, StepT]:
        return self

    def __next__(self) -> StepT:
        if self.finished:
            raise StopIteration
        if not self._begun:
            self._begun = True
            self._stream._begin(self.cursor)
        step = self._stream._next_step(self.cursor)
        if step is None:
            self.finished = True
            self._stream._finished(self)
            raise StopIteration
        return step

    def state_dict(self) -> dict[str, Any]:
        return self._stream._cursor_state(self.cursor)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move this iterator to a saved position (as `StepStream.load_state_dict` checks it)."""
        self._stream.check_state(state)
        self.cursor = self._stream._cursor_from_state(state)
        self.finished = False
        self._begun = False


class OrderPosition:
    """A cursor's place in the epoch's base order, restored lazily.

    Restoring an order that cannot save itself replays the epoch up to the saved place. A
    position at an epoch's end is only ever moved on to the next epoch, so for the built-in
    orders, whose epochs are independent of each other, the replay waits until examples are
    actually read. Any other base sampler is replayed before the next epoch starts: its next
    epoch may draw from a generator that the replayed one advanced.
    """

    def __init__(self, order: EpochOrder, state: dict[str, Any] | None = None) -> None:
        self.order = order
        self._pending = copy.deepcopy(state) if state is not None else None

    @property
    def epoch(self) -> int:
        return int(self._pending["epoch"]) if self._pending is not None else self.order.epoch

    @property
    def consumed(self) -> int:
        return int(self._pending["consumed"]) if self._pending is not None else self.order.consumed

    @property
    def remaining(self) -> int:
        return len(self.order) - self.consumed

    def take(self, count: int) -> list[int]:
        if self._pending is not None:
            self.order.load_state_dict(self._pending)
            self._pending = None
        return self.order.take(count)

    def start_epoch(self, epoch: int) -> None:
        if self._pending is not None and not isinstance(self.order.sampler, _INDEPENDENT_EPOCHS):
            self.order.load_state_dict(self._pending)
        self._pending = None
        self.order.start_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._pending) if self._pending is not None else self.order.state_dict()
