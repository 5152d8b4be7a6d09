"""The epoch's example order: a resumable cursor over any base sampler.

Batch samplers read examples from here one run at a time. The cursor can be saved and restored
exactly whatever the base sampler is:

- a sampler with ``state_dict`` / ``load_state_dict`` restores its own state;
- any other sampler is fast-forwarded: the random state it draws from (its ``generator``, or
  torch's global generator) is captured when the epoch's iterator is created, and a resume
  recreates that iterator and skips the examples already read;
- a sampler with a ``generator`` attribute left as None (torch's ``RandomSampler`` default)
  would draw each epoch from torch's global generator, which no restart can reproduce; it is
  given a generator seeded from (seed, epoch) at each epoch start instead.

The epoch is explicit state: creating an extra iterator never moves it.

A sampler that can give its whole epoch order as an array (``epoch_permutation()``, as
`SeededRandomOrder` does) is read by slicing that array: the epoch's order is never held as a
Python list (a list of 10M ints is about 385 MB; the int32 array is 40 MB), and a resume jumps
to its position instead of replaying the order.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import RandomSampler, Sampler, SequentialSampler

_ITER_CHUNK = 65_536  # examples converted to Python ints at a time when iterating an array


class SeededRandomOrder(Sampler[int]):
    """A random permutation of ``range(n)`` that depends only on (seed, epoch).

    The order is ``torch.randperm(n)`` drawn from a generator seeded with
    ``seed * 1_000_003 + epoch``; `epoch_permutation` gives it as a numpy array.
    """

    def __init__(self, num_examples: int, seed: int = 0) -> None:
        self.num_examples = int(num_examples)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.num_examples

    def epoch_permutation(self) -> np.ndarray:
        """This epoch's order as an integer array (int32 below 2**31 examples)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + self.epoch)
        dtype = torch.int32 if self.num_examples < 2**31 else torch.int64
        return torch.randperm(self.num_examples, generator=generator, dtype=dtype).numpy()

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_permutation()
        for start in range(0, len(order), _ITER_CHUNK):
            yield from order[start : start + _ITER_CHUNK].tolist()


def make_base_order(kind: str, num_examples: int, seed: int) -> Sampler[int]:
    """The built-in base orders: ``random`` (seeded, reshuffled per epoch) or ``sequential``."""
    if kind == "random":
        return SeededRandomOrder(num_examples, seed)
    if kind == "sequential":
        return SequentialSampler(range(num_examples))
    raise ValueError(f"base order must be 'random' or 'sequential', got {kind!r}")


def _has_array_order(sampler: Any) -> bool:
    """Whether the sampler gives its epoch's order as an array (see `SeededRandomOrder`)."""
    return callable(getattr(sampler, "epoch_permutation", None)) and not _is_stateful(sampler)


def _is_stateful(sampler: Any) -> bool:
    return callable(getattr(sampler, "state_dict", None)) and callable(
        getattr(sampler, "load_state_dict", None)
    )


class EpochOrder:
    """Reads the base sampler's order for the current epoch, one example at a time, resumably."""

    def __init__(self, sampler: Iterable[int], seed: int = 0) -> None:
        if not isinstance(sampler, Sized):
            raise TypeError(
                f"the base sampler {type(sampler).__name__} has no __len__: the packing sampler "
                "needs the epoch's length to plan steps and an epoch's last step; wrap it in a "
                "sampler that reports len()"
            )
        self.sampler: Any = sampler  # any sized sampler; optional generator, seed, state
        self.seed = int(seed)
        self.epoch = 0
        self.consumed = 0  # examples read from this epoch's order so far
        self._iterator: Iterator[int] | None = None
        self._array: np.ndarray | None = None  # the epoch's order, for an array-order sampler
        self._rng_state: torch.Tensor | None = None
        self._stateful = _is_stateful(sampler)
        self._array_order = _has_array_order(sampler)
        self._owns_generator = False

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def remaining(self) -> int:
        return len(self) - self.consumed

    # ------------------------------------------------------------------ reading
    def take(self, count: int) -> list[int]:
        """The next ``count`` examples of this epoch (fewer at its end)."""
        if count <= 0:
            return []
        iterator = self._ensure_iterator()
        wanted = min(count, self.remaining)
        if self._array is not None:
            out = self._array[self.consumed : self.consumed + wanted].tolist()
        else:
            out = [int(i) for i in itertools.islice(iterator, wanted)]
        self.consumed += len(out)
        if len(out) < wanted:
            raise RuntimeError(
                f"the base sampler {type(self.sampler).__name__} yielded {self.consumed} "
                f"examples in epoch {self.epoch} but reports len() = {len(self)}"
            )
        return out

    def start_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch`` (and tell the base sampler, as DistributedSampler does)."""
        self.epoch = int(epoch)
        self.consumed = 0
        self._iterator = None
        self._array = None
        self._rng_state = None

    def _ensure_iterator(self) -> Iterator[int]:
        if self._iterator is None:
            set_epoch = getattr(self.sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
            generator = self._generator()
            self._rng_state = generator.get_state() if generator is not None else torch.get_rng_state()
            if self._array_order:
                self._array = self._epoch_array()
                self._iterator = iter(())  # reads slice self._array instead
            else:
                self._iterator = iter(self.sampler)
        return self._iterator

    def _epoch_array(self) -> np.ndarray:
        order = np.asarray(self.sampler.epoch_permutation())
        if order.ndim != 1 or len(order) != len(self):
            raise RuntimeError(
                f"the base sampler {type(self.sampler).__name__} gave an epoch order of shape "
                f"{order.shape} but reports len() = {len(self)}"
            )
        return order

    def _generator(self) -> torch.Generator | None:
        if self._owns_generator or (
            hasattr(self.sampler, "generator") and self.sampler.generator is None
        ):
            self._owns_generator = True
            seeded = torch.Generator()
            seeded.manual_seed(self.seed * 1_000_003 + self.epoch)
            self.sampler.generator = seeded
        generator = getattr(self.sampler, "generator", None)
        return generator if isinstance(generator, torch.Generator) else None

    # ------------------------------------------------------------------ state
    def fingerprint(self) -> dict[str, Any]:
        """What decides this order, for refusing a resume into a different one.

        Call before the first epoch: a generator this cursor seeds per epoch is not yet made.
        """
        sampler = self.sampler
        seed: Any = None
        if isinstance(sampler, SeededRandomOrder):
            seed = sampler.seed
        elif self._owns_generator or (hasattr(sampler, "generator") and sampler.generator is None):
            seed = self.seed  # a generator-less random sampler is seeded from (seed, epoch)
        elif isinstance(getattr(sampler, "generator", None), torch.Generator):
            seed = int(sampler.generator.initial_seed())
        elif isinstance(getattr(sampler, "seed", None), int):
            seed = sampler.seed
        shuffle = getattr(sampler, "shuffle", None)
        return {
            "base_sampler": type(sampler).__name__,
            "seed": seed,
            "shuffle": shuffle if isinstance(shuffle, bool) else None,
        }

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "consumed": self.consumed}
        if self._stateful and self.consumed > 0:
            state["sampler_state"] = copy.deepcopy(self.sampler.state_dict())
        elif self._rng_state is not None:
            state["rng_state"] = self._rng_state.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.start_epoch(state["epoch"])
        consumed = int(state["consumed"])
        if consumed == 0:
            return
        if "sampler_state" in state:
            set_epoch = getattr(self.sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch)
            self.sampler.load_state_dict(copy.deepcopy(state["sampler_state"]))
            self._iterator = iter(self.sampler)
            self.consumed = consumed
            return
        if self._array_order:  # the order is a function of (seed, epoch): jump to the position
            self._ensure_iterator()
            if state.get("rng_state") is not None:
                self._rng_state = state["rng_state"].clone()
            self.consumed = consumed
            return
        self._replay_iterator(state.get("rng_state"))
        for _ in range(consumed):  # fast-forward a sampler that cannot save itself
            next(self._iterator)  # type: ignore[arg-type]
        self.consumed = consumed

    def _replay_iterator(self, rng_state: torch.Tensor | None) -> None:
        """Recreate the epoch's iterator from the random state captured when it was first made."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        generator = self._generator()
        if rng_state is None:
            self._rng_state = generator.get_state() if generator is not None else torch.get_rng_state()
            self._iterator = iter(self.sampler)
            return
        self._rng_state = rng_state.clone()
        if generator is not None:
            generator.set_state(rng_state)
            self._iterator = iter(self.sampler)
            return
        saved = torch.get_rng_state()
        torch.set_rng_state(rng_state)
        try:
            self._iterator = iter(self.sampler)
            # RandomSampler draws its seed lazily, on the first next(): force it now.
            first = next(self._iterator)
        finally:
            torch.set_rng_state(saved)
        self._iterator = _prepend(first, self._iterator)


def _prepend(first: int, rest: Iterator[int]) -> Iterator[int]:
    yield first
    yield from rest


__all__ = [
    "EpochOrder",
    "RandomSampler",
    "SeededRandomOrder",
    "SequentialSampler",
    "make_base_order",
]
