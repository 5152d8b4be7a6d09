"""A step's micro-batches as megatron-core's schedules take them, for both Megatron hosts.

Packed rows go in as planned, except under pipeline parallelism, where every micro-batch of a
step must have one shape: rows are padded to the step's longest row (the padding carries no
loss). Padded-mode blocks keep their own widths, rounded up to the sequence-parallel split;
a rank with fewer blocks than the step's count runs one-row dummies that train no token.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megatron_packing.megatron.forward import pad_row
from megatron_packing.packed.collate import PackedBatch, PackedMicroBatch
from megatron_packing.padded.collate import PaddedBatch, PaddedMicroBatch, make_dummy_microbatch


def step_rows(batch: PackedBatch | PaddedBatch, *, pipeline: bool, pad_token_id: int,
              width_multiple: int = 1) -> tuple[list[PackedMicroBatch | PaddedMicroBatch], int]:
    """This step's micro-batches and the sequence length the schedule is given for them.

    Padded mode: a ``None`` (this rank has fewer micro-batches than the step's count) becomes a
    one-row dummy that trains no token, and each block's width is rounded up to
    ``width_multiple`` (the TP size under sequence parallelism, which splits the sequence).
    """
    if isinstance(batch, PaddedBatch):
        if pipeline:
            raise RuntimeError("padded mode cannot run pipeline stages (refused at start-up)")
        blocks = [make_dummy_microbatch(pad_token_id, width_multiple) if mb is None
                  else widen_block(mb, width_multiple, pad_token_id)
                  for mb in batch.micro_batches]
        return list(blocks), max(int(mb.tokens.shape[1]) for mb in blocks)
    rows: list[PackedMicroBatch | PaddedMicroBatch] = list(batch.micro_batches)
    seq_length = max(int(row.tokens.shape[1]) for row in rows)
    if pipeline:  # stages exchange activations of one fixed shape per step
        rows = [pad_row(row, seq_length, pad_token_id) for row in batch.micro_batches]
    return rows, seq_length


def widen_block(mb: PaddedMicroBatch, multiple: int, pad_token_id: int) -> PaddedMicroBatch:
    """``mb`` with its width rounded up to a multiple of ``multiple`` (padding, no loss)."""
    width = int(mb.tokens.shape[1])
    extra = -width % multiple
    if extra == 0:
        return mb

    def grow(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.cat([t, torch.full((t.shape[0], extra), value, dtype=t.dtype)], dim=1)

    positions = torch.arange(width + extra, dtype=mb.position_ids.dtype)
    return replace(mb, tokens=grow(mb.tokens, pad_token_id), labels=grow(mb.labels, pad_token_id),
                   loss_mask=grow(mb.loss_mask, 0.0),
                   attention_mask=grow(mb.attention_mask, False),
                   position_ids=positions.expand(mb.tokens.shape[0], -1).contiguous())
