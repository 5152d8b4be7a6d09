"""Fetching a step's examples together with its plan, so the collator never packs again.

The DataLoader passes the batch sampler's output (indices with a plan attached, or a list that
is itself the plan) to the dataset's ``__getitems__``. `PlannedDataset` reads exactly those
examples and returns them with the plan, in worker processes as well as in the main one. Both
the packed and the padded mode fetch through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PlannedExamples(list):
    """Fetched examples (in the order of the planned indices) plus the step's plan."""

    def __init__(self, examples: Sequence[Any], indices: Sequence[int], plan: Any,
                 dp_rank: int | None) -> None:
        super().__init__(examples)
        self.indices = list(indices)
        self.plan = plan
        self.dp_rank = dp_rank

    def __reduce__(self):
        return (PlannedExamples, (list(self), self.indices, self.plan, self.dp_rank))

    def by_index(self) -> dict[int, Any]:
        return dict(zip(self.indices, self, strict=True))


class PlannedDataset:
    """Wraps a map-style dataset; batched fetches keep the batch sampler's plan."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

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
        if plan is None:
            return examples
        return PlannedExamples(examples, indices, plan, getattr(indices, "dp_rank", None))
