"""Plan + fetched examples -> a step of padded [b, L] micro-batches (torch tensors).

How the plan reaches the collator: the batch sampler yields a `PaddedStepPlan` (a list of
indices that is its own plan). `fetch.PlannedDataset.__getitems__` receives that object, fetches
the examples and returns them with the plan (`PlannedExamples`); `PaddedCollator` turns them into
a `PaddedBatch`. This works the same in the main process and in loader workers (the plan pickles
with its attributes).

Conventions: ``loss_mask[i]`` of a fetched example marks ``input_ids[i]`` as a training target.
Labels are the next token within the example, so the output ``loss_mask[t]`` is the example's
mask at ``t + 1``; the last real position and all padding have zero loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_packing.common.plan_types import PaddedStepPlan, StepMetadata
from megatron_packing.common.validation import require_int, require_positive_int
from megatron_packing.packing.microbatch import restore_input_order
from megatron_packing.stream.fetch import PlannedExamples


@dataclass
class PaddedMicroBatch:
    """b examples padded to a common length L (rows are examples, padding on the right)."""

    tokens: torch.Tensor  # [b, L] int64, pad_token_id after each example's end
    labels: torch.Tensor  # [b, L] int64, next token within the example; pad_token_id elsewhere
    loss_mask: torch.Tensor  # [b, L] float32, 1 where labels[:, t] is trained on
    attention_mask: torch.Tensor  # [b, L] bool, True on real tokens (causal masking is the model's)
    lengths: torch.Tensor  # [b] int64, real tokens per row
    position_ids: torch.Tensor  # [b, L] int64, 0..L-1 on every row
    example_indices: tuple[int, ...]  # dataset indices, row by row

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum().item())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def padded_tokens(self) -> int:
        return int(self.tokens.numel())


@dataclass
class PaddedBatch:
    """This rank's micro-batches for one step (``None`` = zero-loss dummy) and global metadata."""

    micro_batches: list[PaddedMicroBatch | None]
    meta: StepMetadata
    example_indices: tuple[int, ...] = ()  # this rank's examples in input (sampler) order
    schedule_positions: tuple[tuple[int, ...] | None, ...] = ()

    def __len__(self) -> int:
        return len(self.micro_batches)

    def restore_order(self, outputs: Sequence[Sequence[Any] | None]) -> list[Any]:
        """Per-micro-batch, per-row outputs (``None`` for dummies) -> one per example, input order."""
        return restore_input_order(
            range(len(self.example_indices)), list(self.schedule_positions), list(outputs)
        )


def _pad_rows(rows: list[np.ndarray], width: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for row, values in enumerate(rows):
        if len(values):
            out[row, : len(values)] = torch.as_tensor(values, dtype=dtype)
    return out


def collate_microbatch(
    examples: Sequence[dict[str, Any]],
    example_indices: Sequence[int],
    *,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
) -> PaddedMicroBatch:
    """Pad ``examples`` into one [b, L] micro-batch (L = longest, rounded up to the multiple)."""
    if not examples:
        raise ValueError("a micro-batch needs at least one example")
    ids = [np.asarray(example["input_ids"], dtype=np.int64).reshape(-1) for example in examples]
    masks = [np.asarray(example["loss_mask"]).reshape(-1).astype(np.float32) for example in examples]
    for number, (row_ids, mask) in enumerate(zip(ids, masks, strict=True)):
        if row_ids.shape != mask.shape:
            raise ValueError(
                f"example {example_indices[number]}: input_ids has {row_ids.size} tokens but "
                f"loss_mask has {mask.size}"
            )
    longest = max(1, max(tokens.size for tokens in ids))
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    tokens = _pad_rows(ids, width, pad_token_id, torch.int64)
    labels = _pad_rows([row[1:] for row in ids], width, pad_token_id, torch.int64)
    loss_mask = _pad_rows([row[1:] for row in masks], width, 0, torch.float32)
    lengths = torch.tensor([row.size for row in ids], dtype=torch.int64)
    positions = torch.arange(width, dtype=torch.int64).expand(len(ids), width).contiguous()
    return PaddedMicroBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=loss_mask,
        attention_mask=positions < lengths[:, None],
        lengths=lengths,
        position_ids=positions,
        example_indices=tuple(int(i) for i in example_indices),
    )


def make_dummy_microbatch(pad_token_id: int = 0, length: int = 1) -> PaddedMicroBatch:
    """A valid one-row micro-batch with zero loss: what a train step may run for a ``None``."""
    batch = collate_microbatch(
        [{"input_ids": np.full(length, pad_token_id), "loss_mask": np.zeros(length)}], [-1],
        pad_token_id=pad_token_id,
    )
    batch.example_indices = ()
    return batch


class PaddedCollator:
    """Fetched examples with their plan (`PlannedExamples`) -> `PaddedBatch`; never re-splits."""

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int = 1) -> None:
        self.pad_token_id = require_int("pad_token_id", pad_token_id, minimum=0)
        self.pad_to_multiple_of = require_positive_int("pad_to_multiple_of", pad_to_multiple_of)

    def __call__(self, fetched: PlannedExamples) -> PaddedBatch:
        if not isinstance(getattr(fetched, "plan", None), PaddedStepPlan):
            raise TypeError(
                "PaddedCollator needs the sampler's plan: wrap the dataset in PlannedDataset "
                "and use TokenBudgetBatchSampler as the loader's batch_sampler "
                f"(got {type(fetched).__name__})"
            )
        return self.collate(list(fetched), fetched.plan)

    def collate(self, examples: Sequence[dict[str, Any]], plan: PaddedStepPlan) -> PaddedBatch:
        if len(examples) != len(plan):
            raise ValueError(f"the plan lists {len(plan)} examples but {len(examples)} were fetched")
        micro_batches: list[PaddedMicroBatch | None] = []
        for group in plan.schedule_positions:
            if group is None:
                micro_batches.append(None)
                continue
            micro_batches.append(collate_microbatch(
                [examples[p] for p in group], [plan[p] for p in group],
                pad_token_id=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of,
            ))
        real = sum(plan.rank_real_microbatches)
        meta = StepMetadata(
            step=plan.step,
            epoch=plan.epoch,
            num_examples=plan.global_num_examples,
            num_tokens=plan.global_num_tokens,
            num_loss_tokens=plan.global_num_loss_tokens,
            num_bins=plan.microbatches_per_rank * plan.dp_size,
            num_padding_bins=plan.microbatches_per_rank * plan.dp_size - real,
            num_placeholder_bins=plan.microbatches_per_rank * plan.dp_size - real,
            micro_batches_per_rank=plan.microbatches_per_rank,
            token_fill=plan.pad_efficiency,
            dp_imbalance=plan.dp_imbalance,
            plan_ms=plan.plan_ms,
            aligned=plan.num_dummy_microbatches == 0,
            is_eval=getattr(plan, "is_eval", False),
            extra={
                "max_tokens_per_microbatch": float(plan.max_tokens or 0),
                "padded_tokens": float(plan.global_padded_tokens),
            },
        )
        return PaddedBatch(
            micro_batches=micro_batches,
            meta=meta,
            example_indices=tuple(int(i) for i in plan),
            schedule_positions=tuple(
                None if group is None else tuple(group) for group in plan.schedule_positions
            ),
        )


__all__ = [
    "PaddedBatch",
    "PaddedCollator",
    "PaddedMicroBatch",
    "collate_microbatch",
    "make_dummy_microbatch",
]
