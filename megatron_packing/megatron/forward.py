"""One packed row through a megatron-core model, as both Megatron hosts' schedules call it.

On GPUs with Transformer Engine the row goes in as THD with `PackedSeqParams`; with context
parallelism each CP rank takes its load-balanced share of every sequence (megatron-core 0.16's
``get_thd_batch_on_this_cp_rank``; with 0.19 the library's split of the same convention). Where attention cannot read THD metadata (CPU, or the
local attention on a GPU without Transformer Engine), the row goes in whole with the exact
block-diagonal causal mask, and with CP each rank trains only the tokens of its CP share (the
same positions the GPU path would give it), so the DP x CP gradient sum is the same gradient.

With pipeline parallelism every micro-batch of a step must have one shape, so rows are padded to
the step's longest row (not to the capacity); the padding joins the last sequence's aligned
segment and carries no loss.

In padded mode a micro-batch is a ``[b, L]`` block of right-padded examples, each at positions
0.., under the causal mask: a real token only sees earlier tokens of its own example, so the
padding after it changes nothing, and padded positions carry no loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from megatron_packing.megatron.lm_batch import cp_partition_indices
from megatron_packing.megatron.packed_seq import block_diagonal_causal_mask, causal_mask
from megatron_packing.megatron.step_accounting import megatron_lm_loss_func
from megatron_packing.packed.collate import PackedMicroBatch
from megatron_packing.padded.collate import PaddedMicroBatch


def pad_row(mb: PackedMicroBatch, length: int, pad_token_id: int = 0) -> PackedMicroBatch:
    """``mb`` grown to ``length`` tokens; the padding extends the last aligned segment."""
    current = int(mb.tokens.shape[1])
    if current == length:
        return mb
    if current > length:
        raise ValueError(f"row of {current} tokens cannot be padded to {length}")
    extra = length - current

    def grow(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.cat([t, torch.full((1, extra), value, dtype=t.dtype)], dim=1)

    cu_padded = mb.cu_seqlens_padded.clone()
    cu_padded[-1] = length
    last_segment = int(cu_padded[-1] - cu_padded[-2]) if cu_padded.numel() > 1 else length
    last_position = int(mb.position_ids[0, -1]) + 1 if current else 0
    positions = torch.arange(last_position, last_position + extra, dtype=mb.position_ids.dtype)
    return replace(
        mb,
        tokens=grow(mb.tokens, pad_token_id),
        labels=grow(mb.labels, 0),
        loss_mask=grow(mb.loss_mask, 0.0),
        position_ids=torch.cat([mb.position_ids, positions[None]], dim=1),
        cu_seqlens_padded=cu_padded,
        max_seqlen=max(int(mb.max_seqlen), last_segment),
    )


LossFunc = Callable[..., tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


def make_forward_step(*, cp_size: int = 1, cp_rank: int = 0, thd: bool | None = None,
                      check_nan: bool = False, check_spiky: bool = False
                      ) -> Callable[[Iterator[Any], Any], tuple[torch.Tensor, Any]]:
    """The ``forward_step_func`` the schedules call once per micro-batch.

    ``thd`` (default: a GPU with Transformer Engine) sends rows as THD with `PackedSeqParams`;
    otherwise rows go in whole with the exact block-diagonal mask (CPU, or a GPU whose local
    attention cannot read THD metadata). ``check_nan`` / ``check_spiky`` are Megatron's
    ``--check-for-nan-in-loss-and-grad`` and ``--check-for-spiky-loss``: each micro-batch's
    loss goes to the rerun state machine.
    """
    use_thd = thd_available() if thd is None else thd
    loss_func = partial(megatron_lm_loss_func, check_nan=check_nan, check_spiky=check_spiky)

    def forward_step(data_iterator: Iterator[PackedMicroBatch | PaddedMicroBatch], model: Any
                     ) -> tuple[torch.Tensor, Any]:
        mb = next(data_iterator)
        if isinstance(mb, PaddedMicroBatch):
            return _forward_padded(mb, model, loss_func, causal_mask_needed=not use_thd)
        if use_thd:
            return _forward_thd(mb, model, cp_size, cp_rank, loss_func)
        return _forward_mask(mb, model, cp_size, cp_rank, loss_func)

    return forward_step


def thd_available() -> bool:
    """THD attention needs a GPU and Transformer Engine."""
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _forward_mask(mb: PackedMicroBatch, model: Any, cp_size: int, cp_rank: int,
                  loss_func: LossFunc) -> tuple[torch.Tensor, Any]:
    total = int(mb.tokens.shape[1])
    device = next(model.parameters()).device
    mask = block_diagonal_causal_mask(mb.cu_seqlens_padded, total).to(device)
    loss_mask = mb.loss_mask
    if cp_size > 1:
        share = torch.zeros_like(loss_mask)
        # The positions the load-balanced THD split gives this CP rank (chunks r and 2cp-1-r).
        share[0, cp_partition_indices(mb.cu_seqlens_padded, cp_size, cp_rank)] = 1
        loss_mask = loss_mask * share
    output = model(mb.tokens.to(device), mb.position_ids.to(device), mask,
                   labels=mb.labels.to(device))
    return output, partial(loss_func, loss_mask.to(device))


def _forward_thd(mb: PackedMicroBatch, model: Any, cp_size: int, cp_rank: int,
                 loss_func: LossFunc) -> tuple[torch.Tensor, Any]:
    from megatron_packing.megatron.compat import thd_cp_slicer
    from megatron_packing.megatron.lm_batch import batch_for_cp_rank
    from megatron_packing.megatron.packed_seq import packed_seq_params

    device = torch.device("cuda", torch.cuda.current_device())
    batch = {"tokens": mb.tokens, "labels": mb.labels, "loss_mask": mb.loss_mask,
             "position_ids": mb.position_ids}
    batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
    cu_seqlens = mb.cu_seqlens.to(device=device, dtype=torch.int32)
    cu_seqlens_padded = mb.cu_seqlens_padded.to(device=device, dtype=torch.int32)
    max_seqlen = torch.tensor([int(mb.max_seqlen)], dtype=torch.int32)
    slicer = thd_cp_slicer()
    if slicer is not None:  # megatron-core 0.16: its own THD split and PackedSeqParams
        batch, params = slicer(batch, cu_seqlens, cu_seqlens_padded, max_seqlen,
                               cp_size=cp_size, cp_rank=cp_rank)
    else:  # 0.19: the same split (TE's convention); PackedSeqParams with 0.19's row fields
        params = packed_seq_params({"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen,
                                    "cu_seqlens_padded": cu_seqlens_padded}, device)
        sliced = batch_for_cp_rank({**batch, "cu_seqlens": cu_seqlens,
                                    "cu_seqlens_padded": cu_seqlens_padded,
                                    "max_seqlen": max_seqlen}, cp_size, cp_rank)
        batch = {key: value for key, value in sliced.items()
                 if key in batch and value is not None}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=params)
    return output, partial(loss_func, batch["loss_mask"])


def _forward_padded(mb: PaddedMicroBatch, model: Any, loss_func: LossFunc, *,
                    causal_mask_needed: bool) -> tuple[torch.Tensor, Any]:
    """A ``[b, L]`` block of padded examples. Transformer Engine's attention applies the causal
    mask itself; megatron-core's local attention is given it (True where attention is barred)."""
    device = next(model.parameters()).device
    mask = causal_mask(int(mb.tokens.shape[1])).to(device) if causal_mask_needed else None
    output = model(mb.tokens.to(device), mb.position_ids.to(device), mask,
                   labels=mb.labels.to(device))
    return output, partial(loss_func, mb.loss_mask.to(device))
