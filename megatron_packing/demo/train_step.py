"""One optimizer step over this rank's packed micro-batches with megatron-core's schedule.

The number of micro-batches changes from step to step (the plan varies the batch size so the
bin count divides by dp); megatron-core's schedules take ``num_microbatches`` per call, so each
step passes its own count. Every rank gets the same count for a step, so collectives line up.

Two model kinds, one entry point:

* a plain module (the CPU demo): the loss is divided by the global loss-token count N from the
  plan, gradients land in ``.grad`` and a custom ``finalize_model_grads_func`` SUMs them over DP;
  any ``torch.optim`` optimizer steps them.
* a megatron-core ``DistributedDataParallel`` model with a megatron-core optimizer (distributed
  or not; see `megatron_packing.megatron.ddp`): gradients live in the DDP's ``main_grad``
  buffers, so the step is Megatron-LM's: ``zero_grad_buffer()``, the schedule with Megatron's
  own ``finalize_model_grads`` (reduce, then divide once by the all-reduced loss-token count;
  the loss function returns raw token sums), then ``optimizer.step()`` for
  ``(update_successful, grad_norm, num_zeros_in_grad)``; clipping is the optimizer config's.
* a torch FSDP2 model (``fully_shard``, see `megatron_packing.megatron.fsdp2`): the loss is
  divided by N as for the plain module; FSDP2's reduce-scatter SUMS the gradient shards during
  the backward, so the schedule's finalize does nothing; a torch optimizer steps the shards.

A step is packed (`PackedBatch`: [1, T] rows) or padded (`PaddedBatch`: [b, L] blocks whose
``None`` entries are dummies). A dummy runs as `make_dummy_microbatch`: a full forward and
backward (so FSDP2's and DP's collectives line up across ranks) with zero loss and zero tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_packing.common.plan_types import StepMetadata
from megatron_packing.demo.model import per_token_loss
from megatron_packing.megatron.cpu_workarounds import (
    cuda_factories_on_cpu,
    megatron_optimizer_compat,
)
from megatron_packing.megatron.ddp import is_megatron_ddp, wire_megatron_grad_sync
from megatron_packing.megatron.fsdp2 import clip_and_norm, is_fsdp2
from megatron_packing.megatron.loss import LossFunc, make_loss_func, reduce_reported_loss
from megatron_packing.megatron.step_accounting import lr_increment
from megatron_packing.packed.collate import PackedBatch, PackedMicroBatch
from megatron_packing.padded.collate import PaddedBatch, PaddedMicroBatch, make_dummy_microbatch

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import MegatronModule


@dataclass
class StepResult:
    loss: float  # global token-mean loss of the step
    grad_norm: float
    lr: float
    num_micro_batches: int
    update_successful: bool = True  # False when a megatron optimizer skipped the step (overflow)
    num_zeros_in_grad: int | None = None  # megatron optimizer with log_num_zeros_in_grad


def sum_gradients_across_dp(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """All-reduce (SUM) every gradient over the DP group, as one flat buffer per dtype."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        grad = p.grad
        if grad is None:
            grad = p.grad = torch.zeros_like(p)
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n


def _finalize_grads_sum(group: dist.ProcessGroup | None) -> Callable[..., None]:
    """The schedule's ``finalize_model_grads_func``: a plain SUM over DP, no token rescaling."""

    def finalize(models: list[torch.nn.Module], num_tokens: torch.Tensor | None = None,
                 **_: object) -> None:
        for model in models:
            sum_gradients_across_dp(model, group)

    return finalize


def _finalize_nothing(models: list[torch.nn.Module], num_tokens: torch.Tensor | None = None,
                      **_: object) -> None:
    """FSDP2 has reduce-scattered (summed) the gradients during the backward already."""


def runnable_micro_batches(batch: PackedBatch | PaddedBatch
                           ) -> list[PackedMicroBatch | PaddedMicroBatch]:
    """The step's micro-batches with every ``None`` dummy replaced by a zero-loss one."""
    return [make_dummy_microbatch() if mb is None else mb for mb in batch.micro_batches]


def forward_backward(model: MegatronModule, batch: PackedBatch | PaddedBatch, *,
                     dp_group: dist.ProcessGroup | None = None, thd: bool = False,
                     loss_from_logits: bool = False, forward_only: bool = False) -> float:
    """Run this rank's micro-batches through the schedule; gradients end up DP-reduced.

    Returns the step's global loss (sum of token losses over all ranks / global loss tokens).
    Plain module: gradients accumulate into ``.grad`` (zero them first). megatron-core DDP:
    into the ``main_grad`` buffers (``zero_grad_buffer()`` first), finalized by Megatron.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro_batches = runnable_micro_batches(batch)
    count = len(micro_batches)
    if count == 0:
        raise ValueError(f"step {batch.meta.step}: no micro-batches for this rank")
    if batch.meta.micro_batches_per_rank and count != batch.meta.micro_batches_per_rank:
        raise ValueError(f"step {batch.meta.step}: {count} micro-batches but the plan says "
                         f"{batch.meta.micro_batches_per_rank} per rank")
    global_tokens = batch.meta.num_loss_tokens
    ddp = is_megatron_ddp(model)
    config = model.config
    if ddp:
        if not config.calculate_per_token_loss:
            raise ValueError("megatron DDP model with calculate_per_token_loss=False: the step "
                             "needs True (finalize_model_grads divides by the token count)")
        wire_megatron_grad_sync(model)
        if not forward_only:
            _drop_stale_grads(model)
    elif is_fsdp2(model):
        config.finalize_model_grads_func = _finalize_nothing
    else:
        config.finalize_model_grads_func = _finalize_grads_sum(dp_group)

    def forward_step(data_iterator: Iterator[PackedMicroBatch | PaddedMicroBatch],
                     chunk: MegatronModule
                     ) -> tuple[torch.Tensor, LossFunc]:
        mb = next(data_iterator)
        losses = per_token_loss(chunk, mb, thd=thd, loss_from_logits=loss_from_logits)
        # With DDP, finalize_model_grads divides by the all-reduced token count: a raw sum.
        return losses, make_loss_func(mb.loss_mask.to(losses.device), global_tokens,
                                      raw_sum=ddp)

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
    return reduce_reported_loss(reports, global_tokens, dp_group, check_tokens=ddp)


def evaluate(model: MegatronModule, loader: Iterable[PackedBatch | PaddedBatch], *,
             dp_group: dist.ProcessGroup | None = None, loss_from_logits: bool = False) -> float:
    """The token-mean loss over one pass of ``loader`` (an ``eval_mode`` loader), forward only.

    Each step's loss is its global token mean, so the pass weighs it by its loss tokens."""
    total, tokens = 0.0, 0
    model.eval()
    try:
        with torch.no_grad():
            for batch in loader:
                count = int(batch.meta.num_loss_tokens or 0)
                loss = forward_backward(model, batch, dp_group=dp_group, forward_only=True,
                                        loss_from_logits=loss_from_logits)
                total += loss * count
                tokens += count
    finally:
        model.train()
    return total / tokens if tokens else math.nan


def _drop_stale_grads(model: torch.nn.Module) -> None:
    """Set ``.grad`` to None on a DDP model, as Megatron-LM's ``optimizer.zero_grad()`` does.

    The megatron-core optimizer points ``param.grad`` at ``param.main_grad`` for its step; left
    there, the next backward would accumulate into the buffer through ``.grad`` and the DDP hook
    would add it once more (the first micro-batch counted twice).
    """
    for param in model.parameters():
        param.grad = None


def train_step(model: MegatronModule, optimizer: torch.optim.Optimizer | MegatronOptimizer,
               batch: PackedBatch | PaddedBatch, *,
               scheduler: torch.optim.lr_scheduler.LRScheduler | OptimizerParamScheduler | None = None,
               dp_group: dist.ProcessGroup | None = None, clip_grad: float | None = None,
               thd: bool = False, loss_from_logits: bool = False) -> StepResult:
    """Zero grads, forward/backward with DP-reduced gradients, (clip,) optimizer step, LR step.

    ``scheduler``: megatron-core's ``OptimizerParamScheduler`` (see `example_schedule`), stepped
    by the step's real examples as Megatron-LM does (on the DDP path only when the update
    succeeded), or a torch LR scheduler, stepped once.
    """
    if is_megatron_ddp(model):
        return _train_step_megatron_ddp(model, optimizer, batch, scheduler=scheduler,
                                        dp_group=dp_group, clip_grad=clip_grad, thd=thd,
                                        loss_from_logits=loss_from_logits)
    if _is_megatron_optimizer(optimizer):
        raise TypeError("a megatron-core optimizer needs a megatron-core DistributedDataParallel "
                        "model (its main_grad buffers); wrap the model with ddp.wrap_in_ddp")
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(model, batch, dp_group=dp_group, thd=thd,
                            loss_from_logits=loss_from_logits)
    params = [p for p in model.parameters() if p.grad is not None]
    if is_fsdp2(model):
        norm = clip_and_norm(model, clip_grad)
    elif clip_grad:
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip_grad))
    else:
        grads = [p.grad for p in params if p.grad is not None]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    if scheduler is not None:
        step_schedule(scheduler, batch.meta)
    return StepResult(loss=loss, grad_norm=norm, lr=lr, num_micro_batches=len(batch.micro_batches))


def _is_megatron_optimizer(optimizer: object) -> bool:
    from megatron.core.optimizer import MegatronOptimizer

    return isinstance(optimizer, MegatronOptimizer)


def _train_step_megatron_ddp(model: MegatronModule, optimizer: MegatronOptimizer,
                             batch: PackedBatch | PaddedBatch, *,
                             scheduler: torch.optim.lr_scheduler.LRScheduler
                             | OptimizerParamScheduler | None,
                             dp_group: dist.ProcessGroup | None, clip_grad: float | None,
                             thd: bool, loss_from_logits: bool) -> StepResult:
    """Megatron-LM's ``train_step`` for one step: the gradients are never in ``.grad``."""
    if not _is_megatron_optimizer(optimizer):
        raise TypeError(f"a megatron-core DistributedDataParallel model needs a megatron-core "
                        f"optimizer (ddp.build_megatron_optimizer), got "
                        f"{type(optimizer).__name__}: it would read the empty .grad and skip "
                        f"the update")
    if clip_grad:
        raise ValueError(f"clip_grad={clip_grad} is not used with a megatron-core optimizer; "
                         "set OptimizerConfig.clip_grad instead")
    model.zero_grad_buffer()
    optimizer.zero_grad()
    model.config.grad_scale_func = optimizer.scale_loss
    loss = forward_backward(model, batch, dp_group=dp_group, thd=thd,
                            loss_from_logits=loss_from_logits)
    lr = float(optimizer.param_groups[0]["lr"])
    with megatron_optimizer_compat():
        update_successful, grad_norm, num_zeros = optimizer.step()
    if update_successful and scheduler is not None:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if not isinstance(scheduler, OptimizerParamScheduler):
            raise TypeError(f"with a megatron-core optimizer the scheduler must be megatron-core's "
                            f"OptimizerParamScheduler, got {type(scheduler).__name__}")
        scheduler.step(increment=lr_increment(batch.meta))  # real examples, never rows
    return StepResult(loss=loss, grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
                      lr=lr, num_micro_batches=len(batch.micro_batches),
                      update_successful=bool(update_successful),
                      num_zeros_in_grad=None if num_zeros is None else int(num_zeros))


def example_schedule(optimizer: torch.optim.Optimizer | MegatronOptimizer, *, lr: float,
                     min_lr: float, weight_decay: float, warmup_examples: int,
                     total_examples: int) -> OptimizerParamScheduler:
    """megatron-core's LR schedule, measured in examples: linear warmup over
    ``warmup_examples``, cosine decay to ``min_lr`` at ``total_examples``.

    `train_step` steps it by each step's real examples (`lr_increment`), as the Megatron-LM
    entry point does, so a varying batch size moves the LR by what it trained. The schedule's
    shape always comes from the arguments (a resumed run takes only its position from the
    checkpoint)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    total = max(1, int(total_examples))
    warmup = min(max(0, int(warmup_examples)), total - 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=total, lr_decay_style="cosine", start_wd=weight_decay,
        end_wd=weight_decay, wd_incr_steps=total, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)


def step_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler | OptimizerParamScheduler,
                  meta: StepMetadata) -> None:
    """Advance ``scheduler`` past one step: megatron-core's by the step's real examples, a
    torch scheduler by one."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if isinstance(scheduler, OptimizerParamScheduler):
        scheduler.step(increment=lr_increment(meta))
    else:
        scheduler.step()


def broadcast_parameters(model: torch.nn.Module, src: int = 0,
                         group: dist.ProcessGroup | None = None) -> None:
    """Make every DP replica start from rank ``src``'s weights."""
    if not dist.is_initialized():
        return
    for p in model.parameters():
        dist.broadcast(p.data, src=src, group=group)
