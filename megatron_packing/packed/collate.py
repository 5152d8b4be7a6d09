"""Plan + fetched examples -> a step of packed micro-batches (THD layout, torch tensors).

With the stateful sampler (the fast path) the collator neither packs nor lays out: the plan
already says which examples share a bin and where each goes in its row (`RowLayout`). Given a
plain list of examples and no plan (a sampler of the user's own), a collator built with a
`PackingConfig` plans that one step itself (`given_step.plan_given_step`: the same packer factory,
alignment, rounding to dp and hand-out) and then writes it the same way. One bin becomes one
micro-batch. A rank whose share of the step holds fewer real bins than the step's micro-batch
count receives placeholder rows: valid, minimal-length rows with zero loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megatron_packing.common.plan_types import RowLayout, StepMetadata
from megatron_packing.common.validation import require_int, require_positive_int
from megatron_packing.packed.given_step import plan_given_step
from megatron_packing.stream.fetch import FetchedExampleError

if TYPE_CHECKING:
    from megatron_packing.config import PackingConfig


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
    """Writes a step's fetched examples into this rank's `PackedBatch`.

    Examples are mappings with ``input_ids`` and, optionally, ``loss_mask`` (1 on tokens the
    model should learn to produce; absent means every token). The label at position t is the
    next token of the same sequence, trained on when the mask marks that next token.

    - Examples fetched with a `DPAlignedPackingBatchSampler` plan (`PlannedDataset`): each goes
      where the plan lays it out; the collator computes no lengths, and refuses an example whose
      token count differs from the one planned.
    - A plain list of examples (any batch sampler): with ``packing`` (its packer, alignment,
      oversize policy, rank assignment and cost model) the collator packs them itself, in one
      step of exactly these examples; with ``dp_size`` the bin count is a multiple of dp (empty
      bins become zero-loss placeholder rows) and ``dp_rank`` keeps that rank's bins (None: all).
      ``micro_batch.example_indices`` then are positions in the list.
    """

    def __init__(self, pad_token_id: int = 0, *, packing: PackingConfig | None = None,
                 dp_size: int = 1, dp_rank: int | None = None) -> None:
        self.pad_token_id = require_int("pad_token_id", pad_token_id, minimum=0, error=ValueError)
        self.packing = packing
        self.dp_size = require_positive_int("dp_size", dp_size, error=ValueError)
        self.dp_rank = require_int("dp_rank", dp_rank, minimum=0, maximum=self.dp_size - 1,
                                   allow_none=True, error=ValueError)

    def __call__(self, fetched: Any) -> PackedBatch:
        plan = getattr(fetched, "plan", None)
        if plan is None:
            return self._pack_given(fetched)
        rank = fetched.dp_rank
        ids = range(plan.num_bins) if rank is None else plan.rank_bins[rank]
        rows = [(plan.bins[b], plan.layouts[b]) for b in ids]
        micro_batches = self._fill(rows, fetched.by_index(), plan.truncated)
        return PackedBatch(micro_batches=micro_batches, meta=step_metadata(plan))

    def _pack_given(self, examples: Any) -> PackedBatch:
        """A plain list of examples, planned here as one step (see the class docstring)."""
        if self.packing is None:
            raise TypeError(
                "PackedCollator got examples without a plan: build it with "
                "PackedCollator(packing=PackingConfig(...), dp_size=..., dp_rank=...) to pack "
                "them itself, or fetch them through PlannedDataset with a "
                "DPAlignedPackingBatchSampler (the plan travels with the indices)")
        given = list(examples)
        for position, example in enumerate(given):
            if not isinstance(example, Mapping) or "input_ids" not in example:
                raise TypeError(f"PackedCollator: example {position} is a "
                                f"{type(example).__name__} without input_ids; give mappings "
                                "with input_ids (and loss_mask)")
        lengths = [len(example["input_ids"]) for example in given]
        plan = plan_given_step(lengths, None, packer=self.packing.packer,
                               planner=self.packing.planner, dp_size=self.dp_size)
        counts = [_targets(example, plan.truncated.get(i, lengths[i]))
                  for i, example in enumerate(given)]
        plan = replace(plan, num_loss_tokens=sum(counts))
        ids = range(plan.num_bins) if self.dp_rank is None else plan.rank_bins[self.dp_rank]
        rows = [(plan.bins[b], plan.layouts[b]) for b in ids]
        micro_batches = self._fill(rows, dict(enumerate(given)), plan.truncated)
        return PackedBatch(micro_batches=micro_batches, meta=step_metadata(plan))

    def _fill(self, rows: list[tuple[tuple[int, ...], RowLayout]], examples: dict[int, Any],
              truncated: dict[int, int]) -> list[PackedMicroBatch]:
        """Write every row into three step-wide buffers; each micro-batch is a view into them.

        Few storages per step keep the hand-off from loader workers cheap: tensors cross
        processes one storage at a time, so per-row tensors would cost far more.
        """
        if not rows:
            return []
        layouts = [layout for _, layout in rows]
        counts = np.fromiter((len(layout.segments) for layout in layouts), np.int64, len(rows))
        segments = np.fromiter(chain.from_iterable(layout.segments for layout in layouts),
                               np.int64, int(counts.sum()))
        real = np.fromiter(chain.from_iterable(layout.real for layout in layouts), np.int64,
                           len(segments))
        ends = np.cumsum(segments)  # rows lie end to end: segment ends over the whole step
        starts = ends - segments
        total = int(ends[-1])
        ints = np.empty((3, total), dtype=np.int64)  # tokens, labels, position ids
        ints[:2] = self.pad_token_id
        ints[2] = np.arange(total) - np.repeat(starts, segments)  # restart in every segment
        loss = np.zeros(total, dtype=np.float32)
        first = np.cumsum(counts) - counts  # each row's first segment
        row_of = np.repeat(np.arange(len(rows)), counts)  # each segment's row
        row_start, row_end = starts[first], ends[first + counts - 1]
        # Row r's n + 1 boundaries take slots first[r] + r ...: a 0, then its cumulative lengths.
        cu = np.zeros((2, len(segments) + len(rows)), dtype=np.int32)  # real and padded
        at = np.arange(len(segments)) + row_of + 1
        real_ends = np.cumsum(real)
        cu[0, at] = real_ends - (real_ends - real)[first][row_of]
        cu[1, at] = ends - row_start[row_of]
        seg_starts = starts.tolist()
        for (indices, layout), k in zip(rows, first.tolist(), strict=True):
            for j, index in enumerate(indices):
                self._write(examples[index], index, layout.real[j], index in truncated,
                            seg_starts[k + j], ints, loss)
        ints_t, loss_t, cu_t = torch.from_numpy(ints), torch.from_numpy(loss), torch.from_numpy(cu)
        out = []
        for (indices, layout), a, b, c, n in zip(rows, row_start.tolist(), row_end.tolist(),
                                                 (first + np.arange(len(rows))).tolist(),
                                                 counts.tolist(), strict=True):
            out.append(PackedMicroBatch(
                tokens=ints_t[0, a:b].unsqueeze(0),
                labels=ints_t[1, a:b].unsqueeze(0),
                loss_mask=loss_t[a:b].unsqueeze(0),
                position_ids=ints_t[2, a:b].unsqueeze(0),
                cu_seqlens=cu_t[0, c:c + n + 1],
                cu_seqlens_padded=cu_t[1, c:c + n + 1],
                max_seqlen=max(layout.segments),
                example_indices=indices,
                is_placeholder=not indices,
            ))
        return out

    @staticmethod
    def _write(example: Any, index: int, keep: int, was_truncated: bool, start: int,
               ints: np.ndarray, loss: np.ndarray) -> None:
        """One sequence's tokens, next-token labels and loss mask, at its planned segment."""
        ids = np.asarray(example["input_ids"])
        fetched = len(ids)
        # A truncated example may be any length from the kept one up; the rest must match.
        if (fetched < keep) if was_truncated else (fetched != keep):
            planned = (f"the first {keep} of its tokens (oversize_policy 'truncate')"
                       if was_truncated else f"{keep} tokens, its length when planned")
            raise FetchedExampleError(
                f"dataset example {index}: the step's plan laid out {planned}, but {fetched} "
                "tokens were fetched; the data changed after its lengths were read for planning: "
                "restart so that the plans are made from the current data (rebuild its length "
                "index, if it has one)")
        end = start + keep
        ints[0, start:end] = ids[:keep]
        ints[1, start:end - 1] = ids[1:keep]
        mask = example.get("loss_mask") if isinstance(example, dict) else None
        loss[start:end - 1] = 1 if mask is None else np.asarray(mask)[1:keep]


def _targets(example: Any, keep: int) -> int:
    """Positions t >= 1 of the first ``keep`` tokens whose label is trained on."""
    mask = example.get("loss_mask")
    return keep - 1 if mask is None else int(np.asarray(mask)[1:keep].sum())


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
        evened=plan.evened,
    )
