"""Plan + fetched examples -> a step of packed micro-batches (THD layout, torch tensors).

The collator never packs: the sampler's plan already says which examples share a bin. One bin
becomes one micro-batch. A rank whose share of the step holds fewer real bins than the step's
micro-batch count receives placeholder rows: valid, minimal-length rows with zero loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Unpack

import numpy as np
import torch

from megatron_packing.common.plan_types import StepMetadata
from megatron_packing.common.validation import require_positive_int
from megatron_packing.config.components import CollatorConfig, config_or_keywords
from megatron_packing.config.keywords import CollatorKeywords
from megatron_packing.packing.alignment import Alignment


@dataclass
class PackedMicroBatch:
    """One bin in THD layout: sequences laid end to end in a single row.

    ``cu_seqlens`` holds the real (unpadded) sequence boundaries; ``cu_seqlens_padded`` holds
    the padded ones, and its last entry is the row length. Sequence ``i`` occupies
    ``tokens[0, cu_seqlens_padded[i] : cu_seqlens_padded[i] + (cu_seqlens[i+1] - cu_seqlens[i])]``;
    the rest of its padded segment is padding with zero loss.
    """

    tokens: torch.Tensor  # [1, T] int64
    labels: torch.Tensor  # [1, T] int64, next token within the same sequence
    loss_mask: torch.Tensor  # [1, T] float32, 1 where labels[t] is trained on
    position_ids: torch.Tensor  # [1, T] int64, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32
    cu_seqlens_padded: torch.Tensor  # [n + 1] int32
    max_seqlen: int  # longest padded sequence in the row
    example_indices: tuple[int, ...] = ()  # dataset indices; empty for a placeholder row
    is_placeholder: bool = False

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens in the row."""
        return int(self.cu_seqlens[-1].item()) if not self.is_placeholder else 0


@dataclass
class PackedBatch:
    """This rank's micro-batches for one step, plus the step's global metadata."""

    micro_batches: list[PackedMicroBatch]
    meta: StepMetadata

    def __len__(self) -> int:
        return len(self.micro_batches)


class PackedCollator:
    """Turns a planned step's fetched examples into this rank's `PackedBatch`.

    Examples are mappings with ``input_ids`` and, optionally, ``loss_mask`` (1 on tokens the
    model should learn to produce; absent means every token). The label at position t is the
    next token of the same sequence, trained on when the mask marks that next token.
    """

    def __init__(
        self,
        alignment: Alignment,
        bin_capacity: int,
        *,
        config: CollatorConfig | None = None,
        **settings: Unpack[CollatorKeywords],
    ) -> None:
        """Rows follow ``alignment`` within ``bin_capacity`` tokens; ``config`` (or its fields as
        keywords: ``pad_token_id``, ``pad_bins_to_capacity``) says how they are padded."""
        config = config_or_keywords(CollatorConfig, config, settings, owner="PackedCollator")
        self.config = config
        self.alignment = alignment
        self.bin_capacity = require_positive_int("bin_capacity", bin_capacity)
        self.pad_token_id = config.pad_token_id
        self.pad_bins_to_capacity = config.pad_bins_to_capacity
        config.check_rows(alignment, self.bin_capacity)

    def __call__(self, fetched: Any) -> PackedBatch:
        plan = getattr(fetched, "plan", None)
        if plan is None:
            raise TypeError(
                "PackedCollator needs examples fetched through PlannedDataset with a "
                "DPAlignedPackingBatchSampler (the plan travels with the indices)"
            )
        examples = fetched.by_index()
        rank = fetched.dp_rank
        bins = plan.bins if rank is None else plan.bins_of_rank(rank)
        rows = [self._layout(b, examples, plan.truncated) for b in bins]
        return PackedBatch(micro_batches=self._fill(rows), meta=step_metadata(plan))

    def _layout(self, indices: tuple[int, ...], examples: dict[int, Any],
                truncated: dict[int, int]) -> _RowLayout:
        """Where each sequence of a bin goes in its row (a placeholder row when it is empty)."""
        align = self.alignment
        if not indices:
            length = -(-align.padded_length(1) // align.bin_multiple) * align.bin_multiple
            if self.pad_bins_to_capacity:
                length = max(length, self.bin_capacity)
            return _RowLayout((), [], np.array([1]), np.array([length]))
        sequences = []
        for index in indices:
            example = examples[index]
            ids = np.asarray(example["input_ids"], dtype=np.int64)
            mask = example.get("loss_mask") if isinstance(example, dict) else None
            mask = np.ones(len(ids), dtype=np.float32) if mask is None else np.asarray(mask, dtype=np.float32)
            keep = truncated.get(index, len(ids))
            sequences.append((ids[:keep], mask[:keep]))
        real = np.array([len(ids) for ids, _ in sequences], dtype=np.int64)
        padded = np.array([align.padded_length(int(n)) for n in real], dtype=np.int64)
        total = int(padded.sum())
        row_length = -(-total // align.bin_multiple) * align.bin_multiple
        if self.pad_bins_to_capacity:
            row_length = max(row_length, self.bin_capacity)
        padded[-1] += row_length - total  # the aggregate padding is paid once, by the last segment
        return _RowLayout(tuple(int(i) for i in indices), sequences, real, padded)

    def _fill(self, rows: list[_RowLayout]) -> list[PackedMicroBatch]:
        """Write every row into three step-wide buffers; each micro-batch is a view into them.

        Few storages per step keep the hand-off from loader workers cheap: tensors cross
        processes one shared storage at a time, so per-row tensors would cost far more.
        """
        lengths = [int(row.padded.sum()) for row in rows]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        seq_counts = [len(row.padded) + 1 for row in rows]
        seq_offsets = np.concatenate(([0], np.cumsum(seq_counts))).astype(np.int64)
        total = int(offsets[-1])
        ints = np.empty((3, total), dtype=np.int64)  # tokens, labels, position ids
        ints[:2] = self.pad_token_id
        loss = np.zeros(total, dtype=np.float32)
        cu = np.empty((2, int(seq_offsets[-1])), dtype=np.int32)  # real and padded boundaries
        for row, base, cu_base in zip(rows, offsets[:-1], seq_offsets[:-1], strict=True):
            starts = base + np.concatenate(([0], np.cumsum(row.padded)[:-1]))
            for start, seg in zip(starts, row.padded, strict=True):
                ints[2, start:start + seg] = np.arange(seg)
            for (ids, mask), start in zip(row.sequences, starts[: len(row.sequences)], strict=True):
                n = len(ids)
                ints[0, start:start + n] = ids
                ints[1, start:start + n - 1] = ids[1:]
                loss[start:start + n - 1] = mask[1:]
            count = len(row.padded) + 1
            cu[0, cu_base:cu_base + count] = np.concatenate(([0], np.cumsum(row.real)))
            cu[1, cu_base:cu_base + count] = np.concatenate(([0], np.cumsum(row.padded)))
        ints_t, loss_t, cu_t = torch.from_numpy(ints), torch.from_numpy(loss), torch.from_numpy(cu)
        out = []
        for row, a, b, c in zip(rows, offsets[:-1], offsets[1:], seq_offsets[:-1], strict=True):
            d = c + len(row.padded) + 1
            out.append(PackedMicroBatch(
                tokens=ints_t[0, a:b].unsqueeze(0),
                labels=ints_t[1, a:b].unsqueeze(0),
                loss_mask=loss_t[a:b].unsqueeze(0),
                position_ids=ints_t[2, a:b].unsqueeze(0),
                cu_seqlens=cu_t[0, c:d],
                cu_seqlens_padded=cu_t[1, c:d],
                max_seqlen=int(row.padded.max()),
                example_indices=row.indices,
                is_placeholder=not row.indices,
            ))
        return out


@dataclass
class _RowLayout:
    """One bin's sequences and their real and padded lengths (a placeholder has none)."""

    indices: tuple[int, ...]
    sequences: list[tuple[np.ndarray, np.ndarray]]
    real: np.ndarray
    padded: np.ndarray


def step_metadata(plan: Any) -> StepMetadata:
    """The step's global metadata, read from the shared plan (no communication)."""
    return StepMetadata(
        step=plan.step,
        epoch=plan.epoch,
        num_examples=plan.num_examples,
        num_tokens=plan.num_tokens,
        num_loss_tokens=plan.num_loss_tokens,
        num_bins=plan.num_bins,
        num_padding_bins=plan.padding_bins,
        num_placeholder_bins=plan.placeholder_bins,
        micro_batches_per_rank=plan.micro_batches_per_rank,
        token_fill=plan.token_fill,
        dp_imbalance=plan.dp_imbalance,
        plan_ms=plan.plan_ms,
        aligned=plan.aligned,
        is_eval=plan.is_eval,
    )
