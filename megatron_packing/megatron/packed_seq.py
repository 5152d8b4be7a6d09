"""A packed micro-batch -> what megatron-core attention needs to keep sequences apart.

On GPUs: a THD `PackedSeqParams` (Transformer Engine attention reads ``cu_seqlens``).
On CPU, where megatron-core's local attention cannot read THD metadata: the exact equivalent,
a block-diagonal causal boolean mask built from ``cu_seqlens_padded`` plus position ids that
restart at every sequence. Both keep attention from leaking across packed sequences.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_packing.collate import PackedMicroBatch

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


def packed_seq_params(mb: PackedMicroBatch, device: torch.device | str | None = None) -> PackedSeqParams:
    """THD `PackedSeqParams` for one row: real and padded boundaries, one max length for q and kv."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb.cu_seqlens.to(device=device, dtype=torch.int32)
    cu_padded = mb.cu_seqlens_padded.to(device=device, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=int(mb.max_seqlen),
        max_seqlen_kv=int(mb.max_seqlen),
    )


def segment_ids(cu_seqlens_padded: torch.Tensor, total_len: int) -> torch.Tensor:
    """[T] int64: which padded segment each position belongs to (positions past the end: -1)."""
    bounds = cu_seqlens_padded.to(torch.int64)
    positions = torch.arange(total_len, dtype=torch.int64)
    ids = torch.bucketize(positions, bounds[1:], right=True)
    ids[positions >= bounds[-1]] = -1
    return ids


def block_diagonal_causal_mask(cu_seqlens_padded: torch.Tensor, total_len: int) -> torch.Tensor:
    """[1, 1, T, T] bool, True where attention is forbidden (megatron-core's convention).

    Query t may attend key s only if s <= t and both lie in the same padded segment. Padding
    sits after the real tokens of its segment, so causality already hides it from them.
    """
    seg = segment_ids(cu_seqlens_padded, total_len)
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    causal = torch.ones(total_len, total_len, dtype=torch.bool).tril()
    allowed = same & causal
    # A position outside every segment attends to itself only, so its softmax stays finite.
    allowed |= torch.eye(total_len, dtype=torch.bool)
    return (~allowed)[None, None]


def restarting_position_ids(cu_seqlens_padded: torch.Tensor, total_len: int) -> torch.Tensor:
    """[1, T] int64: 0, 1, 2, ... restarting at every padded segment start."""
    bounds = cu_seqlens_padded.to(torch.int64)
    seg = segment_ids(cu_seqlens_padded, total_len).clamp(min=0)
    return (torch.arange(total_len, dtype=torch.int64) - bounds[seg])[None]


def causal_mask(total_len: int) -> torch.Tensor:
    """[1, 1, T, T] bool causal mask for a row holding a single sequence."""
    return ~torch.ones(total_len, total_len, dtype=torch.bool).tril()[None, None]
