"""The training loop of the Megatron-LM entry point, built from Megatron-LM's own pieces.

Megatron-LM's ``train()`` asserts that the micro-batch count never falls and checkpoints on every
rise, and it advances the LR schedule and ``consumed_train_samples`` by rows. So this loop is the
library's, but only what a per-step count changes is written here:

* each step runs ``len(batch.micro_batches)`` micro-batches, the same on every rank, after the
  num-microbatches calculator is set to that count, so that everything reading
  ``get_num_microbatches()`` (Megatron's ``training_log``, the MoE and MTP loss scales, the
  throughput) sees this step's real count;
* the LR schedule and ``args.consumed_train_samples`` advance by the step's real examples;
* validation runs the validation loader's own steps (`megatron_packing.megatron_lm.evaluation`).

Everything else is Megatron-LM's, called as its ``train()`` calls it: the rerun state machine
around forward-backward (its loss checks live in the loss function), the optimizer step and its
timers, ``training_log`` (Megatron's metric names, throughput, memory, timers),
``post_training_step_callbacks`` (manual GC, weight-hash checks, straggler reports),
``checkpoint_and_decide_exit`` (the signal handler, ``--exit-interval``,
``--exit-duration-in-mins``, ``--save-interval``, ``--non-persistent-save-interval``) and
``maybe_finalize_async_save``. The loader state rides in every checkpoint through Megatron's
dataloader hook (`megatron_packing.megatron_lm.data`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_packing.megatron.cpu_workarounds import cuda_factories_on_cpu
from megatron_packing.megatron.step_loop import (
    LoopEnd,
    StepDone,
    StepHost,
    StepRecord,
    run_steps,
)
from megatron_packing.megatron.train_stream import TrainStream
from megatron_packing.megatron_lm.data import checkpoint_hook
from megatron_packing.megatron_lm.evaluation import Validation
from megatron_packing.megatron_lm.step import run_step


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
    wandb_writer = get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.log(metrics, iteration)


@dataclass
class TrainResult:
    """Where the loop stopped and why."""

    iteration: int
    flops_so_far: float
    should_exit: bool = False  # a graceful stop or the rerun state machine: no final save
    exit_code: int = 0


@dataclass
class Loop:
    """Everything the step loop drives; built once by the entry point."""

    model: list[Any]
    optimizer: Any
    scheduler: Any
    stream: TrainStream
    forward_step: Callable
    dp_size: int
    pad_token_id: int
    validation: Validation | None = None
    checkpointing_context: dict[str, Any] = field(default_factory=dict)
    width_multiple: int = 1  # padded mode: block widths rounded up to this (sequence parallel)

    def save(self, iteration: int, flops_so_far: float, *, timed: bool = True) -> None:
        """Megatron's checkpoint, with this rank's loader state written by Megatron's own hook."""
        from megatron.training.checkpointing import save_checkpoint
        from megatron.training.training import save_checkpoint_and_time

        with cuda_factories_on_cpu():
            if timed:  # inside the loop: Megatron's timed save, as its train() calls it
                save_checkpoint_and_time(iteration, self.model, self.optimizer, self.scheduler,
                                         flops_so_far, self.checkpointing_context,
                                         train_data_iterator=checkpoint_hook(self.stream))
            else:
                save_checkpoint(iteration, self.model, self.optimizer, self.scheduler,
                                flops_so_far, self.checkpointing_context,
                                train_data_iterator=checkpoint_hook(self.stream))


class MegatronLMHost(StepHost):
    """The Megatron-LM entry point's side of `run_steps`: Megatron-LM's step, logs and exits."""

    def __init__(self, args: Any, loop: Loop) -> None:
        import gc

        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.core.utils import get_attr_wrapped_model, get_model_config
        from megatron.training import get_timers

        self.args, self.loop = args, loop
        self.timers = get_timers()
        self.log = StepLog(args.packing_log_dir)
        get_model_config(loop.model[0]).timers = self.timers
        get_rerun_state_machine().current_iteration = args.iteration
        self.flops_so_far = float(args.num_floating_point_operations_so_far)
        self.flops_since_log = 0.0
        self.pg_collection = get_attr_wrapped_model(loop.model[0], "pg_collection")
        self.total_loss_dict: dict[str, Any] = {}
        self.report_memory_flag, self.first = True, True
        for chunk in loop.model:
            chunk.train()
        if args.manual_gc:  # as Megatron-LM's train(): no collection pauses inside a step
            gc.disable()
            gc.collect()
        if getattr(args, "dataloader_save", None) is None:
            args.dataloader_save = args.save  # where Megatron's hook writes the loader state

    def run_step(self, step: int, batch: Any) -> StepDone:
        from megatron.training.async_utils import maybe_finalize_async_save

        maybe_finalize_async_save(blocking=False)
        self.args.curr_iteration = step
        loop = self.loop
        outcome = run_step(batch, model=loop.model, optimizer=loop.optimizer,
                           scheduler=loop.scheduler, forward_step=loop.forward_step,
                           dp_size=loop.dp_size, pad_token_id=loop.pad_token_id,
                           width_multiple=loop.width_multiple)
        return StepDone(outcome.loss, outcome.lr, outcome.grad_norm, outcome.compute_ms,
                        outcome.should_checkpoint, outcome.should_exit, outcome.exit_code,
                        detail=outcome)

    def save(self, step: int) -> None:
        self.loop.save(step, self.flops_so_far)

    def report(self, record: StepRecord) -> None:
        import gc

        from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
        from megatron.training.training import num_floating_point_operations, training_log
        from megatron.training.utils import calc_params_l2_norm

        args, batch, outcome = self.args, record.batch, record.done.detail
        args.iteration = record.step
        args.consumed_train_samples = int(record.metrics["train/consumed_examples"])
        # FLOPs as Megatron counts them: rows of --seq-length tokens (padding included).
        step_flops = num_floating_point_operations(args, rows_of_seq_length(batch, args))
        self.flops_so_far += step_flops
        self.flops_since_log += step_flops
        optimizer = self.loop.optimizer
        params_norm = calc_params_l2_norm(self.loop.model) if args.log_params_norm else None
        self.report_memory_flag = training_log(
            outcome.loss_dict, self.total_loss_dict,
            get_canonical_lr_for_logging(optimizer.param_groups), record.step,
            optimizer.get_loss_scale().item(), self.report_memory_flag, int(outcome.skipped),
            outcome.grad_norm, params_norm, outcome.num_zeros_in_grad, 0,
            pg_collection=self.pg_collection, is_first_iteration=self.first)
        self.first = False
        if record.step % args.tensorboard_log_interval == 0:
            log_to_writers(record.metrics, record.step)
        self.log.write({
            "iteration": record.step, "epoch": batch.meta.epoch,
            "examples": [[] if row is None else list(row.example_indices)
                         for row in batch.micro_batches],
            "row_lengths": [0 if row is None else int(row.tokens.shape[1])
                            for row in batch.micro_batches],
            "block_rows": [0 if row is None else int(row.tokens.shape[0])
                           for row in batch.micro_batches],
            "num_examples": batch.meta.num_examples, "num_bins": batch.meta.num_bins,
            "micro_batches": outcome.micro_batches, "seq_length": outcome.seq_length,
            "loss": outcome.loss, "lr": outcome.lr, "grad_norm": outcome.grad_norm,
            # the loss tokens the step's rows trained (all DP ranks), and the plan's count
            "loss_tokens": _trained_tokens(outcome), "plan_loss_tokens": batch.meta.num_loss_tokens,
            "consumed_train_samples": args.consumed_train_samples, "skipped": outcome.skipped,
            "max_tokens": record.metrics.get("train/max_tokens_per_microbatch"),
            "step_ms": record.step_ms, "data_ms": record.data_ms,
            "compute_ms": outcome.compute_ms,
            "overhead_ms": record.step_ms - outcome.compute_ms, "gc_enabled": gc.isenabled(),
        })

    def validation_due(self, step: int) -> bool:
        return (self.loop.validation is not None and bool(self.args.eval_interval)
                and step % self.args.eval_interval == 0)

    def validate(self, step: int) -> None:
        import gc

        assert self.loop.validation is not None  # validation_due says so
        args = self.args
        self.timers("interval-time").stop()
        if args.manual_gc and args.manual_gc_eval:
            gc.collect()
        valid = self.loop.validation.run(f"iteration {step}", step)
        self.log.write({"iteration": step, "valid_loss": valid})
        if args.manual_gc and args.manual_gc_eval:
            gc.collect(generation=0)
        self.timers("interval-time", log_level=0).start(barrier=True)

    def end_of_step(self, step: int, *, last: bool) -> bool:
        """Megatron-LM's own post-step callbacks, then its ``checkpoint_and_decide_exit``."""
        from megatron.training import print_rank_last
        from megatron.training.training import (
            checkpoint_and_decide_exit,
            post_training_step_callbacks,
        )

        loop = self.loop
        self.flops_since_log = post_training_step_callbacks(
            loop.model, loop.optimizer, loop.scheduler, step, None, self.flops_since_log)
        stop = bool(checkpoint_and_decide_exit(loop.model, loop.optimizer, loop.scheduler, step,
                                               self.flops_so_far, loop.checkpointing_context,
                                               checkpoint_hook(loop.stream)))
        if stop:
            print_rank_last(f" graceful stop after iteration {step}: "
                            f"{self.args.consumed_train_samples} examples trained")
        return stop


def train(args: Any, loop: Loop) -> TrainResult:
    """Run iterations ``args.iteration + 1 .. args.train_iters`` through the shared step loop,
    hosted by Megatron-LM's pieces (`MegatronLMHost`)."""
    host = MegatronLMHost(args, loop)
    host.timers("interval-time", log_level=0).start(barrier=True)
    result = run_steps(host, loop.stream, start=args.iteration, stop=args.train_iters)
    _flush_writers()
    exited = result.end is LoopEnd.EXITED
    return TrainResult(result.step, host.flops_so_far,
                       should_exit=exited or result.end is LoopEnd.STOPPED,
                       exit_code=result.exit_code)


def _trained_tokens(outcome: Any) -> int | None:
    """The loss-token count the loss function summed over the step; None off the last stage."""
    sums = outcome.loss_sums.get("lm loss")
    return None if sums is None else int(sums[1])


def rows_of_seq_length(batch: Any, args: Any) -> float:
    """The step's global work in rows of ``--seq-length`` tokens, for Megatron's FLOPs count:
    packed rows are that long; padded blocks count their padded tokens."""
    padded_tokens = batch.meta.extra.get("padded_tokens")
    if padded_tokens is None:
        return float(batch.meta.num_bins)
    return float(padded_tokens) / args.seq_length


def _flush_writers() -> None:
    from megatron.training import get_tensorboard_writer

    writer = get_tensorboard_writer()
    if writer is not None:
        writer.flush()
