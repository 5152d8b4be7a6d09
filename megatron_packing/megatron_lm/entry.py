"""``python -m megatron_packing.megatron_lm``: packed, DP-aligned SFT with Megatron-LM's machinery.

Run it like ``pretrain_gpt.py``, under ``torchrun``, with the usual Megatron arguments plus
``--packing-config train.yaml``. With megatron-core 0.19 it runs from the wheel's
``megatron.training``; with 0.16, from a Megatron-LM checkout (its folder on ``PYTHONPATH``):

    torchrun --nproc-per-node 8 -m megatron_packing.megatron_lm \\
        --packing-config sft.yaml --calculate-per-token-loss --micro-batch-size 1 \\
        --global-batch-size 128 --seq-length 4096 --train-iters 2000 ... (model, optimizer,
        parallelism, --save / --load, --tensorboard-dir, --wandb-project as usual)

Megatron-LM builds everything but the data and the step loop: ``initialize_megatron``, the GPT
model (a checkout's ``model_provider`` + ``gpt_builders``, or the library's provider from
megatron-core's layer specs: `megatron_packing.megatron_lm.model`), ``setup_model_and_optimizer`` (DDP,
distributed optimizer, ``--load``), ``save_checkpoint`` and its writers. The loop is
`megatron_packing.megatron_lm.loop.train`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from megatron_packing.common import quiet_start
from megatron_packing.config import ConfigError
from megatron_packing.config.training import DataConfig
from megatron_packing.megatron import compat
from megatron_packing.megatron.step_accounting import examples_the_run_trains
from megatron_packing.megatron.train_stream import TrainStream
from megatron_packing.megatron_lm.arguments import (
    add_packing_arguments,
    check_megatron_arguments,
    check_padded_lengths,
    check_saved_schedule,
    check_schedule_fits,
    read_resume_state,
    resize_refusal,
    resolve_packing_config,
    validation_steps,
)
from megatron_packing.megatron_lm.data import (
    SavedLoaderState,
    check_loader_state,
    read_loader_state,
    restore_loader_state,
)
from megatron_packing.megatron_lm.schedule import schedule_in_examples

_PROGRAM_START = time.time()

# A megatron-core outside the supported range ends the process here, naming both (no traceback).
compat.refuse_unsupported_megatron_core()


def read_packing_yaml(path: str) -> tuple[dict[str, Any], set[str], DataConfig]:
    """The YAML's ``packing:`` section (its keys checked by name and mode; the values are judged
    once Megatron's arguments complete them) with the keys it sets, and its ``data:`` section,
    read as every command reads a training YAML (`config.sections`); the trainer's sections have
    no effect here and are warned about."""
    from megatron_packing.config.sections import read_sections

    sections = read_sections(path, command="the Megatron-LM entry point",
                             reads=("packing", "data"))
    return sections.packing_values, set(sections.packing_values), sections.data


def _load_datasets(data: DataConfig, *, vocab_limit: int) -> tuple[Any, Any]:
    """(train, valid or None), loaded by every rank at once with no collective: the first rank
    to take a cache entry's file lock builds it while the others wait on that lock (no timeout;
    see `megatron_packing.data.build_lock`), then read the finished entry."""
    from megatron_packing.config.data_loading import load_data_split
    from megatron_packing.data.tokenize import load_tokenizer

    datasets = (load_data_split(data, data.paths),
                load_data_split(data, data.valid_paths) if data.valid_paths else None)
    vocab = len(load_tokenizer(data.tokenizer))
    if vocab > vocab_limit:
        raise ConfigError(
            f"tokenizer {data.tokenizer} has {vocab} tokens but the model's padded vocabulary "
            f"holds {vocab_limit}; give Megatron the same tokenizer (--tokenizer-type / "
            "--tokenizer-model) or a --vocab-size at least that large")
    return datasets


def main(argv: list[str] | None = None, *, program_start: float | None = None) -> int:
    """Initialise Megatron-LM, build model, optimizer and loaders, train, save; the exit code.

    ``program_start`` is when the job started (``time.time()``), from which Megatron measures
    ``--exit-duration-in-mins``; by default, when this module was imported.
    """
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    import_megatron_training()
    from megatron_packing.megatron_lm.startup import prepare_compile_step

    prepare_compile_step()  # every rank, before any collective: no make where helpers import
    from megatron.core import parallel_state as ps
    from megatron.core.enums import ModelType
    from megatron.training import get_args, print_rank_0
    from megatron.training.training import set_startup_timestamps

    from megatron_packing.loader.dataloader import build_sft_dataloader
    from megatron_packing.megatron.cpu_workarounds import cpu_only, megatron_optimizer_compat
    from megatron_packing.megatron.forward import make_forward_step
    from megatron_packing.megatron_lm import model as gpt
    from megatron_packing.megatron_lm.evaluation import Validation
    from megatron_packing.megatron_lm.loop import Loop

    set_startup_timestamps(program_start=_PROGRAM_START if program_start is None
                           else program_start)
    provider: list[str] = []

    def check(parsed: Any) -> None:
        provider.append(gpt.chosen_provider(parsed.packing_model_provider))
        check_megatron_arguments(parsed, extra=gpt.provider_refusals(parsed, provider[0]))

    compat.parse_and_initialize(add_packing_arguments, allow_no_cuda=cpu_only(), check=check)
    args = get_args()
    dp_size = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    packing_yaml, explicit, data = read_packing_yaml(args.packing_config)
    resume = read_resume_state(args, dp_rank, dp_size)
    try:
        packing = resolve_packing_config(packing_yaml, args, dp_size=dp_size,
                                         explicit_keys=explicit, source=args.packing_config)
    except ConfigError as error:
        if resume is None or resume.saved_dp_size == dp_size:
            raise
        raise resize_refusal(error, resume, dp_size, packing_yaml,
                             args.global_batch_size) from None
    packing.check_token_ids(args.padded_vocab_size, source=args.packing_config)
    train_ds, valid_ds = _load_datasets(data, vocab_limit=args.padded_vocab_size)
    if not packing.use_sequence_packing:
        for dataset, key in ((train_ds, "data.paths"), (valid_ds, "data.valid_paths")):
            if dataset is not None:
                check_padded_lengths(dataset.lengths, args.seq_length,
                                     f"{args.packing_config} ({key})")
    valid_loader, eval_iters = None, 0
    if valid_ds is not None and args.eval_iters:
        valid_loader = build_sft_dataloader(valid_ds, packing, dp_rank=dp_rank, dp_size=dp_size,
                                            seed=packing.seed, eval_mode=True)
        eval_iters = validation_steps(args.eval_iters, len(valid_loader), valid_ds,
                                      packing.global_batch_size,
                                      explicit=_given("--eval-iters", sys.argv[1:]))

    loader = build_sft_dataloader(train_ds, packing, dp_rank=dp_rank, dp_size=dp_size,
                                  seed=packing.seed, total_steps=args.train_iters,
                                  num_workers=args.packing_num_workers)
    total = examples_the_run_trains(args.train_iters, len(loader), len(train_ds),
                                    packing.global_batch_size)
    # What Megatron's scheduler and load_checkpoint would assert on once the model is built.
    check_schedule_fits(args, total)
    check_saved_schedule(args, total)
    stream = TrainStream(loader, budget=_budget_controller(args, packing, loader))
    if resume is not None:  # refused now, before the model is built and the weights read
        check_loader_state(stream, resume)
    checkpointing_context: dict[str, Any] = {}
    # CPU only: the optimizer's CUDA type names (bf16 too); the schedule in examples.
    with megatron_optimizer_compat(), schedule_in_examples(args, total) as resized:
        model, optimizer, scheduler = compat.setup_model_and_optimizer(
            gpt.model_provider_for(provider[0]), ModelType.encoder_or_decoder,
            checkpointing_context)
    print_rank_0(f"> GPT model from {_PROVIDER_TEXT[provider[0]]}; megatron-core "
                 f"{compat.version_text(compat.megatron_core_version())}")
    print_rank_0(f"> the run trains {total} examples over {args.train_iters} iterations"
                 + (f" ({len(loader)} steps per epoch); the LR schedule is sized to them"
                    if resized else ""))
    quiet_start.report("> ")
    if not args.skip_train:  # Megatron wraps the model in DDP only to train
        _wire_grad_sync(model, optimizer, args)

    if args.iteration > 0:
        if resume is None or resume.iteration != args.iteration:  # Megatron chose another
            resume = read_loader_state(args.load, args.iteration, dp_rank, dp_size)
            check_loader_state(stream, resume)
        restore_loader_state(stream, resume)
        print_rank_0(f"> restored the packing loader state of iteration {args.iteration} "
                     f"from {resume.path}" + _resize_note(resume, dp_size))
        if stream.counter.examples != args.consumed_train_samples:
            raise RuntimeError(
                f"checkpoint iteration {args.iteration}: Megatron counts "
                f"{args.consumed_train_samples} consumed samples but the loader state "
                f"{stream.counter.examples} examples; the checkpoint was not written by this "
                "entry point's loop")

    forward_step = make_forward_step(cp_size=ps.get_context_parallel_world_size(),
                                     cp_rank=ps.get_context_parallel_rank(),
                                     check_nan=args.check_for_nan_in_loss_and_grad,
                                     check_spiky=args.check_for_spiky_loss)
    # Sequence parallelism splits each padded block's width over the TP ranks.
    width_multiple = args.tensor_model_parallel_size if args.sequence_parallel else 1
    validation = None if valid_loader is None else Validation(
        valid_loader, eval_iters, model, forward_step, dp_size, packing.pad_token_id,
        width_multiple)
    loop = Loop(model, optimizer, scheduler, stream, forward_step, dp_size, packing.pad_token_id,
                validation, checkpointing_context, width_multiple)
    return _run(args, loop)


def _resize_note(resume: SavedLoaderState, dp_size: int) -> str:
    """What a resume at another data-parallel size does, for the start-up log."""
    if resume.saved_dp_size == dp_size:
        return ""
    return (f" (saved at data-parallel size {resume.saved_dp_size}, now {dp_size}: the next "
            "steps are planned at the new size from the saved position, carry and drift; "
            "ranks new to the run read DP rank 0's global part)")


_PROVIDER_TEXT = {"megatron-lm": "Megatron-LM's model_provider + gpt_builders (checkout)",
                  "project": "megatron_packing's provider (megatron-core layer specs)"}


def import_megatron_training() -> None:
    """Import ``megatron.training``, or fail naming what to install or put on ``PYTHONPATH``."""
    import importlib

    try:
        importlib.import_module("megatron.training.training")
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith("megatron.training"):
            raise
        raise ConfigError(compat.missing_training_message(compat.megatron_core_version())
                          ) from error


# Seconds the ranks other than 0 wait before exiting on a start-up refusal (see `run`).
REFUSAL_GRACE_S = 5.0


def run(argv: list[str] | None = None, *, program_start: float | None = None) -> int:
    """`main`, with a user's mistake reported as one line and exit code 2, no traceback.

    Every rank meets the same start-up refusal, so only global rank 0 prints it; the others
    wait `REFUSAL_GRACE_S` before they exit, since torchrun ends every rank once one exits and a
    rank 0 running late (a loaded node) would otherwise be ended before it prints. Dataset
    helpers that neither import nor build are found by each rank alone (no collective), so each
    rank prints that line itself. Anything else keeps its traceback: it is a fault or a bug, not
    a setting to change.
    """
    import os

    from megatron_packing.common.process_lifetime import end_with_torchrun_agent
    from megatron_packing.common.user_warnings import one_line_warnings
    from megatron_packing.data import BadRecordError, CorruptStoreError
    from megatron_packing.megatron.dataset_helpers import DatasetHelpersUnavailable
    from megatron_packing.megatron_lm.arguments import MegatronArgumentError
    from megatron_packing.megatron_lm.data import LoaderStateMissing

    one_line_warnings("megatron_packing.megatron_lm")
    end_with_torchrun_agent()  # a killed torchrun takes this rank and all it started with it
    try:
        return main(argv, program_start=program_start)
    except DatasetHelpersUnavailable as error:  # found by each rank alone: each one says it
        rank = os.environ.get("RANK", "0")
        print(f"megatron_packing.megatron_lm [rank {rank}]: error: {error}", file=sys.stderr,
              flush=True)
        return 2
    except (ConfigError, MegatronArgumentError, LoaderStateMissing, BadRecordError,
            CorruptStoreError) as error:
        if os.environ.get("RANK", "0") == "0":
            print(f"megatron_packing.megatron_lm: error: {error}", file=sys.stderr, flush=True)
        else:
            time.sleep(REFUSAL_GRACE_S)
        return 2


def _budget_controller(args: Any, packing: Any, loader: Any) -> Any:
    """Padded mode with a token budget: the controller that takes budget changes from the
    control file at step boundaries, on every rank at the same step."""
    import os

    from megatron.training import print_rank_0

    from megatron_packing.padded.sync import BUDGET_FILE, TokenBudgetController

    budget = None if packing.use_sequence_packing else packing.padded.max_tokens_per_microbatch
    if budget is None:
        if args.packing_budget_file is not None:
            raise ConfigError(
                f"--packing-budget-file {args.packing_budget_file}: only padded mode with "
                "packing.max_tokens_per_microbatch has a token budget to change; remove the "
                "argument, or set use_sequence_packing: false and max_tokens_per_microbatch")
        return None
    if args.packing_budget_check_interval < 1:
        raise ConfigError(f"--packing-budget-check-interval {args.packing_budget_check_interval}:"
                          " give a number of steps >= 1")
    control = args.packing_budget_file or (os.path.join(args.save, BUDGET_FILE) if args.save
                                           else None)
    print_rank_0(f"> token budget {budget} per micro-batch"
                 + (f"; changes are read from {control}" if control else
                    " (no --save and no --packing-budget-file: it cannot change while the job "
                    "runs)"))
    return TokenBudgetController(budget, control_file=control,
                                 check_every=args.packing_budget_check_interval,
                                 target=loader.batch_sampler,
                                 report=lambda message: print_rank_0(f"> {message}"))


def _given(flag: str, argv: list[str]) -> bool:
    """Whether ``flag`` is on the command line (rather than Megatron's default)."""
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def _run(args: Any, loop: Any) -> int:
    """Train (unless ``--skip-train``), then as Megatron-LM's ``pretrain()``: the final save,
    the final validation and the async-save finalisation; the exit code."""
    from megatron.training import get_wandb_writer, print_rank_0
    from megatron.training.async_utils import maybe_finalize_async_save

    from megatron_packing.megatron_lm.loop import TrainResult, train

    start = args.iteration
    if args.skip_train:
        print_rank_0("skipping training (--skip-train is on) ...")
        result = TrainResult(start, float(args.num_floating_point_operations_so_far))
    else:
        result = train(args, loop)
    last = result.iteration
    if not result.should_exit:
        if args.save and last > start and (not args.save_interval or last % args.save_interval):
            loop.save(last, result.flops_so_far, timed=False)
        print_rank_0(f"> training done at iteration {last}: {args.consumed_train_samples} "
                     "examples")
        if loop.validation is not None:
            loop.validation.run(f"iteration {last} on validation set", last,
                                write=not args.skip_train)
    maybe_finalize_async_save(blocking=True, terminate=True)
    wandb_writer = get_wandb_writer()
    if wandb_writer is not None:
        wandb_writer.finish()
    return result.exit_code


def _wire_grad_sync(model: list[Any], optimizer: Any, args: Any) -> None:
    """What Megatron-LM's ``train()`` sets on the model config before its first step."""
    from megatron.core.utils import get_model_config

    from megatron_packing.megatron.ddp import wire_megatron_grad_sync

    wire_megatron_grad_sync(model, align_grad_reduce=args.align_grad_reduce,
                            align_param_gather=args.align_param_gather)
    get_model_config(model[0]).grad_scale_func = optimizer.scale_loss
