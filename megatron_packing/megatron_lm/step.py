"""One optimizer step of the Megatron-LM entry point at this step's micro-batch count.

What Megatron-LM's ``train_step`` does, with the two things a varying count changes: the
schedule runs this step's rows (the num-microbatches calculator set to their count first), and
the LR schedule advances by the step's real examples. Forward-backward runs inside
megatron-core's rerun state machine, the optimizer step under Megatron's ``optimizer`` timer,
and the loss reports are reduced as ``train_step`` reduces them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_packing.megatron.cpu_workarounds import (
    cuda_factories_on_cpu,
    megatron_optimizer_compat,
)
from megatron_packing.megatron.step_accounting import lr_increment, sync_num_microbatches
from megatron_packing.megatron.step_rows import step_rows
from megatron_packing.packed.collate import PackedBatch
from megatron_packing.padded.collate import PaddedBatch


@dataclass
class StepOutcome:
    """What one optimizer step reports; ``loss_sums`` are Megatron's (sum, count) per key."""

    loss_sums: dict[str, torch.Tensor]  # empty off the last pipeline stage
    grad_norm: float | None
    num_zeros_in_grad: int | None
    lr: float
    skipped: bool
    micro_batches: int
    seq_length: int
    compute_ms: float = 0.0  # Megatron's schedule and optimizer step; the rest is the loop's
    should_checkpoint: bool = False  # the rerun state machine's decisions
    should_exit: bool = False
    exit_code: int = 0

    @property
    def loss_dict(self) -> dict[str, torch.Tensor]:
        """Token means per key, as Megatron's ``train_step`` hands them to ``training_log``."""
        return {key: sums[0] / sums[1].clamp(min=1) for key, sums in self.loss_sums.items()}

    @property
    def loss(self) -> float | None:
        """The global token-mean LM loss; None off the last pipeline stage."""
        mean = self.loss_dict.get("lm loss")
        return None if mean is None else float(mean)


def reduce_loss_sums(losses_reduced: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """(token sum, token count) per reported key over the step's micro-batches and DP x CP.

    Megatron's ``train_step`` reduction for two-element reports, kept as sums so that
    validation can weight steps by their tokens.
    """
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage(ignore_virtual=True) or not losses_reduced:
        return {}
    sums = {}
    for key in losses_reduced[0]:
        total = torch.vstack([report[key].view(-1) for report in losses_reduced]).sum(dim=0)
        total = total.to(torch.float64)
        torch.distributed.all_reduce(total,
                                     group=ps.get_data_parallel_group(with_context_parallel=True))
        sums[key] = total
    return sums


def run_step(batch: PackedBatch | PaddedBatch, *, model: list[Any], optimizer: Any,
             scheduler: Any, forward_step: Callable, dp_size: int, pad_token_id: int = 0,
             forward_only: bool = False, width_multiple: int = 1) -> StepOutcome:
    """Forward/backward over this rank's rows inside the rerun state machine, then the
    optimizer step and the LR step by real examples (as Megatron's ``train_step`` otherwise)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine
    from megatron.training import get_args, get_timers
    from megatron.training.utils import (
        logical_and_across_model_parallel_group,
        reduce_max_stat_across_model_parallel_group,
    )

    meta = batch.meta
    count = sync_num_microbatches(meta, dp_size=dp_size, rank=torch.distributed.get_rank())
    if count != len(batch.micro_batches):
        raise RuntimeError(f"step {meta.step}: {len(batch.micro_batches)} rows on this rank, the "
                           f"plan says {count}")
    rows, seq_length = step_rows(batch, pipeline=ps.get_pipeline_model_parallel_world_size() > 1,
                                 pad_token_id=pad_token_id, width_multiple=width_multiple)
    forward_backward = get_forward_backward_func()
    started = time.perf_counter()
    if forward_only:
        with cuda_factories_on_cpu():
            reports = forward_backward(
                forward_step_func=forward_step, data_iterator=iter(rows), model=model,
                num_microbatches=count, seq_length=seq_length, micro_batch_size=1,
                decoder_seq_length=seq_length, forward_only=True)
        return StepOutcome(reduce_loss_sums(reports), None, None, 0.0, False, count, seq_length)

    args, timers = get_args(), get_timers()
    machine = get_rerun_state_machine()
    data = RerunDataIterator(iter(rows))  # the state machine replays the rows on a rerun
    losses_reduced: list[dict[str, torch.Tensor]] = []
    while machine.should_run_forward_backward(data):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        with cuda_factories_on_cpu():
            losses_reduced = forward_backward(
                forward_step_func=forward_step, data_iterator=data, model=model,
                num_microbatches=count, seq_length=seq_length, micro_batch_size=1,
                decoder_seq_length=seq_length, forward_only=False)
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()
    if should_exit:
        return StepOutcome({}, None, None, 0.0, True, count, seq_length,
                           should_checkpoint=should_checkpoint, should_exit=True,
                           exit_code=exit_code)

    timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    with megatron_optimizer_compat():
        update_successful, grad_norm, num_zeros = optimizer.step()
    timers("optimizer").stop()
    compute_ms = (time.perf_counter() - started) * 1000
    update_successful = logical_and_across_model_parallel_group(update_successful)
    grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm)
    if args.log_num_zeros_in_grad:
        num_zeros = reduce_max_stat_across_model_parallel_group(num_zeros)
    lr = float(optimizer.param_groups[0]["lr"])  # the LR this step trained with
    if update_successful:
        scheduler.step(increment=lr_increment(meta))
    return StepOutcome(reduce_loss_sums(losses_reduced),
                       None if grad_norm is None else float(grad_norm),
                       None if num_zeros is None else int(num_zeros), lr, not update_successful,
                       count, seq_length, compute_ms, should_checkpoint=should_checkpoint)
