"""A packed micro-batch -> what megatron-core attention needs to keep sequences apart.

On GPUs: a THD `PackedSeqParams` (Transformer Engine attention reads ``cu_seqlens``).
On CPU, where megatron-core's local attention cannot read THD metadata: the exact equivalent,
a block-diagonal causal boolean mask built from ``cu_seqlens_padded`` plus position ids that
restart at every sequence. Both keep attention from leaking across packed sequences.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from megatron_packing.common.validation import require_int
from megatron_packing.packed.collate import PackedMicroBatch

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


def default_device() -> torch.device:
    """The current CUDA device when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _as_int(value: int | torch.Tensor, name: str) -> int:
    """A plain int >= 0 from an int or a one-element integer tensor (Megatron-LM sends
    ``max_seqlen`` as [1])."""
    plain: object = value
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {tuple(value.shape)}")
        plain = value.reshape(-1)[0].item()
    number = require_int(name, plain, minimum=0, error=ValueError)
    assert number is not None  # allow_none is off
    return number


def packed_seq_params(source: PackedMicroBatch | Mapping[str, Any],
                      device: torch.device | str | None = None) -> PackedSeqParams:
    """THD `PackedSeqParams` for one row: real and padded boundaries, one max length for q and kv.

    ``source`` is a `PackedMicroBatch` or a batch dict with ``cu_seqlens``, ``max_seqlen`` (an
    int or a one-element int32 tensor, as in `lm_batch.to_megatron_lm_batch`) and optionally
    ``cu_seqlens_padded`` (default: the real boundaries). Boundaries become 1-D int32, the
    shape TE reads, on ``device`` (default: the current CUDA device if any, else the CPU).

    Where this megatron-core's `PackedSeqParams` has them (0.19), the row-level fields are
    filled too: ``total_tokens`` is the row's length T (the last padded boundary), from which
    megatron-core derives ``seq_idx`` (each token's padded-segment index, for Mamba);
    ``tokens_per_sample`` is T as well (one row per micro-batch, so the MoE sequence-level aux
    loss sees the row as one sample); ``pad_between_seqs`` says whether any sequence carries
    alignment padding (the real and padded boundaries differ), which TE's THD attention needs.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_packing.megatron.compat import packed_seq_params_fields

    if isinstance(source, PackedMicroBatch):
        cu, cu_padded, max_seqlen = source.cu_seqlens, source.cu_seqlens_padded, source.max_seqlen
    else:
        for key in ("cu_seqlens", "max_seqlen"):
            if source.get(key) is None:
                raise ValueError(f"batch has no {key!r}; a THD batch needs cu_seqlens and max_seqlen")
        cu, max_seqlen = source["cu_seqlens"], source["max_seqlen"]
        padded = source.get("cu_seqlens_padded")
        cu_padded = cu if padded is None else padded
    device = default_device() if device is None else device
    cu = cu.reshape(-1)
    cu_padded = cu_padded.reshape(-1)
    if cu.numel() != cu_padded.numel():
        raise ValueError(f"cu_seqlens has {cu.numel()} entries, cu_seqlens_padded "
                         f"{cu_padded.numel()}: they must match")
    longest = _as_int(max_seqlen, "max_seqlen")
    row_fields: dict[str, Any] = {}
    if "total_tokens" in packed_seq_params_fields():  # megatron-core 0.19
        total = int(cu_padded[-1]) if cu_padded.numel() else 0
        row_fields = {"total_tokens": total, "tokens_per_sample": total,
                      "pad_between_seqs": not torch.equal(cu.to(torch.int64),
                                                          cu_padded.to(torch.int64))}
    cu = cu.to(device=device, dtype=torch.int32)
    cu_padded = cu_padded.to(device=device, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        **row_fields,
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
