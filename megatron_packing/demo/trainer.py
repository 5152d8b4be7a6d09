"""The end-to-end CPU trainer: DP ranks on gloo, a tiny megatron-core GPT, packed SFT batches.

`train` launches ``train.dp_size`` processes. Each builds the dataset, this rank's
`build_sft_dataloader` and its parts (`build_parts`), then runs the library's step loop
(`megatron_packing.megatron.step_loop.run_steps`, the loop the Megatron-LM entry point runs)
with `DemoHost`: megatron-core's schedule over the step's micro-batches (their number varies
per step), the optimizer step and megatron-core's LR schedule stepped by real examples. The
steps are packed rows, or padded ``[b, L]`` blocks (``use_sequence_packing: false``: a token
budget or a fixed ``micro_batch_size``, every rank running the step's agreed count with
zero-loss dummies). ``train.backend`` wraps the model in megatron-core's DDP with
megatron-core's optimizer (``megatron_ddp``) or shards it with torch's FSDP2 and AdamW
(``fsdp2``). Rank 0 logs the step metrics (JSONL, W&B) and the validation losses; all ranks
checkpoint model, optimizer, LR schedule and the training stream's state every
``train.checkpoint_every`` steps; ``resume`` continues exactly.

Before any rank starts, the launcher takes each output directory's run lock, tokenizes (or
loads the cached index), refuses an empty dataset and verifies the checkpoint to resume
from. Under torchrun the same happens in rank 0 while the other ranks wait. SIGINT / SIGTERM
stop every rank at the same step with a final checkpoint (see `demo.launch`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_packing.common import quiet_start
from megatron_packing.config.training import TrainingConfig
from megatron_packing.demo.checkpoint import (
    SHARED,
    check_setup,
    find_resume_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from megatron_packing.demo.launch import (
    RunInterrupted,
    agreed_stop_signal,
    dp_group,
    run_as_torchrun_rank,
    spawn_data_parallel,
    torchrun_rank,
)
from megatron_packing.demo.run_dir import check_output_path, claim_output_dir
from megatron_packing.demo.run_lock import hold_output_dirs
from megatron_packing.demo.weights import WeightsMismatch, load_weights, save_weights
from megatron_packing.demo.write_faults import (
    WriteFault,
    is_write_error,
    naming,
    write_faults_named,
)
from megatron_packing.loader.metrics import (
    JsonlLogger,
    MetricsLogger,
    MultiLogger,
    read_jsonl,
    truncate_jsonl,
    wandb_run_id,
)
from megatron_packing.megatron.fsdp2 import wrap_in_fsdp2
from megatron_packing.megatron.step_loop import LoopEnd, StepDone, StepHost, StepRecord, run_steps
from megatron_packing.megatron.train_stream import EmptyEpoch, TrainStream

METRICS_FILE = "metrics.jsonl"
VALID_FILE = "valid.jsonl"  # validation losses, one record per validation
SUMMARY_FILE = "summary.json"
NO_COUNT_AGREEMENT_ENV = "MEGATRON_PACKING_TEST_NO_COUNT_AGREEMENT"
"""TEST ONLY. Set to 1, padded steps drop their dummy micro-batches, so each rank runs its own
count. FSDP2 then fails or hangs: the tests use it to show that the count agreement is what
keeps the ranks in step. Never set it in a real run."""


@dataclass
class RunSpec:
    """One training run inside a launch: where it writes and how far it goes."""

    output_dir: str
    resume: bool = False
    stop_after: int | None = None  # stop (with a checkpoint) once this many steps are done
    num_workers: int | None = None  # overrides train.num_workers
    use_wandb: bool = True
    quiet: bool = False
    overwrite: bool = False  # replace a run already in output_dir (else refused unless resume)


def train(cfg: TrainingConfig, *, output_dir: str | None = None, resume: bool = False,
          use_wandb: bool = True, stop_after: int | None = None,
          num_workers: int | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Train with ``cfg`` in fresh processes; return the run summary (also in summary.json).

    A directory that already holds a run needs ``resume`` (continue it) or ``overwrite``.
    """
    spec = RunSpec(output_dir=output_dir or cfg.train.output_dir, resume=resume,
                   stop_after=stop_after, num_workers=num_workers,
                   use_wandb=use_wandb and cfg.logging.wandb, overwrite=overwrite)
    return launch_runs(cfg, [spec])[0]


class TrainingError(RuntimeError):
    """A run that cannot start or go on (empty dataset, unusable checkpoint, ...)."""


class PeerFailed(TrainingError):
    """Under torchrun: rank 0's refusal, raised on the other ranks (rank 0 alone prints it)."""


def _refusals() -> tuple[type[BaseException], ...]:
    from megatron_packing.common.validation import ConfigError
    from megatron_packing.data import BadRecordError, CorruptStoreError
    from megatron_packing.demo.checkpoint import CheckpointError
    from megatron_packing.stream.fetch import FetchedExampleError

    return (ConfigError, CheckpointError, TrainingError, BadRecordError, CorruptStoreError,
            FetchedExampleError)


REFUSALS = _refusals()
"""The errors a rank raises for its input (config, data, checkpoint), not for a bug: the
launcher reports them as one message with exit code 2."""


def launch_runs(cfg: TrainingConfig, specs: list[RunSpec]) -> list[dict[str, Any]]:
    """Run several specs one after another in one process launch (saves start-up time).

    Spawns ``train.dp_size`` ranks, or runs as one rank when started by torchrun.
    """
    launched = torchrun_rank()
    if launched is None:
        for spec in specs:
            check_output_path(spec.output_dir)
        outputs = [s.output_dir for s in specs]
        with write_faults_named(outputs), hold_output_dirs(outputs):
            _prepare_launch(cfg, specs)
            spawn_data_parallel(_worker, cfg.train.dp_size, cfg, specs, refusals=REFUSALS,
                                faults=(WriteFault,))
    else:
        if launched[1] != cfg.train.dp_size:
            raise TrainingError(f"torchrun started {launched[1]} processes but train.dp_size is "
                                f"{cfg.train.dp_size}: use --nproc-per-node "
                                f"{cfg.train.dp_size} or set train.dp_size: {launched[1]}")
        run_as_torchrun_rank(_torchrun_worker, cfg, specs)
    return [json.loads((Path(s.output_dir) / SUMMARY_FILE).read_text()) for s in specs]


def _prepare_launch(cfg: TrainingConfig, specs: list[RunSpec]) -> None:
    """Everything that can fail before the ranks start: the output directory (a run in it
    needs resume or overwrite), data, and checkpoints to resume."""
    for spec in specs:
        for note in claim_output_dir(spec.output_dir, resume=spec.resume,
                                     overwrite=spec.overwrite):
            print(f"[train] {note}", flush=True)
    from megatron_packing.data import BadRecordError, CorruptStoreError

    cfg.packing.check_token_ids(_vocab_size(cfg), source="the training YAML")
    try:  # tokenized once here: the ranks only read the cached index
        dataset = _load_dataset(cfg)
    except (BadRecordError, CorruptStoreError):
        raise
    except (ValueError, OSError) as exc:  # an unreadable tokenizer or data file
        if is_write_error(exc):  # the length-index cache cannot be written: a write fault
            raise
        raise TrainingError(f"cannot load the data ({', '.join(cfg.data.paths)}): {exc}") from None
    if len(dataset) == 0:
        skipped = dict(dataset.skipped) if hasattr(dataset, "skipped") else {}
        detail = (f"every record was skipped as bad ({sum(skipped.values())} records: "
                  f"{skipped})" if skipped else "the files hold no records")
        raise TrainingError(f"no examples to train on in {', '.join(cfg.data.paths)}: {detail}")
    from megatron_packing.stream.fetch import check_loss_targets

    try:
        check_loss_targets(dataset, dataset.loss_token_counts)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
    if not cfg.packing.use_sequence_packing:
        _check_padded_lengths(cfg, dataset)
    if cfg.data.valid_paths:  # tokenized once here too; an empty set is refused by name
        try:
            valid = _load_dataset(cfg, cfg.data.valid_paths)
        except (BadRecordError, CorruptStoreError):
            raise
        except (ValueError, OSError) as exc:
            raise TrainingError(f"cannot load the validation data "
                                f"({', '.join(cfg.data.valid_paths)}): {exc}") from None
        if len(valid) == 0:
            raise TrainingError(f"data.valid_paths ({', '.join(cfg.data.valid_paths)}) holds no "
                                "examples to validate on; remove it or give it records")
        if not cfg.packing.use_sequence_packing:
            _check_padded_lengths(cfg, valid)
    setup = resume_setup(cfg, dataset)
    for spec in specs:
        if spec.resume:
            chosen, notes = find_resume_checkpoint(spec.output_dir, cfg.train.dp_size)
            for note in notes:
                print(f"[train] {note}", flush=True)
            if chosen is not None:
                check_setup(chosen, setup)
                print(f"[train] resuming from {chosen}", flush=True)


def _check_padded_lengths(cfg: TrainingConfig, dataset: Any) -> None:
    """Padded mode: each example is one row, so the longest must fit the model's positions."""
    limit = cfg.model.max_position_embeddings
    if limit is None:
        return  # the model is sized to the longest example
    lengths = np.asarray(dataset.lengths)
    longest = int(lengths.argmax())
    if int(lengths[longest]) > limit:
        raise TrainingError(
            f"example {longest} has {int(lengths[longest])} tokens, more than "
            f"model.max_position_embeddings ({limit}): in padded mode every example is one row "
            f"of the model's positions; raise model.max_position_embeddings to at least "
            f"{int(lengths.max())} or unset it (the model then has the longest example's length)")


def model_positions(cfg: TrainingConfig, dataset: Any) -> int:
    """The model's position count: the setting, else the packed row (bin_capacity) or, in
    padded mode, the dataset's longest example."""
    if cfg.model.max_position_embeddings is not None:
        return cfg.model.max_position_embeddings
    if cfg.packing.use_sequence_packing:
        return cfg.packing.bin_capacity
    return int(np.asarray(dataset.lengths).max())


RESUME_FIXED = {
    "train": ("lr", "min_lr", "warmup_steps", "weight_decay", "backend"),
    "model": ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "max_position_embeddings", "dtype", "init_seed"),
    "data": ("loss_on", "on_bad_record"),
}
"""Settings a checkpoint fixes: the optimizer and LR schedule restore lr, weight decay and the
schedule's shape (the backend decides the optimizer state's layout), the model its shapes and weights, the data options its loss masks. A changed
one would be silently replaced (or fail inside torch), so a resume refuses it by name."""


def resume_setup(cfg: TrainingConfig, dataset: Any) -> dict[str, Any]:
    """What a checkpoint records and a resume must find unchanged (JSON values)."""
    setup: dict[str, Any] = {f"{section}.{key}": getattr(getattr(cfg, section), key)
                             for section, keys in RESUME_FIXED.items() for key in keys}
    counts = np.ascontiguousarray(dataset.loss_token_counts, dtype=np.int64)
    setup["data.loss_targets_sha256"] = hashlib.sha256(counts.tobytes()).hexdigest()[:24]
    setup["model.vocab_size"] = _vocab_size(cfg)
    return setup


def _torchrun_worker(rank: int, world: int, cfg: TrainingConfig, specs: list[RunSpec]) -> None:
    """Rank 0 holds the locks and prepares; every rank learns its outcome, then trains."""
    with ExitStack() as stack:
        error = None
        fault = False
        if rank == 0:
            try:
                outputs = [s.output_dir for s in specs]
                with write_faults_named(outputs):
                    stack.enter_context(hold_output_dirs(outputs))
                    _prepare_launch(cfg, specs)
            except WriteFault as exc:
                error, fault = str(exc), True
            except Exception as exc:  # shared with the other ranks, then raised everywhere
                error = f"{type(exc).__name__}: {exc}"
        outcome = [error, fault]
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0] is not None:
            if rank == 0:
                raise (WriteFault if outcome[1] else TrainingError)(outcome[0])
            raise PeerFailed(f"rank 0 failed: {outcome[0]}")
        stopped_by = _worker(rank, world, cfg, specs)
    if stopped_by:
        raise RunInterrupted(stopped_by, "every rank stopped at the same step")


def _load_dataset(cfg: TrainingConfig, paths: list[str] | None = None) -> Any:
    """The training data (or ``paths``: the validation data) through the length index, loaded
    by one process (the launcher, or rank 0 under torchrun), which builds a missing entry
    alone."""
    from megatron_packing.config.data_loading import load_data_split

    return load_data_split(cfg.data, cfg.data.paths if paths is None else paths,
                           resolve=cfg.resolve, build_sharers=1)


def _vocab_size(cfg: TrainingConfig) -> int:
    from megatron_packing.data.tokenize import load_tokenizer

    return len(load_tokenizer(cfg.resolve(cfg.data.tokenizer)))


def _worker(rank: int, world: int, cfg: TrainingConfig, specs: list[RunSpec]) -> int:
    """Run the specs in order; return the stop signal that ended them early (0: none)."""
    for spec in specs:
        with write_faults_named([spec.output_dir]):
            stopped_by = _run(rank, world, cfg, spec)
        if stopped_by:
            return stopped_by
    return 0


@dataclass
class DemoParts:
    """What one rank of the demo trains with, built once per run by `build_parts`."""

    cfg: TrainingConfig
    rank: int
    group: Any
    model: Any
    optimizer: Any
    scheduler: Any
    stream: TrainStream
    setup: dict[str, Any]  # what a checkpoint records and a resume must find unchanged
    sharded: bool  # torch FSDP2 (the model's parameters are shards)
    valid_loader: Any = None  # data.valid_paths, one eval_mode pass per validation
    model_calls: list[int] = dataclasses.field(default_factory=lambda: [0])
    agree_counts: bool = True  # False only under NO_COUNT_AGREEMENT_ENV (tests)
    num_examples: int = 0  # in the training data

    @property
    def loss_from_logits(self) -> bool:
        """float64 runs compute the cross-entropy in float64 too (megatron's is float32)."""
        return self.cfg.model.dtype == "float64"

    def state(self) -> dict[str, Any]:
        """This rank's own part of a checkpoint: the LR schedule and the stream's state."""
        return {"scheduler": self.scheduler.state_dict(), "dataloader": self.stream.state_dict()}

    def write_weights(self, directory: Path) -> None:
        """The model and optimizer, sharded, into ``directory`` (collective; `demo.weights`)."""
        save_weights(self.model, self.optimizer, directory, fsdp2=self.sharded)

    def restore(self, checkpoint: Path) -> int:
        """Load this rank's part of ``checkpoint``; returns the steps it had done."""
        state = load_checkpoint(checkpoint, self.rank, dist.get_world_size(self.group))
        weights = checkpoint / SHARED
        if not weights.is_dir():
            raise TrainingError(f"checkpoint {checkpoint} has no {SHARED}/ directory (the model "
                                "and optimizer); it was written by an older version of the "
                                "demo: start a new run")
        try:
            load_weights(self.model, self.optimizer, weights, fsdp2=self.sharded)
            self.scheduler.load_state_dict(state["scheduler"])
        except (WeightsMismatch, KeyError, RuntimeError, ValueError) as exc:
            raise TrainingError(f"checkpoint {checkpoint} does not fit this run's model or "
                                f"optimizer ({str(exc).splitlines()[0][:300]}); resume with the "
                                "model settings it was saved with, or start a new run") from None
        try:
            self.stream.load_state_dict(state["dataloader"])
        except ValueError as exc:
            raise TrainingError(f"checkpoint {checkpoint}: {exc}") from None
        return int(state["step"])

    def step(self, batch: Any) -> StepDone:
        """One optimizer step over this rank's micro-batches (`train_step`)."""
        from megatron_packing.demo.train_step import train_step

        if not self.agree_counts:
            batch = _own_count_only(batch)
        began = time.perf_counter()
        # megatron-core's optimizer clips (its OptimizerConfig.clip_grad); FSDP2's is torch's.
        clip = self.cfg.train.clip_grad if self.sharded else None
        result = train_step(self.model, self.optimizer, batch, scheduler=self.scheduler,
                            dp_group=self.group, clip_grad=clip,
                            loss_from_logits=self.loss_from_logits)
        return StepDone(result.loss, result.lr, result.grad_norm,
                        compute_ms=(time.perf_counter() - began) * 1000)

    def validate(self, step: int) -> float:
        """The validation set's token-mean loss (`evaluate`)."""
        from megatron_packing.demo.train_step import evaluate

        return evaluate(self.model, self.valid_loader, dp_group=self.group,
                        loss_from_logits=self.loss_from_logits)


def build_parts(rank: int, world: int, cfg: TrainingConfig, num_workers: int) -> DemoParts:
    """The rank's loader stream, tiny GPT (replicated or FSDP2-sharded), AdamW and
    megatron-core's LR schedule in examples, and the validation loader."""
    from megatron_packing.demo.model import build_tiny_gpt
    from megatron_packing.demo.train_step import broadcast_parameters, example_schedule
    from megatron_packing.loader.dataloader import build_sft_dataloader
    from megatron_packing.megatron.step_accounting import examples_the_run_trains

    tc, group = cfg.train, dp_group()
    dataset = _load_dataset(cfg)
    # The example order's one seed is packing.seed (the loader's default).
    loader = build_sft_dataloader(dataset, cfg.packing, dp_rank=rank, dp_size=world,
                                  total_steps=tc.steps, num_workers=num_workers)
    model = build_tiny_gpt(cfg.model, vocab_size=_vocab_size(cfg),
                           max_seq_len=model_positions(cfg, dataset))
    broadcast_parameters(model, group=group)
    sharded = tc.backend == "fsdp2"
    if sharded:  # torch's FSDP2: gradients in the shards' .grad, torch's AdamW steps them
        model = wrap_in_fsdp2(model, group)
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=tc.lr,
                                           weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    else:  # megatron-core's DDP (main_grad buffers) and megatron-core's optimizer
        model, optimizer = _megatron_ddp_and_optimizer(model, tc)
    model_calls = _count_calls(model)
    batch_size = cfg.packing.global_batch_size
    scheduler = example_schedule(
        optimizer, lr=tc.lr, min_lr=tc.min_lr, weight_decay=tc.weight_decay,
        warmup_examples=tc.warmup_steps * batch_size,
        total_examples=examples_the_run_trains(tc.steps, len(loader), len(dataset), batch_size))
    valid_loader = None
    if cfg.data.valid_paths:
        valid_loader = build_sft_dataloader(_load_dataset(cfg, cfg.data.valid_paths),
                                            cfg.packing, dp_rank=rank, dp_size=world,
                                            eval_mode=True)
    return DemoParts(cfg, rank, group, model, optimizer, scheduler, TrainStream(loader),
                     resume_setup(cfg, dataset), sharded, valid_loader, model_calls,
                     agree_counts=os.environ.get(NO_COUNT_AGREEMENT_ENV, "") != "1",
                     num_examples=len(dataset))


def _megatron_ddp_and_optimizer(model: Any, tc: Any) -> tuple[Any, Any]:
    """megatron-core ``DistributedDataParallel`` around the model and megatron-core's Adam
    (clipping, and Megatron's rule of no weight decay on biases and norm weights)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_packing.megatron.ddp import build_megatron_optimizer, wrap_in_ddp

    ddp = wrap_in_ddp(model, DistributedDataParallelConfig(grad_reduce_in_fp32=False,
                                                           use_distributed_optimizer=False))
    optimizer = build_megatron_optimizer(ddp, OptimizerConfig(
        optimizer="adam", lr=tc.lr, min_lr=tc.min_lr, weight_decay=tc.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, clip_grad=tc.clip_grad, bf16=False, fp16=False,
        use_distributed_optimizer=False))
    return ddp, optimizer


def _run(rank: int, world: int, cfg: TrainingConfig, spec: RunSpec) -> int:
    """One run on this rank: build, restore, the shared step loop, the summary."""
    started = time.perf_counter()
    tc = cfg.train
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    workers = tc.num_workers if spec.num_workers is None else spec.num_workers
    parts = build_parts(rank, world, cfg, workers)
    start_step = 0
    latest = resume_checkpoint(out)[0] if spec.resume else None
    if latest is not None:
        start_step = parts.restore(latest)
    elif spec.resume and rank == 0:
        print(f"[train] no checkpoint under {out}; starting from step 0", flush=True)

    logger = _make_logger(cfg, spec, out, rank, start_step)
    stop = min(tc.steps, spec.stop_after) if spec.stop_after is not None else tc.steps
    quiet_start.report("[train] ", show=rank == 0 and not spec.quiet)
    if rank == 0 and not spec.quiet:
        print(f"[train] dp={world} steps {start_step}->{stop} of {tc.steps}, "
              f"B={cfg.packing.global_batch_size} v={cfg.packing.v} "
              f"{_mode_text(cfg)} backend={tc.backend} workers={workers}", flush=True)
    host = DemoHost(parts, out=out, logger=logger, log_every=0 if spec.quiet else tc.log_every,
                    last_saved=start_step)
    try:
        result = run_steps(host, parts.stream, start=start_step, stop=stop)
    except EmptyEpoch:
        raise TrainingError(f"the dataloader yields no step from {parts.num_examples} "
                            "examples") from None
    stopped_by = host.stopped_by if result.end is LoopEnd.STOPPED else 0
    if result.end is LoopEnd.COMPLETED and result.step == tc.steps and \
            host.validation_due(result.step, final=True):
        host.validate(result.step)  # as Megatron-LM's pretrain(): a validation after training
    parts.stream.close()
    if logger is not None:
        with naming(out / METRICS_FILE):
            logger.finish()
    calls: list[int] = [0] * world
    dist.all_gather_object(calls, parts.model_calls[0], group=parts.group)
    if rank == 0:
        summary = summarize(out, total_steps=tc.steps, seconds=time.perf_counter() - started)
        summary["model_calls_per_rank"] = calls  # this launch's forward calls, rank by rank
        with naming(out / SUMMARY_FILE):
            (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
        if cfg.logging.plot:
            plot_metrics(out)
    dist.barrier()
    return stopped_by


class DemoHost(StepHost):
    """The CPU demo's side of `run_steps`: its step, metrics, checkpoints and stop signal."""

    def __init__(self, parts: DemoParts, *, out: Path, logger: MetricsLogger | None,
                 log_every: int, last_saved: int) -> None:
        self.parts, self.out, self.logger, self.log_every = parts, out, logger, log_every
        self.rank, self.train = parts.rank, parts.cfg.train
        self.last_saved = last_saved
        self.last_validated = -1
        self.stopped_by = 0  # the signal that stopped the run (0: none)
        if self.rank == 0 and parts.valid_loader is not None:
            # validations redone after a resume are written again
            truncate_jsonl(out / VALID_FILE, keep_steps_below=last_saved + 1)

    def run_step(self, step: int, batch: Any) -> StepDone:
        return self.parts.step(batch)

    def save(self, step: int) -> None:
        save_checkpoint(self.out, step, self.rank, self.parts.state(),
                        keep=self.train.checkpoint_keep, setup=self.parts.setup,
                        write_shared=self.parts.write_weights)
        self.last_saved = step

    def report(self, record: StepRecord) -> None:
        if self.logger is not None:
            with naming(self.out / METRICS_FILE):
                self.logger.log(record.metrics, step=record.step - 1)
        meta, done = record.batch.meta, record.done
        if self.rank == 0 and self.log_every and (record.step % self.log_every == 0
                                                   or record.step == 1):
            print(f"[train] step {record.step:4d}  loss {done.loss:.4f}  "
                  f"examples {meta.num_examples:3d}  bins {meta.num_bins:3d}  "
                  f"fill {meta.token_fill:.3f}  lr {done.lr:.2e}", flush=True)

    def validation_due(self, step: int, *, final: bool = False) -> bool:
        """Every ``train.eval_every`` steps, and (``final``) after training unless just done."""
        if self.parts.valid_loader is None or self.last_validated == step:
            return False
        every = self.train.eval_every
        return final or (every > 0 and step % every == 0)

    def validate(self, step: int) -> None:
        """The validation loss after ``step`` steps, in valid.jsonl (rank 0)."""
        loss = self.parts.validate(step)
        self.last_validated = step
        if self.rank == 0:
            with naming(self.out / VALID_FILE), open(self.out / VALID_FILE, "a") as f:
                f.write(json.dumps({"step": step, "valid/loss": loss}) + "\n")
            if self.log_every:
                print(f"[train] validation after step {step}: loss {loss:.4f}", flush=True)

    def end_of_step(self, step: int, *, last: bool) -> bool:
        """Save every ``checkpoint_every`` steps and at the last; stop, with a checkpoint, when
        any rank received SIGINT / SIGTERM (the ranks agree, so all stop at this step)."""
        if step % self.train.checkpoint_every == 0 or last:
            self.save(step)
        self.stopped_by = agreed_stop_signal(self.parts.group)
        if not self.stopped_by:
            return False
        if self.last_saved != step:
            self.save(step)
        if self.rank == 0:
            print(f"[train] stop requested: stopped after step {step} of {self.train.steps}; "
                  f"checkpoint {latest_checkpoint(self.out)}; --resume continues", flush=True)
        return True


def _mode_text(cfg: TrainingConfig) -> str:
    p = cfg.packing
    if p.use_sequence_packing:
        return f"C={p.bin_capacity}"
    if p.max_tokens_per_microbatch is not None:
        return f"padded, budget {p.max_tokens_per_microbatch} tokens"
    return f"padded, micro_batch_size {p.micro_batch_size}"


def _count_calls(model: torch.nn.Module) -> list[int]:
    """A one-item counter of the model's forward calls (a forward pre-hook adds 1 each call)."""
    counter = [0]

    def count(module: torch.nn.Module, args: Any) -> None:
        counter[0] += 1

    model.register_forward_pre_hook(count)
    return counter


def _own_count_only(batch: Any) -> Any:
    """TEST ONLY (`NO_COUNT_AGREEMENT_ENV`): a padded step without its dummy micro-batches."""
    from megatron_packing.padded.collate import PaddedBatch

    if not isinstance(batch, PaddedBatch):
        return batch
    real: list[Any] = [mb for mb in batch.micro_batches if mb is not None]
    meta = dataclasses.replace(batch.meta, micro_batches_per_rank=0)  # counts differ by rank
    return dataclasses.replace(batch, micro_batches=real, meta=meta)


def _make_logger(cfg: TrainingConfig, spec: RunSpec, out: Path, rank: int,
                 start_step: int) -> MetricsLogger | None:
    if rank != 0:
        return None
    metrics_path = out / METRICS_FILE
    logged_through = -1
    if start_step == 0:
        metrics_path.unlink(missing_ok=True)
    else:
        logged_through = truncate_jsonl(metrics_path, keep_steps_below=start_step)
    loggers: list[MetricsLogger] = [JsonlLogger(metrics_path)] if cfg.logging.jsonl else []
    if spec.use_wandb and cfg.logging.wandb:
        from megatron_packing.loader.metrics import WandbLogger

        # A resumed run continues the same W&B run and does not send its steps again.
        loggers.append(WandbLogger(project=cfg.logging.wandb_project,
                                   run_name=cfg.logging.run_name, directory=out,
                                   config=dataclasses.asdict(cfg), mode=cfg.logging.wandb_mode,
                                   run_id=wandb_run_id(out, resume=start_step > 0),
                                   logged_through=logged_through))
    return MultiLogger(loggers)


def summarize(output_dir: str | Path, *, total_steps: int, seconds: float) -> dict[str, Any]:
    """Totals over every logged step of the run (across resumes)."""
    records = read_jsonl(Path(output_dir) / METRICS_FILE)
    if not records:
        return {"steps": 0}
    losses = [r["train/loss"] for r in records]
    tail = max(1, min(5, len(losses)))
    return {
        "steps": len(records),
        "scheduled_steps": total_steps,
        "examples": sum(r["train/actual_batch_size"] for r in records),
        "real_tokens": sum(r["train/actual_num_tokens"] for r in records),
        "loss_tokens": sum(r["train/loss_tokens"] for r in records),
        "mean_token_fill": sum(r["train/token_fill"] for r in records) / len(records),
        "padding_bins": sum(r["train/padding_bins"] for r in records),
        "placeholder_bins": sum(r["train/placeholder_bins"] for r in records),
        "mean_dp_imbalance": sum(r["train/dp_imbalance"] for r in records) / len(records),
        "max_dp_imbalance": max(r["train/dp_imbalance"] for r in records),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "first_loss_mean5": sum(losses[:tail]) / tail,
        "last_loss_mean5": sum(losses[-tail:]) / tail,
        "seconds_this_launch": round(seconds, 1),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable end-of-run report."""
    if not summary.get("steps"):
        return "no steps trained"
    return "\n".join([
        f"steps            {summary['steps']} (scheduled {summary['scheduled_steps']})",
        f"examples         {summary['examples']}",
        f"real tokens      {summary['real_tokens']}",
        f"loss tokens      {summary['loss_tokens']}",
        f"token fill       {summary['mean_token_fill']:.3f} (mean per step)",
        f"padding bins     {summary['padding_bins']} (placeholder rows {summary['placeholder_bins']})",
        f"dp imbalance     {summary['mean_dp_imbalance']:.3f} mean, {summary['max_dp_imbalance']:.3f} max",
        f"loss             {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} "
        f"(first 5 mean {summary['first_loss_mean5']:.4f}, last 5 mean {summary['last_loss_mean5']:.4f})",
    ])


def plot_metrics(output_dir: str | Path) -> Path | None:
    """PNG of loss, actual batch size and token fill per step (matplotlib, Agg backend).

    Without matplotlib the plot is skipped with a warning (None): the run itself succeeded.
    """
    try:
        import matplotlib
    except ImportError:
        print("[train] warning: matplotlib is not installed, skipping metrics.png "
              "(pip install matplotlib, or the package's [demo] extra)", file=sys.stderr,
              flush=True)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(Path(output_dir) / METRICS_FILE)
    if not records:
        return None
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    panels = (("train/loss", "loss"), ("train/actual_batch_size", "examples per step"),
              ("train/token_fill", "token fill"))
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.plot(steps, [r[key] for r in records], marker=".", linewidth=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.suptitle("megatron_packing CPU demo")
    fig.tight_layout()
    path = Path(output_dir) / "metrics.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
