"""The Bridge host's side of the shared step loop: Bridge's ``train_step`` at the plan's count.

Bridge's ``train()`` asserts that the micro-batch count never falls and counts the LR schedule,
``consumed_train_samples`` and the logged batch size in rows; so the loop is the library's
(`megatron_packing.megatron.step_loop.run_steps`) and each step is Bridge's own ``train_step``
(its rerun state machine, optimizer step, loss reduction), with what a per-step count changes:

* megatron-core's num-microbatches calculator is set to the step's count before the step, so
  everything reading ``get_num_microbatches()`` sees it;
* ``train_step`` steps the LR scheduler through a view that advances by the step's real
  examples, not ``count x micro_batch_size x dp`` rows;
* every pipeline stage reads the step's rows from the same iterator, so middle stages get the
  packed boundaries too (Bridge's own forward step gives them only to its own packed datasets);
  under pipeline parallelism rows are padded to ``model.seq_length``, the activation shape
  Bridge's ``train_step`` gives the schedule;
* ``consumed_train_samples`` and the logged batch size are the step's examples, and the FLOPs
  are Bridge's THD-aware count from each row's real sequence boundaries;
* the loader state goes into Bridge's checkpoints through Bridge's own dataloader hook, and
  saves, exits and signals are Bridge's ``checkpoint_and_decide_exit``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_packing.megatron.cpu_workarounds import (
    cuda_factories_on_cpu,
    megatron_optimizer_compat,
)
from megatron_packing.megatron.forward import pad_row
from megatron_packing.megatron.step_accounting import lr_increment, sync_num_microbatches
from megatron_packing.megatron.step_loop import StepDone, StepHost, StepRecord
from megatron_packing.megatron.step_rows import step_rows
from megatron_packing.megatron.train_stream import TrainStream
from megatron_packing.packed.collate import PackedMicroBatch


class ExamplesScheduler:
    """Bridge's LR scheduler as ``train_step`` sees it for one step: stepped by the step's real
    examples whatever increment ``train_step`` computes from rows."""

    def __init__(self, scheduler: Any, examples: int) -> None:
        self._scheduler, self._examples = scheduler, examples

    def step(self, increment: int) -> None:
        self._scheduler.step(increment=self._examples)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)


def rows_counted_for_flops(rows: Iterable[Any], state: Any) -> Iterator[Any]:
    """``rows``, each added to Bridge's per-step FLOPs accumulators as it is handed out: packed
    rows by their real sequence boundaries, padded blocks as dense ``[b, L]``."""
    from megatron.bridge.training.utils.flop_utils import accumulate_flops_metadata

    for row in rows:
        if isinstance(row, PackedMicroBatch):
            accumulate_flops_metadata(state, row.tokens, cu_seqlens=row.cu_seqlens_padded,
                                      cu_seqlens_unpadded=row.cu_seqlens)
        else:
            accumulate_flops_metadata(state, row.tokens)
        yield row


def _reset_flops_accumulators(state: Any) -> None:
    for name in ("_flops_seqlen_sum", "_flops_seqlen_sq_sum", "_flops_vision_patches",
                 "_flops_cross_seqlen_sum", "_flops_cross_seqlen_product_sum"):
        setattr(state, name, 0)
    state._flops_requires_global_reduce = False


class BridgeHost(StepHost):
    """Bridge's pieces behind `run_steps`: its ``train_step``, checkpoints, writers and exits."""

    def __init__(self, state: Any, setup_output: Any, stream: TrainStream, *,
                 forward_step: Callable, pad_token_id: int, step_log_dir: str | None = None
                 ) -> None:
        from megatron.bridge.training.utils.train_utils import prepare_forward_step_func
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine
        from megatron.core.utils import get_model_config

        self.state, self.cfg = state, state.cfg
        self.model, self.optimizer = setup_output.model, setup_output.optimizer
        self.scheduler = setup_output.scheduler
        self.checkpoint_manager = setup_output.checkpoint_manager
        self.pg = setup_output.pg_collection
        self.stream, self.pad_token_id = stream, pad_token_id
        self.dp_size = self.pg.dp.size()
        planned_for = stream.loader.batch_sampler.dp_rank
        if planned_for != self.pg.dp.rank():  # the stream is this DP rank's, or nothing works
            raise RuntimeError(f"the packing stream plans data-parallel rank {planned_for}, but "
                               f"this rank is DP rank {self.pg.dp.rank()}")
        self.pipeline = self.pg.pp.size() > 1
        model_config = get_model_config(self.model[0])
        self.forward_step = prepare_forward_step_func(forward_step, state)
        self.forward_backward = get_forward_backward_func(pp_size=self.pg.pp.size(), vp_size=None)
        self.p2p = P2PCommunicator(pp_group=self.pg.pp, config=model_config)
        self.loader_hook = RerunDataIterator(stream)  # Bridge's hook asks .iterable.save_state()
        model = self.cfg.model
        self.width_multiple = (int(model.tensor_model_parallel_size)
                               if getattr(model, "sequence_parallel", False) else 1)
        get_rerun_state_machine().current_iteration = state.train_state.step
        for chunk in self.model:
            chunk.train()
        self.last_log = time.perf_counter()
        self.log = _StepLog(step_log_dir, self.pg)

    @property
    def flops_so_far(self) -> float:
        return float(self.state.train_state.floating_point_operations_so_far)

    def run_step(self, step: int, batch: Any) -> StepDone:
        from megatron.bridge.training.train import train_step
        from megatron.core.rerun_state_machine import RerunDataIterator

        self.checkpoint_manager.finalize_async_saves(state=self.state, blocking=False)
        meta = batch.meta
        count = sync_num_microbatches(meta, dp_size=self.dp_size,
                                      rank=torch.distributed.get_rank())
        if count != len(batch.micro_batches):
            raise RuntimeError(f"step {meta.step}: {len(batch.micro_batches)} rows on this rank, "
                               f"the plan says {count}")
        rows, _ = step_rows(batch, pipeline=False, pad_token_id=self.pad_token_id,
                            width_multiple=self.width_multiple)
        if self.pipeline:  # Bridge's train_step gives the schedule model.seq_length
            length = int(self.cfg.model.seq_length)
            rows = [pad_row(row, length, self.pad_token_id)
                    if isinstance(row, PackedMicroBatch) else row for row in rows]
        _reset_flops_accumulators(self.state)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the LR this step trains with
        started = time.perf_counter()
        with cuda_factories_on_cpu(), megatron_optimizer_compat():
            (loss_dict, skipped, should_checkpoint, should_exit, exit_code, grad_norm,
             num_zeros, _) = train_step(
                self.forward_step, RerunDataIterator(rows_counted_for_flops(rows, self.state)),
                self.model, self.optimizer, ExamplesScheduler(self.scheduler, lr_increment(meta)),
                self.state, self.pg, self.forward_backward, self.p2p)
        loss = loss_dict.get("lm loss")
        return StepDone(None if loss is None else float(loss), lr,
                        None if grad_norm is None else float(grad_norm),
                        (time.perf_counter() - started) * 1000, bool(should_checkpoint),
                        bool(should_exit), int(exit_code or 0),
                        detail={"skipped": bool(skipped), "micro_batches": count,
                                "num_zeros": num_zeros})

    def save(self, step: int) -> None:
        from megatron.bridge.training.train import save_checkpoint_and_time

        self.state.train_state.step = step
        with cuda_factories_on_cpu():
            save_checkpoint_and_time(self.state, self.model, self.optimizer, self.scheduler,
                                     self.flops_so_far, self.checkpoint_manager,
                                     train_data_iterator=self.loader_hook,
                                     pg_collection=self.pg)

    def report(self, record: StepRecord) -> None:
        from megatron.bridge.training.utils import flop_utils

        cfg, train_state, meta = self.cfg, self.state.train_state, record.batch.meta
        train_state.step = record.step
        train_state.consumed_train_samples = int(record.metrics["train/consumed_examples"])
        stats = flop_utils.resolve_global_flops_runtime_stats(
            self.state, data_parallel_size=self.dp_size, vp_size=None, dp_group=self.pg.dp,
            include_cross_attention_stats=hasattr(
                cfg.model, "_get_num_floating_point_operations_with_runtime_stats"))
        seqlen_sum, seqlen_sq_sum, patches, cross_sum, cross_product = stats
        step_flops = float(flop_utils.num_floating_point_operations(
            cfg, batch_size=meta.num_bins, seqlen_sum=seqlen_sum,
            seqlen_squared_sum=seqlen_sq_sum, num_vision_patches=patches,
            cross_seqlen_sum=cross_sum, cross_seqlen_product_sum=cross_product))
        train_state.floating_point_operations_so_far += step_flops
        done, detail = record.done, record.done.detail
        metrics = dict(record.metrics)
        metrics["batch-size"] = int(meta.num_examples)  # Bridge's name; examples, not rows
        metrics["learning-rate"] = done.lr
        metrics["perf/step_flops"] = step_flops
        if done.loss is not None:
            metrics["lm loss"] = done.loss
        self._write(metrics, record.step)
        self.log.write({
            "iteration": record.step, "epoch": meta.epoch,
            "examples": [[] if row is None else list(row.example_indices)
                         for row in record.batch.micro_batches],
            "num_examples": meta.num_examples, "num_bins": meta.num_bins,
            "doc_lengths": [_doc_lengths(row) for row in record.batch.micro_batches],
            "num_tokens": meta.num_tokens, "plan_loss_tokens": meta.num_loss_tokens,
            "micro_batches": detail["micro_batches"], "loss": done.loss, "lr": done.lr,
            "grad_norm": done.grad_norm, "skipped": detail["skipped"],
            "consumed_train_samples": train_state.consumed_train_samples,
            "flops": step_flops, "flops_so_far": train_state.floating_point_operations_so_far,
            "seqlen_sq_sum": None if seqlen_sq_sum is None else int(seqlen_sq_sum),
            "step_ms": record.step_ms, "compute_ms": done.compute_ms,
            "overhead_ms": record.step_ms - done.compute_ms,
        })
        if record.step % max(1, int(cfg.logger.log_interval)) == 0:
            self._print(record, metrics, step_flops)

    def _write(self, metrics: dict[str, float], step: int) -> None:
        """To Bridge's own TensorBoard and W&B writers (present on the last rank)."""
        writer = self.state.tensorboard_logger
        if writer is not None:
            for key, value in metrics.items():
                writer.add_scalar(key, value, step)
        wandb_writer = self.state.wandb_logger
        if wandb_writer is not None:
            wandb_writer.log(metrics, step)

    def _print(self, record: StepRecord, metrics: dict[str, float], step_flops: float) -> None:
        from megatron.bridge.utils.common_utils import print_rank_last

        now = time.perf_counter()
        elapsed = now - self.last_log
        self.last_log = now
        loss = record.done.loss
        seconds = max(record.step_ms / 1000, 1e-9)
        tflops = step_flops / seconds / 1e12 / torch.distributed.get_world_size()
        print_rank_last(
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {record.step:8d}/"
            f"{self.cfg.train.train_iters:8d} | consumed samples: "
            f"{self.state.train_state.consumed_train_samples:12d} | global batch size: "
            f"{int(metrics['batch-size']):5d} | micro-batches: "
            f"{record.done.detail['micro_batches']} | learning rate: {record.done.lr:.6E} | "
            + ("" if loss is None else f"lm loss: {loss:.6E} | ")
            + f"TFLOP/s per rank: {tflops:.3f} | wall {elapsed:.2f} s")

    def end_of_step(self, step: int, *, last: bool) -> bool:
        """Bridge's own ``checkpoint_and_decide_exit`` (signals, intervals, duration)."""
        from megatron.bridge.training.train import checkpoint_and_decide_exit, maybe_run_manual_gc

        train = self.cfg.train
        maybe_run_manual_gc(train.manual_gc, train.manual_gc_interval, step)
        with cuda_factories_on_cpu():
            return bool(checkpoint_and_decide_exit(
                self.state, self.model, self.optimizer, self.scheduler, self.flops_so_far,
                self.checkpoint_manager, self.loader_hook, pg_collection=self.pg))


def _doc_lengths(row: Any) -> list[int]:
    """The real sequence lengths in one of this rank's rows (empty for a dummy or a block)."""
    if not isinstance(row, PackedMicroBatch):
        return []
    return [int(n) for n in torch.diff(row.cu_seqlens.view(-1)).tolist()]


class _StepLog:
    """Per-step JSONL records, one file per rank, naming the rank's DP/TP/PP coordinates."""

    def __init__(self, directory: str | None, pg: Any) -> None:
        self._path = None
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._path = Path(directory) / f"steps_rank{torch.distributed.get_rank()}.jsonl"
            self._where = {"dp": pg.dp.rank(), "tp": pg.tp.rank(), "pp": pg.pp.rank()}

    def write(self, record: dict[str, Any]) -> None:
        if self._path is not None:
            with open(self._path, "a") as f:
                f.write(json.dumps({**self._where, **record}) + "\n")
