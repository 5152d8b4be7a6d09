"""Fetching a step's examples together with its plan, so the collator never packs again.

The DataLoader passes the batch sampler's output (indices with a plan attached, or a list that
is itself the plan) to the dataset's ``__getitems__``. `PlannedDataset` reads exactly those
examples and returns them with the plan, in worker processes as well as in the main one. Both
the packed and the padded mode fetch through it.

Every fetched example is checked against what the plan was made from: the dataset's length
index (``lengths``, ``loss_token_counts``). A store changed or corrupted after planning would
otherwise give rows longer than the capacity or a wrong loss divisor without any error. An
example cut short by the ``truncate`` oversize policy must keep at least one loss target: one
whose prompt alone fills the capacity would train nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_packing.common.plan_types import TupleSequence


class FetchedExampleError(ValueError):
    """A fetched example that disagrees with its plan (or would train nothing)."""


@dataclass(frozen=True)
class PlannedExamples(TupleSequence):
    """Fetched examples (in the order of the planned indices) plus the step's plan.

    A read-only sequence of the examples; what the collator receives from a worker or the main
    process.
    """

    examples: tuple[Any, ...]
    indices: tuple[int, ...]
    plan: Any
    dp_rank: int | None
    _items = "examples"

    def by_index(self) -> dict[int, Any]:
        return dict(zip(self.indices, self.examples, strict=True))


class PlannedDataset:
    """Wraps a map-style dataset; batched fetches keep the batch sampler's plan.

    ``verify`` (default on) checks every fetched example against the dataset's length index
    when it has one (see the module docstring); ``benchmarks/bench_fetch_checks.py`` measures
    the cost.
    """

    def __init__(self, dataset: Any, *, verify: bool = True) -> None:
        self.dataset = dataset
        self.verify = verify

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[int]) -> Any:
        batched = getattr(self.dataset, "__getitems__", None)
        if callable(batched):
            examples = list(batched([int(i) for i in indices]))
        else:
            examples = [self.dataset[int(i)] for i in indices]
        plan = getattr(indices, "plan", None)
        if self.verify:
            check_fetched(self.dataset, indices, examples, getattr(plan, "truncated", None) or {})
        if plan is None:
            return examples
        return PlannedExamples(tuple(examples), tuple(int(i) for i in indices), plan,
                               getattr(indices, "dp_rank", None))


def _origin(dataset: Any, index: int) -> str:
    describe = getattr(dataset, "example_origin", None)
    return f"example {index} ({describe(index)})" if callable(describe) else f"example {index}"


def check_loss_targets(dataset: Any, counts: np.ndarray) -> None:
    """Refuse a dataset with an example that has no next-token target before any step is planned.

    Such an example (one token, or a loss mask that is 0 after position 0) would be planned,
    fetched and counted as trained while contributing nothing; a dataset whose every mask is 0
    would train with a loss divisor of 0. ``counts`` is the loss-target count per example.
    """
    counts = np.asarray(counts)
    empty = np.flatnonzero(counts <= 0)
    if empty.size == 0:
        return
    where = ", ".join(_origin(dataset, int(i)) for i in empty[:3])
    whole = " (none of the dataset's examples has one: the loss divisor would be 0)" \
        if empty.size == counts.size else ""
    raise ValueError(
        f"{empty.size} of {counts.size} examples have no next-token target{whole}: {where}"
        f"{' ...' if empty.size > 3 else ''}; an example needs at least 2 tokens and a loss mask "
        "set at some position after the first. Drop these examples from the dataset (with "
        "load_sft_dataset they are bad records no_loss_tokens: on_bad_record='skip' counts them)")


def check_fetched(dataset: Any, indices: Sequence[int], examples: Sequence[Any],
                  truncated: Mapping[int, int]) -> None:
    """Raise :class:`FetchedExampleError` for an example that disagrees with the length index.

    Checks, per example: ids and mask have the same length, the length equals
    ``dataset.lengths[i]`` and the loss targets (``mask[1:]``) number
    ``dataset.loss_token_counts[i]``; an example the plan truncates to ``k`` tokens keeps at
    least one loss target among them. Datasets without an index are not checked.
    """
    lengths = getattr(dataset, "lengths", None)
    counts = getattr(dataset, "loss_token_counts", None)
    if lengths is None or counts is None:
        return
    idx = np.fromiter((int(i) for i in indices), dtype=np.int64, count=len(indices))
    want_len = np.asarray(lengths)[idx]
    want_loss = np.asarray(counts)[idx]
    for k, example in enumerate(examples):
        ids, mask = example["input_ids"], example.get("loss_mask")
        n = len(ids)
        if n != want_len[k] or (mask is not None and len(mask) != n):
            raise FetchedExampleError(
                f"{_origin(dataset, int(idx[k]))}: fetched {n} token ids and "
                f"{'no' if mask is None else len(mask)} mask values, but the length index planned "
                f"{int(want_len[k])} tokens; the data changed or was corrupted after the index was "
                "built: delete its cache entry (or re-save the pre-tokenized data) and restart"
            )
        if mask is None:
            continue
        loss = int(np.count_nonzero(mask[1:]))
        if loss != want_loss[k]:
            raise FetchedExampleError(
                f"{_origin(dataset, int(idx[k]))}: its loss mask has {loss} loss targets, but the "
                f"length index records {int(want_loss[k])} (the loss divisor was planned from it); "
                "the data changed or was corrupted after the index was built: delete its cache "
                "entry (or re-save the pre-tokenized data) and restart"
            )
        keep = truncated.get(int(idx[k]))
        if keep is not None and not np.count_nonzero(mask[1:keep]):
            raise FetchedExampleError(
                f"{_origin(dataset, int(idx[k]))}: oversize_policy 'truncate' keeps its first {keep} "
                f"of {n} tokens and none of them is a loss target (the prompt alone fills the "
                "capacity), so it would train nothing. Raise bin_capacity, or drop and count such "
                f"examples when loading: load_sft_dataset(..., max_length={keep}, "
                "on_bad_record='skip') skips them as no_loss_tokens"
            )
