"""One optimizer step over this rank's packed micro-batches with megatron-core's schedule.

The number of micro-batches changes from step to step (the plan varies the batch size so the
bin count divides by dp); megatron-core's schedules take ``num_microbatches`` per call, so each
step passes its own count. Every rank gets the same count for a step, so collectives line up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_packing.collate import PackedBatch
from megatron_packing.megatron.cpu_workarounds import cuda_factories_on_cpu
from megatron_packing.megatron.loss import make_loss_func, reduce_reported_loss
from megatron_packing.megatron.model import per_token_loss


@dataclass
class StepResult:
    loss: float  # global token-mean loss of the step
    grad_norm: float
    lr: float
    num_micro_batches: int


def sum_gradients_across_dp(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce (SUM) every gradient over the DP group, as one flat buffer per dtype."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group_params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group_params])
        dist.all_reduce(flat, group=group)
        offset = 0
        for p in group_params:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def _finalize_grads_sum(group: dist.ProcessGroup | None):
    """The schedule's ``finalize_model_grads_func``: a plain SUM over DP, no token rescaling."""

    def finalize(models: list[torch.nn.Module], num_tokens: torch.Tensor | None = None,
                 **_: object) -> None:
        for model in models:
            sum_gradients_across_dp(model, group)

    return finalize


def forward_backward(model: torch.nn.Module, batch: PackedBatch, *,
                     dp_group: dist.ProcessGroup | None = None, thd: bool = False,
                     loss_from_logits: bool = False, forward_only: bool = False) -> float:
    """Run this rank's micro-batches through the schedule; gradients end up DP-summed.

    Returns the step's global loss (sum of token losses over all ranks / global loss tokens).
    Gradients are accumulated into ``.grad`` (zero them first).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches = batch.micro_batches
    count = len(micro_batches)
    if count == 0:
        raise ValueError(f"step {batch.meta.step}: no micro-batches for this rank")
    if batch.meta.micro_batches_per_rank and count != batch.meta.micro_batches_per_rank:
        raise ValueError(f"step {batch.meta.step}: {count} micro-batches but the plan says "
                         f"{batch.meta.micro_batches_per_rank} per rank")
    global_tokens = batch.meta.num_loss_tokens
    config = model.config
    config.finalize_model_grads_func = _finalize_grads_sum(dp_group)

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        losses = per_token_loss(chunk, mb, thd=thd, loss_from_logits=loss_from_logits)
        return losses, make_loss_func(mb.loss_mask.to(losses.device), global_tokens)

    with cuda_factories_on_cpu():
        reports = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=count,
            seq_length=max(int(mb.tokens.shape[1]) for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )
    return reduce_reported_loss(reports, global_tokens, dp_group)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: PackedBatch, *,
               scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
               dp_group: dist.ProcessGroup | None = None, clip_grad: float | None = None,
               thd: bool = False, loss_from_logits: bool = False) -> StepResult:
    """Zero grads, forward/backward with DP-summed gradients, clip, optimizer step, LR step."""
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, batch, dp_group=dp_group, thd=thd,
                            loss_from_logits=loss_from_logits)
    params = [p for p in model.parameters() if p.grad is not None]
    if clip_grad:
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip_grad))
    else:
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return StepResult(loss=loss, grad_norm=norm, lr=lr, num_micro_batches=len(batch.micro_batches))


def warmup_cosine(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int,
                  min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup then cosine decay to ``min_ratio`` x the base LR; stateful for resume."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def broadcast_parameters(model: torch.nn.Module, src: int = 0,
                         group: dist.ProcessGroup | None = None) -> None:
    """Make every DP replica start from rank ``src``'s weights."""
    if not dist.is_initialized():
        return
    for p in model.parameters():
        dist.broadcast(p.data, src=src, group=group)
