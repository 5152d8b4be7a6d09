"""Padded token-budget micro-batching: split a length-sorted run of examples into micro-batches.

A padded micro-batch of ``b`` examples costs ``b x max_len`` tokens of compute and memory. Filling
each micro-batch up to a token budget, instead of a fixed ``b``, wastes far less on mixed lengths.

Two splitters share one contract (every index exactly once, order kept, each micro-batch within
the budget unless it is a single example longer than the budget):

- ``greedy`` (default): walk the order and open a new micro-batch when one more example would
  push ``count x max_len`` above the budget.
- ``balanced``: keep the greedy's micro-batch count, then find the smallest per-micro-batch cap
  that still fits that count (binary search), so the largest micro-batch shrinks.

Pure numpy: no torch, ranks or files.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import StrEnum
from typing import Any

import numpy as np

from megatron_packing.common.validation import require_positive_int


class SplitMethod(StrEnum):
    """How a rank's examples are cut into micro-batches under a token budget."""

    GREEDY = "greedy"
    BALANCED = "balanced"


SPLIT_METHODS: tuple[str, ...] = tuple(m.value for m in SplitMethod)
DEFAULT_SPLIT_METHOD = SplitMethod.GREEDY


# --------------------------------------------------------------------------- inputs
def example_lengths(all_input_ids: Any) -> np.ndarray:
    """Lengths (int64) of examples given as token-id sequences or as plain integer lengths."""
    if (
        isinstance(all_input_ids, np.ndarray)
        and all_input_ids.ndim == 1
        and all_input_ids.dtype != object
    ):
        if not np.issubdtype(all_input_ids.dtype, np.integer):
            raise ValueError(f"lengths must be integers, got dtype {all_input_ids.dtype}")
        lengths = all_input_ids.astype(np.int64, copy=False)
    else:
        out = []
        for position, item in enumerate(all_input_ids):
            if isinstance(item, bool):
                raise ValueError(f"example {position}: a bool is neither a length nor token ids")
            if isinstance(item, int | np.integer):
                out.append(int(item))
            elif hasattr(item, "__len__"):
                out.append(len(item))
            else:
                raise ValueError(
                    f"example {position}: expected token ids (a sequence) or an integer length, "
                    f"got {type(item).__name__}"
                )
        lengths = np.asarray(out, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        bad = int(np.argmin(lengths))
        raise ValueError(f"example {bad} has a negative length {int(lengths[bad])}")
    return lengths


def _check_budget(max_tokens: Any) -> int:
    """The token budget per micro-batch as an int >= 1."""
    budget = require_positive_int("max_tokens", max_tokens, error=ValueError)
    assert budget is not None  # allow_none is off
    return budget


def _check_indices(sorted_indices: Iterable[int], num_examples: int) -> np.ndarray:
    indices = np.asarray(list(sorted_indices), dtype=np.int64)
    if indices.size == 0:
        raise ValueError("empty batch: sorted_indices holds no example")
    if indices.ndim != 1:
        raise ValueError("sorted_indices must be a flat sequence of integers")
    low, high = int(indices.min()), int(indices.max())
    if low < 0 or high >= num_examples:
        bad = low if low < 0 else high
        raise ValueError(
            f"index {bad} is out of range: all_input_ids describes {num_examples} examples "
            f"(valid indices 0..{num_examples - 1})"
        )
    if np.unique(indices).size != indices.size:
        raise ValueError("sorted_indices holds the same index twice; each example must appear once")
    return indices


# --------------------------------------------------------------------------- cost
def padded_tokens(group: Sequence[int], lengths: np.ndarray) -> int:
    """The padded footprint of one micro-batch: ``count x max_len``."""
    if len(group) == 0:
        return 0
    return len(group) * int(lengths[np.asarray(group, dtype=np.int64)].max())


def sort_by_length(indices: Iterable[int], lengths: Any, *, descending: bool = True) -> list[int]:
    """Indices ordered by length (longest first by default); ties keep their input order."""
    index_array = np.asarray(list(indices), dtype=np.int64)
    if index_array.size == 0:
        return []
    keys = example_lengths(lengths)[index_array]
    order = np.argsort(-keys if descending else keys, kind="stable")
    return index_array[order].tolist()


# --------------------------------------------------------------------------- splitters
def _greedy_cuts(run_lengths: np.ndarray, budget: int) -> list[int]:
    """Start offsets of the greedy's micro-batches over ``run_lengths`` (walked in order)."""
    starts = [0]
    count = 0
    longest = 0
    for position, length in enumerate(run_lengths.tolist()):
        # A padded micro-batch costs count x its longest example; adding one example can raise
        # both factors. A lone example over the budget still gets its own micro-batch.
        new_longest = max(longest, length)
        if count > 0 and (count + 1) * new_longest > budget:
            starts.append(position)
            count, longest = 1, length
        else:
            count, longest = count + 1, new_longest
    return starts


def _groups_from_cuts(indices: np.ndarray, starts: list[int]) -> list[list[int]]:
    ends = starts[1:] + [indices.size]
    return [indices[a:b].tolist() for a, b in zip(starts, ends, strict=True)]


def _balanced_cuts(run_lengths: np.ndarray, budget: int) -> list[int]:
    """The greedy's count, with the smallest cap on ``count x max_len`` that still fits it.

    For contiguous groups whose cost only grows as a group extends, the greedy opens the fewest
    groups under any cap, so the smallest feasible cap is found by binary search.
    """
    target = len(_greedy_cuts(run_lengths, budget))
    fitting = run_lengths[run_lengths <= budget]
    low = int(fitting.max()) if fitting.size else 1  # no cap below the longest example that fits
    high = budget
    # The greedy's count only falls as the cap rises, so the caps that reach ``target`` form an
    # interval [c*, budget]: bisect for its start.
    while low < high:
        middle = (low + high) // 2
        if len(_greedy_cuts(run_lengths, middle)) <= target:
            high = middle
        else:
            low = middle + 1
    return _greedy_cuts(run_lengths, low)


def make_token_balanced_microbatches(
    sorted_indices: Sequence[int],
    all_input_ids: Any,
    max_tokens: int,
    *,
    method: str = DEFAULT_SPLIT_METHOD,
) -> list[list[int]]:
    """Split ``sorted_indices`` (walked in the given order) into padded micro-batches.

    ``all_input_ids[i]`` holds example ``i``'s token ids, or its length as an integer. Each
    micro-batch keeps ``count x max_len <= max_tokens``; an example longer than the budget gets a
    micro-batch of its own and is never dropped. ``method`` picks the greedy walk (default) or
    the balanced split, which never uses more micro-batches than the greedy.
    """
    budget = _check_budget(max_tokens)
    if method not in SPLIT_METHODS:
        raise ValueError(f"method must be one of {', '.join(SPLIT_METHODS)}, got {method!r}")
    lengths = example_lengths(all_input_ids)
    indices = _check_indices(sorted_indices, lengths.size)
    run_lengths = lengths[indices]
    starts = (
        _greedy_cuts(run_lengths, budget)
        if method == "greedy"
        else _balanced_cuts(run_lengths, budget)
    )
    return _groups_from_cuts(indices, starts)


def fixed_size_microbatches(indices: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``micro_batch_size`` examples (the last may be shorter)."""
    size = require_positive_int("micro_batch_size", micro_batch_size, error=ValueError)
    assert size is not None  # allow_none is off
    items = list(indices)
    return [items[start : start + size] for start in range(0, len(items), size)]


# --------------------------------------------------------------------------- results
def restore_input_order(
    input_indices: Sequence[int],
    schedule: Sequence[Sequence[int] | None],
    outputs: Sequence[Sequence[Any] | None],
) -> list[Any]:
    """Scatter per-micro-batch outputs back to the order of ``input_indices``.

    ``outputs[m][k]`` is the result for example ``schedule[m][k]`` (e.g. one sequence's
    log-probs). ``None`` micro-batches (dummies) are skipped. Every input index must receive
    exactly one result.
    """
    if len(schedule) != len(outputs):
        raise ValueError(
            f"{len(schedule)} micro-batches in the schedule but {len(outputs)} outputs"
        )
    position_of: dict[int, int] = {}
    for position, index in enumerate(input_indices):
        if int(index) in position_of:
            raise ValueError(f"index {index} appears twice in input_indices")
        position_of[int(index)] = position
    result: list[Any] = [None] * len(position_of)
    filled = [False] * len(position_of)
    for number, (group, produced) in enumerate(zip(schedule, outputs, strict=True)):
        if group is None:
            continue
        if produced is None or len(produced) != len(group):
            got = "None" if produced is None else len(produced)
            raise ValueError(f"micro-batch {number}: {len(group)} examples but {got} outputs")
        for index, value in zip(group, produced, strict=True):
            slot = position_of.get(int(index))
            if slot is None:
                raise ValueError(f"micro-batch {number} holds index {index}, which is not an input")
            if filled[slot]:
                raise ValueError(f"index {index} appears in two micro-batches")
            result[slot] = value
            filled[slot] = True
    if not all(filled):
        missing = [int(input_indices[p]) for p, done in enumerate(filled) if not done]
        raise ValueError(f"no output for input indices {missing[:10]}")
    return result


__all__ = [
    "DEFAULT_SPLIT_METHOD",
    "SPLIT_METHODS",
    "SplitMethod",
    "example_lengths",
    "fixed_size_microbatches",
    "make_token_balanced_microbatches",
    "padded_tokens",
    "restore_input_order",
    "sort_by_length",
]
