"""The training loop of the Megatron-LM entry point: a per-step micro-batch count, real-example
accounting, Megatron's checkpoints and writers.

Megatron-LM's ``train()`` asserts that the micro-batch count never falls and checkpoints on every
rise, and it advances the LR schedule and ``consumed_train_samples`` by rows. This loop keeps
Megatron's pieces (schedules, DDP grad finalisation, optimizer, ``OptimizerParamScheduler``,
``save_checkpoint``, TensorBoard / W&B writers) and changes only the per-step bookkeeping:

* each step runs ``len(batch.micro_batches)`` micro-batches, the same on every rank, and the
  num-microbatches calculator is set to that count first so that anything reading it agrees;
* the LR schedule and ``args.consumed_train_samples`` advance by the step's real examples.
  Warmup and decay are sized by Megatron as ``iters x --global-batch-size`` examples, and the
  sampler repays the batch-size drift by the final iteration, so the schedule ends exactly at
  ``--train-iters x --global-batch-size`` examples;
* the loader state is saved inside each checkpoint through Megatron's dataloader hook.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_packing.megatron.cpu_workarounds import cuda_factories_on_cpu
from megatron_packing.megatron.megatron_lm import sync_num_microbatches
from megatron_packing.megatron_lm.data import TrainStream, checkpoint_hook
from megatron_packing.megatron_lm.forward import pad_row
from megatron_packing.metrics import step_metrics
from megatron_packing.packed.collate import PackedBatch


@dataclass
class StepOutcome:
    loss: float | None  # global token-mean loss; None off the last pipeline stage
    grad_norm: float | None
    lr: float
    skipped: bool
    micro_batches: int
    seq_length: int
    compute_ms: float = 0.0  # Megatron's schedule and optimizer step; the rest is the loop's


def _reduce_loss(losses_reduced: list[dict[str, torch.Tensor]]) -> float | None:
    """Token-weighted loss over the step's micro-batches and the DP x CP ranks."""
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    totals = torch.zeros(2, dtype=torch.float64)
    for report in losses_reduced:
        totals += report["lm loss"].detach().to(torch.float64).view(-1).cpu()
    torch.distributed.all_reduce(totals, group=ps.get_data_parallel_group(with_context_parallel=True))
    return float(totals[0] / totals[1]) if totals[1] > 0 else 0.0


def step_rows(batch: PackedBatch, *, pipeline: bool, pad_token_id: int) -> tuple[list, int]:
    """This step's rows and the sequence length the schedule is given for them."""
    rows = list(batch.micro_batches)
    seq_length = max(int(row.tokens.shape[1]) for row in rows)
    if pipeline:  # stages exchange activations of one fixed shape per step
        rows = [pad_row(row, seq_length, pad_token_id) for row in rows]
    return rows, seq_length


def run_step(batch: PackedBatch, *, model: list[Any], optimizer: Any, scheduler: Any,
             forward_step: Callable, dp_size: int, pad_token_id: int = 0,
             forward_only: bool = False) -> StepOutcome:
    """Forward/backward over this rank's rows, optimizer step, LR step by real examples."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
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
                                 pad_token_id=pad_token_id)
    if not forward_only:
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    started = time.perf_counter()
    with cuda_factories_on_cpu():
        losses_reduced = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(rows), model=model,
            num_microbatches=count, seq_length=seq_length, micro_batch_size=1,
            decoder_seq_length=seq_length, forward_only=forward_only)
        loss = _reduce_loss(losses_reduced)
        if forward_only:
            return StepOutcome(loss, None, 0.0, False, count, seq_length)
        update_successful, grad_norm, _ = optimizer.step()
    compute_ms = (time.perf_counter() - started) * 1000
    update_successful = logical_and_across_model_parallel_group(update_successful)
    grad_norm = reduce_max_stat_across_model_parallel_group(grad_norm)
    lr = float(optimizer.param_groups[0]["lr"])
    if update_successful:
        scheduler.step(increment=int(meta.num_examples))
    return StepOutcome(loss, None if grad_norm is None else float(grad_norm), lr,
                       not update_successful, count, seq_length, compute_ms)


class StepLog:
    """Per-step JSONL records, one file per rank, naming the rank's DP/TP/PP/CP coordinates."""

    def __init__(self, directory: str | None) -> None:
        from megatron.core import parallel_state as ps

        self._path = None
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._path = Path(directory) / f"steps_rank{torch.distributed.get_rank()}.jsonl"
            self._where = {"dp": ps.get_data_parallel_rank(),
                           "tp": ps.get_tensor_model_parallel_rank(),
                           "pp": ps.get_pipeline_model_parallel_rank(),
                           "cp": ps.get_context_parallel_rank()}

    def write(self, record: dict[str, Any]) -> None:
        if self._path is None:
            return
        with open(self._path, "a") as f:
            f.write(json.dumps({**self._where, **record}) + "\n")


def log_to_writers(metrics: dict[str, float], iteration: int) -> None:
    """Send metrics to Megatron-LM's TensorBoard and W&B writers (present on the last rank)."""
    from megatron.training import get_tensorboard_writer, get_wandb_writer

    writer = get_tensorboard_writer()
    if writer is not None:
        for key, value in metrics.items():
            writer.add_scalar(key, value, iteration)
        writer.flush()
    wandb_writer = get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.log(metrics, iteration)


def evaluate(make_valid_steps: Callable[[], Iterator[PackedBatch]], *, eval_iters: int,
             model: list[Any], forward_step: Callable, dp_size: int, pad_token_id: int) -> float:
    """Token-mean loss over ``eval_iters`` fixed-size validation steps; training state untouched."""
    for chunk in model:
        chunk.eval()
    loss_sum, tokens = 0.0, 0
    known = True  # False off the last pipeline stage (no loss there) or with unknown counts
    try:
        with torch.no_grad():
            for _, batch in zip(range(eval_iters), make_valid_steps(), strict=False):
                outcome = run_step(batch, model=model, optimizer=None, scheduler=None,
                                   forward_step=forward_step, dp_size=dp_size,
                                   pad_token_id=pad_token_id, forward_only=True)
                step_tokens = batch.meta.num_loss_tokens
                if outcome.loss is None or step_tokens is None:
                    known = False
                else:  # the steps' token means, weighted back into one token mean
                    loss_sum += outcome.loss * step_tokens
                    tokens += step_tokens
    finally:
        for chunk in model:
            chunk.train()
    if not known or tokens == 0:
        return float("nan")
    return loss_sum / tokens


def train(args: Any, *, model: list[Any], optimizer: Any, scheduler: Any, stream: TrainStream,
          forward_step: Callable, dp_size: int, pad_token_id: int,
          make_valid_steps: Callable[[], Iterator[PackedBatch]] | None = None) -> int:
    """Run iterations ``args.iteration + 1 .. args.train_iters``; returns the last iteration."""
    from megatron.training import print_rank_last

    log = StepLog(args.packing_log_dir)
    if args.manual_gc:  # as Megatron-LM's train(): no collection pauses inside a step
        gc.disable()
        gc.collect()
    iteration = args.iteration
    flops_so_far = getattr(args, "num_floating_point_operations_so_far", 0)
    for chunk in model:
        chunk.train()
    while iteration < args.train_iters:
        started = time.perf_counter()
        batch = next(stream)
        data_ms = (time.perf_counter() - started) * 1000
        outcome = run_step(batch, model=model, optimizer=optimizer, scheduler=scheduler,
                           forward_step=forward_step, dp_size=dp_size, pad_token_id=pad_token_id)
        iteration += 1
        args.iteration = iteration
        args.consumed_train_samples += int(batch.meta.num_examples)
        step_ms = (time.perf_counter() - started) * 1000
        metrics = step_metrics(batch.meta, loss=outcome.loss, lr=outcome.lr)
        metrics["train/consumed_examples"] = args.consumed_train_samples
        metrics["train/step_ms"] = step_ms
        if outcome.grad_norm is not None:
            metrics["train/grad_norm"] = outcome.grad_norm
        log_to_writers(metrics, iteration)
        log.write({
            "iteration": iteration, "epoch": batch.meta.epoch,
            "examples": [list(row.example_indices) for row in batch.micro_batches],
            "row_lengths": [int(row.tokens.shape[1]) for row in batch.micro_batches],
            "num_examples": batch.meta.num_examples, "num_bins": batch.meta.num_bins,
            "micro_batches": outcome.micro_batches, "seq_length": outcome.seq_length,
            "loss": outcome.loss, "lr": outcome.lr, "grad_norm": outcome.grad_norm,
            "consumed_train_samples": args.consumed_train_samples, "skipped": outcome.skipped,
            "step_ms": step_ms, "data_ms": data_ms, "compute_ms": outcome.compute_ms,
            "overhead_ms": step_ms - outcome.compute_ms,
        })
        if iteration % args.log_interval == 0:
            print_rank_last(
                f" iteration {iteration:6d}/{args.train_iters} | examples {batch.meta.num_examples}"
                f" | consumed {args.consumed_train_samples} | rows/rank {outcome.micro_batches}"
                f" | lr {outcome.lr:.3e} | loss {outcome.loss if outcome.loss is not None else 0:.4f}"
                f" | {step_ms:.0f} ms")
        if make_valid_steps is not None and args.eval_interval and args.eval_iters and \
                iteration % args.eval_interval == 0:
            valid_loss = evaluate(make_valid_steps, eval_iters=args.eval_iters, model=model,
                                  forward_step=forward_step, dp_size=dp_size,
                                  pad_token_id=pad_token_id)
            log_to_writers({"valid/loss": valid_loss}, iteration)
            log.write({"iteration": iteration, "valid_loss": valid_loss})
            print_rank_last(f" validation at iteration {iteration} | loss {valid_loss:.4f}")
        if args.manual_gc and args.manual_gc_interval and iteration % args.manual_gc_interval == 0:
            gc.collect()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save(args, iteration, model, optimizer, scheduler, stream, flops_so_far)
    return iteration


def save(args: Any, iteration: int, model: list[Any], optimizer: Any, scheduler: Any,
         stream: TrainStream, flops_so_far: float) -> None:
    """Megatron's checkpoint, with this rank's loader state written by Megatron's own hook."""
    from megatron.training.checkpointing import save_checkpoint

    if not getattr(args, "dataloader_save", None):
        args.dataloader_save = args.save
    with cuda_factories_on_cpu():
        save_checkpoint(iteration, model, optimizer, scheduler, flops_so_far,
                        train_data_iterator=checkpoint_hook(stream))
