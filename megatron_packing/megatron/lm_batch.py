"""Packed rows in the batch formats Megatron-LM and Megatron-Bridge read, plus TP and CP plumbing.

* `to_megatron_lm_batch`: the dict ``pretrain_gpt.get_batch`` unpacks for THD rows.
* `broadcast_batch_across_tp`: TP rank 0 sends that dict to its TP peers, variable row length
  and sequence count included, keeping ``cu_seqlens_padded`` (Megatron-LM's own
  ``get_batch_on_this_tp_rank`` drops it, which mis-segments rows with alignment padding).
* `cp_partition_indices` / `batch_for_cp_rank` / `merge_cp_slices`: load-balanced THD slicing of
  one row across context-parallel ranks, and its inverse.
* `to_bridge_packed_batch`: Megatron-Bridge's opt-in packed keys (``-1``-padded boundaries).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_packing.packed.collate import PackedMicroBatch

# What the TP broadcast returns, in this order: ``get_batch`` pops the THD keys and returns
# ``(*batch.values(), params)`` as (tokens, labels, loss_mask, attention_mask, position_ids).
LM_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids",
                 "cu_seqlens", "cu_seqlens_padded", "max_seqlen")
# What the data iterator yields: no ``attention_mask`` key, because Megatron-LM's
# ``get_batch_on_this_tp_rank`` calls ``.cuda()`` on it whenever the key is present.
LM_ITERATOR_KEYS = tuple(k for k in LM_BATCH_KEYS if k != "attention_mask")
_ROW_DTYPES = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
               "position_ids": torch.int64}
_BOUNDARY_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
# Keys that describe the whole row and are never sliced along the sequence (as megatron-core).
_UNSLICED_KEYS = frozenset({"attention_mask", *_BOUNDARY_KEYS})


def _check_row(mb: PackedMicroBatch) -> int:
    """Row length T after checking the micro-batch is one THD row whose boundaries fit it."""
    if mb.tokens.dim() != 2 or mb.tokens.shape[0] != 1:
        raise ValueError(f"tokens must be [1, T] (one packed row), got shape {tuple(mb.tokens.shape)}")
    total = int(mb.tokens.shape[1])
    for name in ("labels", "loss_mask", "position_ids"):
        shape = tuple(getattr(mb, name).shape)
        if shape != (1, total):
            raise ValueError(f"{name} must have the tokens' shape (1, {total}), got {shape}")
    n_real, n_padded = mb.cu_seqlens.numel(), mb.cu_seqlens_padded.numel()
    if n_real != n_padded or n_real < 2:
        raise ValueError(f"cu_seqlens ({n_real} entries) and cu_seqlens_padded ({n_padded}) must "
                         "both hold n + 1 >= 2 boundaries")
    if int(mb.cu_seqlens_padded.reshape(-1)[-1]) != total:
        raise ValueError(f"cu_seqlens_padded ends at {int(mb.cu_seqlens_padded.reshape(-1)[-1])}, "
                         f"the row holds {total} tokens: they must be equal")
    return total


def to_megatron_lm_batch(mb: PackedMicroBatch, device: torch.device | str | None = None
                         ) -> dict[str, torch.Tensor]:
    """One packed row as Megatron-LM's data iterator yields it (THD path, micro-batch size 1).

    tokens / labels / position_ids ``[1, T]`` int64, loss_mask ``[1, T]`` float32,
    ``cu_seqlens`` and ``cu_seqlens_padded`` ``[1, n + 1]`` int32 (``get_batch_on_this_tp_rank``
    asserts int32 and a leading dimension of 1), ``max_seqlen`` ``[1]`` int32 (``get_batch``
    asserts one dimension and reads ``max_seqlen[0]``). No ``attention_mask`` key: the TP step
    sets it to None (TE builds the causal THD mask from the boundaries); a None value under
    that key would crash Megatron-LM's own TP step. `broadcast_batch_across_tp` turns this
    into ``get_batch``'s layout, `LM_BATCH_KEYS`.
    """
    _check_row(mb)

    def put(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    return {
        "tokens": put(mb.tokens, torch.int64),
        "labels": put(mb.labels, torch.int64),
        "loss_mask": put(mb.loss_mask, torch.float32),
        "position_ids": put(mb.position_ids, torch.int64),
        "cu_seqlens": put(mb.cu_seqlens.reshape(1, -1), torch.int32),
        "cu_seqlens_padded": put(mb.cu_seqlens_padded.reshape(1, -1), torch.int32),
        "max_seqlen": torch.tensor([int(mb.max_seqlen)], dtype=torch.int32, device=device),
    }


# ----------------------------------------------------------------------------- TP broadcast

def _tp_group_and_src(group: dist.ProcessGroup | None, src_rank: int | None
                      ) -> tuple[dist.ProcessGroup, int]:
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        if src_rank is None:
            src_rank = parallel_state.get_tensor_model_parallel_src_rank()
    if src_rank is None:
        src_rank = dist.get_global_rank(group, 0)
    return group, src_rank


def _wire_device(group: dist.ProcessGroup) -> torch.device:
    """NCCL moves CUDA tensors only; gloo (and the rest) move CPU tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_lm_batch(batch: Mapping[str, Any]) -> None:
    extra = sorted(set(batch) - set(LM_BATCH_KEYS))
    if extra:
        raise ValueError(f"broadcast_batch_across_tp carries only {LM_BATCH_KEYS}; the batch also "
                         f"holds {extra}: send those separately or drop them before the call")
    missing = [k for k in LM_BATCH_KEYS if k not in batch and k != "attention_mask"]
    if missing:
        raise ValueError(f"batch lacks {missing}; build it with to_megatron_lm_batch")
    total = int(batch["tokens"].shape[-1])
    for key, dtype in _ROW_DTYPES.items():
        t = batch[key]
        if t.dtype != dtype or tuple(t.shape) != (1, total):
            raise ValueError(f"batch[{key!r}] is {t.dtype} {tuple(t.shape)}; expected {dtype} "
                             f"(1, {total}) as to_megatron_lm_batch builds it")
    for key in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
        if batch[key].dtype != torch.int32:
            raise ValueError(f"batch[{key!r}] is {batch[key].dtype}; expected torch.int32")
    if batch["cu_seqlens"].numel() != batch["cu_seqlens_padded"].numel():
        raise ValueError("cu_seqlens and cu_seqlens_padded must hold the same number of entries")
    if batch["max_seqlen"].numel() != 1:
        raise ValueError(f"max_seqlen must hold one value, got shape {tuple(batch['max_seqlen'].shape)}")
    mask = batch.get("attention_mask")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (1, 1, total, total)):
        raise ValueError(f"attention_mask must be None or bool (1, 1, {total}, {total}); got "
                         f"{mask.dtype} {tuple(mask.shape)}")


def broadcast_batch_across_tp(batch: Mapping[str, Any] | None,
                              group: dist.ProcessGroup | None = None,
                              src_rank: int | None = None) -> dict[str, torch.Tensor | None]:
    """Give every rank of a tensor-parallel group the batch its source rank holds.

    The source passes a `to_megatron_lm_batch` dict (optionally with a boolean
    ``attention_mask``), the others pass None; all get ``get_batch``'s layout `LM_BATCH_KEYS`.
    A header ``[T, n + 1, has_mask]`` goes first, so rows may change length and sequence count
    every micro-batch; then up to four payload broadcasts (int64 rows, loss mask, int32 boundaries with
    ``max_seqlen`` and, when present, the boolean mask). ``cu_seqlens_padded`` and ``max_seqlen``
    arrive on every rank. Defaults: megatron-core's TP group and its source rank (a global rank).
    Tensors come back on the device the group's backend moves (CUDA for NCCL, else CPU).
    """
    group, src_rank = _tp_group_and_src(group, src_rank)
    device = _wire_device(group)
    is_src = dist.get_rank() == src_rank
    if is_src:
        if batch is None:
            raise ValueError(f"rank {src_rank} is the TP source and must pass a batch, not None")
        _check_lm_batch(batch)
        mask = batch.get("attention_mask")
        total, n_cu = int(batch["tokens"].shape[1]), int(batch["cu_seqlens"].numel())
        header = torch.tensor([total, n_cu, int(mask is not None)], dtype=torch.int64, device=device)
    else:
        header = torch.empty(3, dtype=torch.int64, device=device)
    dist.broadcast(header, src_rank, group=group)
    total, n_cu, has_mask = (int(v) for v in header.tolist())

    if is_src:
        assert batch is not None  # refused above on the source rank
        rows = torch.cat([batch["tokens"], batch["labels"], batch["position_ids"]]).to(device)
        loss_mask = batch["loss_mask"].to(device)
        bounds = torch.cat([batch["cu_seqlens"].reshape(-1), batch["cu_seqlens_padded"].reshape(-1),
                            batch["max_seqlen"].reshape(-1)]).to(device)
        attention_mask = batch["attention_mask"].to(device) if has_mask else None
    else:
        rows = torch.empty(3, total, dtype=torch.int64, device=device)
        loss_mask = torch.empty(1, total, dtype=torch.float32, device=device)
        bounds = torch.empty(2 * n_cu + 1, dtype=torch.int32, device=device)
        attention_mask = (torch.empty(1, 1, total, total, dtype=torch.bool, device=device)
                          if has_mask else None)
    for payload in (rows, loss_mask, bounds, attention_mask):
        if payload is not None:
            dist.broadcast(payload, src_rank, group=group)

    return {
        "tokens": rows[0:1], "labels": rows[1:2], "loss_mask": loss_mask,
        "attention_mask": attention_mask, "position_ids": rows[2:3],
        "cu_seqlens": bounds[:n_cu].reshape(1, n_cu),
        "cu_seqlens_padded": bounds[n_cu:2 * n_cu].reshape(1, n_cu),
        "max_seqlen": bounds[2 * n_cu:],
    }


# ----------------------------------------------------------------------------- CP partitioning

def cp_partition_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
                         ) -> torch.Tensor:
    """Row positions CP rank ``cp_rank`` keeps, in the order it keeps them (int64).

    The convention of Transformer Engine's ``thd_get_partitioned_indices`` (what megatron-core's
    ``get_thd_batch_on_this_cp_rank`` calls): every padded sequence of length L is cut into
    ``2 * cp_size`` chunks of ``L / (2 * cp_size)``; rank r keeps chunk r then chunk
    ``2 * cp_size - 1 - r``, sequence after sequence. Pairing an early chunk with a late one
    balances causal-attention work. Every L must divide by ``2 * cp_size``.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"need cp_size >= 1 and 0 <= cp_rank < cp_size; got cp_size={cp_size}, "
                         f"cp_rank={cp_rank}")
    bounds = cu_seqlens_padded.reshape(-1).to(device="cpu", dtype=torch.int64)
    if bounds.numel() < 1 or int(bounds[0]) != 0:
        raise ValueError(f"cu_seqlens_padded must start at 0; got {bounds.tolist()[:4]}...")
    lengths = bounds[1:] - bounds[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens_padded must not decrease; got {bounds.tolist()}")
    granule = 2 * cp_size
    bad = (lengths % granule).nonzero().reshape(-1)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"padded sequence {i} has length {int(lengths[i])}, not a multiple of "
                         f"2 * cp_size = {granule}; pack with cp_size={cp_size} so the alignment "
                         f"pads every sequence to a multiple of {granule}")
    chunk = lengths // granule  # per sequence
    per_rank = 2 * chunk
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), per_rank)
    # Offset of each kept position within its sequence's share on this rank: 0 .. 2 * chunk - 1.
    share_start = torch.cumsum(per_rank, 0) - per_rank
    local = torch.arange(seq.numel()) - share_start[seq]
    seq_chunk = chunk[seq]
    second = local >= seq_chunk
    which = torch.where(second, granule - 1 - cp_rank, cp_rank)
    return bounds[:-1][seq] + which * seq_chunk + local - second.long() * seq_chunk


def _te_cp_available(batch: Mapping[str, Any]) -> bool:
    if not torch.cuda.is_available() or not batch["tokens"].is_cuda:
        return False
    from megatron.core import utils as mcore_utils

    return getattr(mcore_utils, "tex", None) is not None


def batch_for_cp_rank(batch: Mapping[str, Any], cp_size: int, cp_rank: int
                      ) -> dict[str, torch.Tensor | None]:
    """This CP rank's share of a `to_megatron_lm_batch` dict.

    Token-level tensors are sliced along the sequence (dim 1) with `cp_partition_indices`;
    ``attention_mask`` and the boundaries are kept whole, since they describe the FULL row, as
    TE's THD context-parallel attention expects. CUDA tensors with Transformer Engine present go
    through megatron-core 0.16's ``get_thd_batch_on_this_cp_rank`` instead (same convention;
    0.19 has no such function with explicit sizes, `compat.thd_cp_slicer`).
    """
    from megatron_packing.megatron.compat import thd_cp_slicer

    out = dict(batch)
    if cp_size == 1 and cp_rank == 0:
        return out
    cu_padded = batch["cu_seqlens_padded"].reshape(-1)
    total = int(batch["tokens"].shape[1])
    if int(cu_padded[-1]) != total:
        raise ValueError(f"cu_seqlens_padded ends at {int(cu_padded[-1])} but the row holds "
                         f"{total} tokens; CP slicing needs them equal")
    slicer = thd_cp_slicer() if _te_cp_available(batch) else None
    if slicer is not None:
        sliced = {k: v for k, v in batch.items() if k not in _UNSLICED_KEYS}
        sliced, _ = slicer(
            sliced, batch["cu_seqlens"].reshape(-1), cu_padded, batch["max_seqlen"].reshape(-1),
            cp_size=cp_size, cp_rank=cp_rank)
        out.update(sliced)
        return out
    index = cp_partition_indices(cu_padded, cp_size, cp_rank)
    for key, value in batch.items():
        if key in _UNSLICED_KEYS or value is None:
            continue
        out[key] = value.index_select(1, index.to(value.device))
    return out


def merge_cp_slices(slices: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor
                    ) -> torch.Tensor:
    """Inverse of CP slicing: the full row from every rank's slice (rank order), along dim 1.

    Lets CPU code run the exact block-diagonal attention on a whole row and compare it with, or
    hand results back to, per-rank slices.
    """
    cp_size = len(slices)
    if cp_size < 1:
        raise ValueError("need at least one CP slice")
    first = slices[0]
    total = int(cu_seqlens_padded.reshape(-1)[-1])
    full = first.new_empty((first.shape[0], total, *first.shape[2:]))
    for rank, part in enumerate(slices):
        index = cp_partition_indices(cu_seqlens_padded, cp_size, rank).to(part.device)
        if part.shape[1] != index.numel():
            raise ValueError(f"CP rank {rank}'s slice holds {part.shape[1]} positions; "
                             f"cu_seqlens_padded gives it {index.numel()}")
        full.index_copy_(1, index, part)
    return full


# ----------------------------------------------------------------------------- Megatron-Bridge

def _minus_one_tail(values: torch.Tensor, length: int) -> torch.Tensor:
    out = torch.full((1, length), -1, dtype=torch.int32)
    out[0, :values.numel()] = values.reshape(-1).to(torch.int32)
    return out


def to_bridge_packed_batch(mb: PackedMicroBatch, cu_len: int | None = None) -> dict[str, torch.Tensor]:
    """One packed row with Megatron-Bridge's opt-in packed-sequence keys (CPU tensors).

    ``cu_seqlens`` holds the PADDED boundaries and ``cu_seqlens_unpadded`` the real ones, each
    ``[1, cu_len]`` int32 with a ``-1`` tail; ``*_argmin`` (``[1, 1]``) is the index of the first
    ``-1``, i.e. the count of valid entries, so Bridge trims without a device sync.
    ``max_seqlen`` is ``[1, 1]`` int32. ``cu_len`` (default n + 2) fixes the boundary length
    so rows stack; it must leave at least one ``-1``, because Bridge falls back to ``argmin``
    when no argmin key is given and that finds the tail.
    """
    _check_row(mb)
    n_cu = int(mb.cu_seqlens.numel())
    cu_len = n_cu + 1 if cu_len is None else cu_len
    if cu_len < n_cu + 1:
        raise ValueError(f"cu_len={cu_len} leaves no -1 after the row's {n_cu} boundaries; "
                         f"use cu_len >= {n_cu + 1}")
    argmin = torch.tensor([[n_cu]], dtype=torch.int64)
    return {
        "tokens": mb.tokens.to(torch.int64),
        "labels": mb.labels.to(torch.int64),
        "loss_mask": mb.loss_mask.to(torch.float32),
        "position_ids": mb.position_ids.to(torch.int64),
        "cu_seqlens": _minus_one_tail(mb.cu_seqlens_padded, cu_len),
        "cu_seqlens_argmin": argmin,
        "cu_seqlens_unpadded": _minus_one_tail(mb.cu_seqlens, cu_len),
        "cu_seqlens_unpadded_argmin": argmin.clone(),
        "max_seqlen": torch.tensor([[int(mb.max_seqlen)]], dtype=torch.int32),
    }
