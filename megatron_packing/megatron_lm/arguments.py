"""Command-line arguments the entry point adds to Megatron-LM's, and the refusals at start-up.

Megatron-LM's own arguments keep their meaning where the packing loop can honour it:
``--global-batch-size`` is B, the mean number of real examples per optimizer step (each step
trains B +- v examples and the run as a whole exactly ``--train-iters x B``); ``--seq-length``
is the longest packed row; ``--train-iters`` is the run's horizon, by whose final step the
batch-size drift is repaid. Settings the loop cannot honour are refused here, before any model
is built, with the argument named and what to use instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megatron_packing.config import ConfigError, PackingConfig
from megatron_packing.megatron.packing_settings import (
    HostSettings,
    check_examples_fit,
    resolve_packing_settings,
)
from megatron_packing.megatron_lm.argument_policy import shown
from megatron_packing.padded.control_file import BUDGET_FILE

if TYPE_CHECKING:
    from megatron_packing.megatron_lm.data import SavedLoaderState



def add_packing_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: the arguments of the packing loop."""
    group = parser.add_argument_group("megatron_packing")
    group.add_argument("--packing-config", required=True, metavar="YAML",
                       help="training YAML with a `packing:` section and a `data:` section "
                            "(paths, tokenizer, loss_on, on_bad_record, cache_dir, valid_paths)")
    group.add_argument("--packing-num-workers", type=int, default=0,
                       help="DataLoader worker processes per rank (0: fetch in the main process)")
    group.add_argument("--packing-log-dir", default=None,
                       help="write one JSONL of per-step records per rank here (examples, counts, loss, LR)")
    group.add_argument("--packing-budget-file", default=None, metavar="PATH",
                       help="padded mode with max_tokens_per_microbatch: the control file that "
                            "changes the token budget while the job runs (default: "
                            f"{BUDGET_FILE} under --save; write it with `megatron-packing budget "
                            "--run-dir DIR N`)")
    group.add_argument("--packing-budget-check-interval", type=int, default=1, metavar="STEPS",
                       help="read the budget control file every this many steps (each check is "
                            "two small all-reduces)")
    group.add_argument("--packing-model-provider", default="auto",
                       choices=("auto", "megatron-lm", "project"),
                       help="the GPT model builder: `megatron-lm` (a Megatron-LM checkout's "
                            "model_provider + gpt_builders on PYTHONPATH), `project` "
                            "(megatron_packing's, from megatron-core's layer specs; no checkout "
                            "needed with megatron-core 0.19) or `auto` (the checkout's when "
                            "importable, else the project's)")
    group.add_argument("--packing-verbose", action="store_true",
                       help="show every third-party start-up warning (by default the known "
                            "harmless ones collapse into one line; a set PYTHONWARNINGS also "
                            "shows them)")
    return parser


class MegatronArgumentError(ValueError):
    """A Megatron-LM argument the packing loop cannot honour; the message says what to use."""


def check_megatron_arguments(args: Any, *, extra: list[str] | None = None) -> None:
    """Refuse, before anything is built, every Megatron-LM setting the packing loop cannot honour.

    ``args`` is what Megatron's parser returns (before its own validation fills derived values,
    so virtual pipeline stages are read from the arguments that ask for them). The rules are
    `megatron_packing.megatron_lm.argument_policy.POLICY`; ``extra`` adds the model provider's
    refusals (`megatron_packing.megatron_lm.model.provider_refusals`).
    """
    from megatron_packing.megatron_lm.argument_policy import refusals

    problems = refusals(args) + list(extra or [])
    if getattr(args, "num_experts", None) and not moe_router_runs():
        problems.append(
            "--num-experts: this megatron-core's MoE router calls Transformer Engine's GEMM "
            "whenever it is installed and fails with a NameError when it is not "
            "(megatron.core.transformer.moe.moe_utils.te_general_gemm is undefined); install "
            "Transformer Engine (on GPUs: pip install transformer_engine[pytorch]) to train MoE")
    if getattr(args, "sequence_parallel", False) and args.tensor_model_parallel_size > 1 and \
            getattr(args, "transformer_impl", None) == "local" and not local_norm_is_apex():
        problems.append(
            f"--sequence-parallel with --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size} and --transformer-impl local: without Apex, "
            "megatron-core's local layers use torch's LayerNorm, which does not support sequence "
            "parallelism (it asserts once the model is being built); install Apex, or use "
            "--transformer-impl transformer_engine, or drop --sequence-parallel")
    if getattr(args, "use_distributed_optimizer", False) and \
            (getattr(args, "save", None) or getattr(args, "load", None)) and \
            not optimizer_has_fused_adam():
        problems.append(
            "--use-distributed-optimizer with --save / --load: without Apex or Transformer "
            "Engine, megatron-core falls back to torch's Adam, and it cannot load that "
            "distributed optimizer state back (torch_dist asserts on the missing 'step', the "
            "torch format fails copying into the parameters); install Transformer Engine, or "
            "train without --use-distributed-optimizer")
    if problems:
        raise MegatronArgumentError(
            "Megatron-LM arguments the packing loop cannot honour:\n  - " + "\n  - ".join(problems))


def optimizer_has_fused_adam() -> bool:
    """Whether megatron-core's optimizers use Apex or Transformer Engine (not torch's Adam)."""
    from megatron.core.optimizer import distrib_optimizer

    return bool(getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True))


def local_norm_is_apex() -> bool:
    """Whether megatron-core's local layer specs normalise with Apex (else torch's LayerNorm,
    which asserts under sequence parallelism)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(getattr(gpt_layer_specs, "HAVE_APEX", True))


def moe_router_runs() -> bool:
    """Whether megatron-core's MoE router can run here (its GEMM name is bound)."""
    from megatron.core.transformer.moe import moe_utils

    return hasattr(moe_utils, "te_general_gemm")


def validation_steps(eval_iters: int, available: int, valid_ds: Any, batch_size: int, *,
                     explicit: bool) -> int:
    """How many validation steps each evaluation runs.

    ``--eval-iters`` may not ask for more steps than the validation set gives (they would
    quietly be fewer); Megatron's default (100), when not given, means the whole set, and says
    so once.
    """
    if eval_iters <= available:
        return eval_iters
    if explicit:
        raise MegatronArgumentError(
            f"--eval-iters {eval_iters}: the validation set ({len(valid_ds)} examples) gives "
            f"{available} validation steps of --global-batch-size {batch_size}; use "
            f"--eval-iters {available} or less, or add validation examples")
    from megatron.training import print_rank_0

    print_rank_0(f"> validation: --eval-iters not given (Megatron's default is {eval_iters}); "
                 f"each evaluation runs the whole validation set: {available} steps")
    return available


def read_resume_state(args: Any, dp_rank: int, dp_size: int) -> SavedLoaderState | None:
    """On ``--load`` (without ``--finetune``): the loader state this rank resumes from, read
    before anything is built; None when there is nothing to resume.

    Refuses, naming the saved and the new value, a checkpoint without loader states and another
    ``--global-batch-size``: the saved loader state records the B its plan was made for, and
    Megatron's own check fires later, inside ``load_checkpoint``, with a message about warmup
    iterations that never names B. A data-parallel size other than the saved one is taken
    (`read_loader_state` picks the state with the global part).
    """
    from megatron_packing.megatron_lm.data import checkpoint_to_load, read_loader_state

    if not args.load or args.finetune:
        return None
    found = checkpoint_to_load(args)
    if found is None:
        return None
    iteration, _ = found
    saved = read_loader_state(args.load, iteration, dp_rank, dp_size)
    batch_size = _saved_fingerprint(saved.state).get("batch_size") or \
        _saved_fingerprint(saved.state).get("global_batch_size")
    if batch_size is not None and batch_size != args.global_batch_size:
        raise MegatronArgumentError(
            f"--global-batch-size {args.global_batch_size}: the checkpoint at iteration "
            f"{iteration} under {args.load} was trained with --global-batch-size {batch_size}. "
            "The packing plan and the LR schedule (sized as iters x --global-batch-size "
            f"examples) depend on it: resume with --global-batch-size {batch_size}. "
            "--override-opt_param-scheduler would take the new LR schedule, but the data "
            "stream's plan would still be the saved one, so it is refused too; to train on with "
            "another batch size, start a new run from these weights with --finetune")
    return saved


def check_schedule_fits(args: Any, total_examples: int) -> None:
    """Refuse a warm-up that does not end before the LR decay once the schedule is sized in
    the examples the run trains (`megatron_packing.megatron_lm.schedule`).

    A run over several epochs trains fewer than ``--train-iters x B`` examples, so a warm-up
    shorter than ``--train-iters`` (which `COMBINATIONS` checks at start-up) can still reach the
    decay's end; Megatron's scheduler would assert once the model is built. Known when the
    data's steps per epoch are, before the model is built.
    """
    from megatron_packing.megatron_lm.schedule import sized_in_examples

    if args.skip_train or args.lr_warmup_fraction is not None or \
            not sized_in_examples(args, total_examples):
        return
    batch = args.global_batch_size
    warmup = args.lr_warmup_iters * batch
    if warmup < total_examples:
        return
    raise MegatronArgumentError(
        f"--lr-warmup-iters {args.lr_warmup_iters}: this run trains {total_examples} examples "
        f"over --train-iters {args.train_iters} (fewer than {args.train_iters} x "
        f"--global-batch-size {batch}: each epoch of the data ends in a short step), and the LR "
        f"schedule is sized to them; Megatron's scheduler needs the warm-up ({args.lr_warmup_iters}"
        f" x {batch} = {warmup} examples) to end before the decay does: give --lr-warmup-iters "
        f"{(total_examples - 1) // batch} or less, or --lr-warmup-fraction")


# Where Megatron's load_state_dict reads each value, older names first.
_SAVED_NAMES = {"max_lr": ("start_lr", "max_lr"),
                "lr_warmup_steps": ("warmup_iter", "warmup_steps", "lr_warmup_steps"),
                "lr_decay_steps": ("end_iter", "decay_steps", "lr_decay_steps"),
                "lr_decay_style": ("decay_style", "lr_decay_style")}
# Model arguments Megatron's check_checkpoint_args compares whatever the checkpoint format.
_MODEL_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
                "num_attention_heads": "--num-attention-heads"}
_TORCH_FORMAT_FLAGS = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
                       "pipeline_model_parallel_size": "--pipeline-model-parallel-size"}


def scheduler_state(args: Any, total_examples: int) -> dict[str, Any]:
    """The values Megatron's scheduler is built with for this run (what its ``state_dict``
    saves, but the step), sized as `schedule_in_examples` has Megatron size them."""
    from megatron_packing.megatron_lm.argument_policy import decay_iterations
    from megatron_packing.megatron_lm.schedule import sized_in_examples

    batch = args.global_batch_size
    if sized_in_examples(args, total_examples):
        decay, wd_steps = total_examples, total_examples
    else:
        decay, wd_steps = int(decay_iterations(args)[1] or 0) * batch, args.train_iters * batch
    warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else \
        args.lr_warmup_iters * batch
    constant = args.weight_decay_incr_style == "constant"
    return {"max_lr": float(args.lr), "min_lr": args.min_lr, "lr_warmup_steps": warmup,
            "lr_decay_steps": decay, "lr_decay_style": args.lr_decay_style,
            "start_wd": args.weight_decay if constant else args.start_weight_decay,
            "end_wd": args.weight_decay if constant else args.end_weight_decay,
            "wd_incr_steps": wd_steps, "wd_incr_style": args.weight_decay_incr_style}


def saved_common_state(args: Any) -> tuple[int, dict[str, Any]] | None:
    """(iteration, the checkpoint's non-sharded state: ``args``, ``opt_param_scheduler``, ...)
    of the checkpoint ``--load`` will take, read without the weights; None when there is none."""
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import find_checkpoint_rank_0, get_checkpoint_name

    from megatron_packing.megatron_lm.data import checkpoint_to_load

    found = checkpoint_to_load(args)
    if found is None:
        return None
    iteration, directory = found
    base = get_checkpoint_name(directory, iteration, return_base_dir=True)
    if dist_checkpointing.check_is_distributed_checkpoint(base):
        state = dist_checkpointing.load_common_state_dict(str(base))
    else:
        path = find_checkpoint_rank_0(directory, iteration)
        if path is None:
            return None
        import torch

        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    return iteration, state


def check_saved_schedule(args: Any, total_examples: int) -> None:
    """On ``--load``: refuse, before the model is built, what Megatron's ``load_checkpoint``
    asserts on after building it: another model shape than the checkpoint's, and (unless
    ``--finetune``, ``--no-load-optim``, ``--override-opt_param-scheduler`` or
    ``--use-checkpoint-opt_param-scheduler``) another LR or weight-decay schedule, such as a
    longer ``--train-iters`` to train on."""
    if not args.load:
        return
    saved = saved_common_state(args)
    if saved is None:
        return
    iteration, state = saved
    where = f"--load {args.load}: the checkpoint at iteration {iteration}"
    saved_args = state.get("args")
    if saved_args is not None and not args.finetune:
        flags = dict(_MODEL_FLAGS)
        if not getattr(args, "use_dist_ckpt", True):
            flags.update(_TORCH_FORMAT_FLAGS)
        differ = [f"{flag} {getattr(saved_args, dest)} (this run: {getattr(args, dest)})"
                  for dest, flag in flags.items()
                  if hasattr(saved_args, dest) and getattr(saved_args, dest) != getattr(args, dest)]
        if differ:
            raise MegatronArgumentError(
                f"{where} holds a model with {', '.join(differ)}; Megatron's load_checkpoint "
                "asserts they match: give the checkpoint's model arguments")
    schedule = state.get("lr_scheduler", state.get("opt_param_scheduler"))
    if not isinstance(schedule, dict) or args.skip_train or args.finetune or \
            args.no_load_optim or args.override_opt_param_scheduler or \
            args.use_checkpoint_opt_param_scheduler:
        return
    now = scheduler_state(args, total_examples)
    differ = []
    for name, given in _schedule_arguments(args, total_examples).items():
        if name in _WEIGHT_DECAY and "start_wd" not in schedule:
            continue  # Megatron compares the weight decay only where the checkpoint has it
        saved_value = next((schedule[key] for key in _SAVED_NAMES.get(name, (name,))
                            if key in schedule), now[name])
        if saved_value != now[name]:
            differ.append(f"{name} {shown(saved_value)} saved, {shown(now[name])} now ({given})")
    if differ:
        raise MegatronArgumentError(
            f"{where} was trained with another LR schedule: {'; '.join(differ)}. Megatron's "
            "load_checkpoint asserts they match: resume with the saved arguments, or add "
            "--override-opt_param-scheduler (this run's schedule, from the saved step on) or "
            "--use-checkpoint-opt_param-scheduler (the saved schedule)")


_WEIGHT_DECAY = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")


def _schedule_arguments(args: Any, total_examples: int) -> dict[str, str]:
    """For each value of `scheduler_state`, the arguments (with this run's values) that set it."""
    from megatron_packing.megatron_lm.argument_policy import decay_iterations
    from megatron_packing.megatron_lm.schedule import sized_in_examples

    batch = f"--global-batch-size {args.global_batch_size}"
    flag, iterations = decay_iterations(args)
    resized = sized_in_examples(args, total_examples)
    examples = f"the {total_examples} examples this run trains over --train-iters {args.train_iters}"
    warmup = f"--lr-warmup-fraction {shown(args.lr_warmup_fraction)} of the decay" \
        if args.lr_warmup_fraction is not None else f"--lr-warmup-iters {args.lr_warmup_iters} x {batch}"
    constant = args.weight_decay_incr_style == "constant"
    return {
        "max_lr": f"--lr {shown(args.lr)}", "min_lr": f"--min-lr {shown(args.min_lr)}",
        "lr_warmup_steps": warmup,
        "lr_decay_steps": examples if resized else f"{flag} {iterations} x {batch}",
        "lr_decay_style": f"--lr-decay-style {args.lr_decay_style}",
        "start_wd": f"--weight-decay {shown(args.weight_decay)}" if constant else
        f"--start-weight-decay {shown(args.start_weight_decay)}",
        "end_wd": f"--weight-decay {shown(args.weight_decay)}" if constant else
        f"--end-weight-decay {shown(args.end_weight_decay)}",
        "wd_incr_steps": examples if resized else f"--train-iters {args.train_iters} x {batch}",
        "wd_incr_style": f"--weight-decay-incr-style {args.weight_decay_incr_style}",
    }


def resize_refusal(error: ConfigError, saved: SavedLoaderState, dp_size: int,
                   packing_yaml: Mapping[str, Any], batch_size: int) -> ConfigError:
    """A packing setting refused at this run's data-parallel size, said as a resume from the
    saved size: both sizes, and the largest size the batch window allows."""
    from megatron_packing.common.validation import allowed_batch_variation

    variation = packing_yaml.get("packing_batch_size_allowed_variation",
                                 PackingConfig().packing_batch_size_allowed_variation)
    largest = ""
    if isinstance(variation, (int, float)) and 0 < variation < 1:
        largest = (f"; with these settings resume at a data-parallel size of at most "
                   f"{batch_size - allowed_batch_variation(batch_size, variation)}")
    return ConfigError(f"--load: the checkpoint at iteration {saved.iteration} was saved at "
                       f"data-parallel size {saved.saved_dp_size} and this run has {dp_size}: "
                       f"{error}{largest}")


def _saved_fingerprint(state: Any) -> dict[str, Any]:
    """The sampler's fingerprint inside a saved loader state (wherever torchdata nests it)."""
    if isinstance(state, dict):
        if isinstance(state.get("fingerprint"), dict):
            return state["fingerprint"]
        for value in state.values():
            found = _saved_fingerprint(value)
            if found:
                return found
    return {}


MEGATRON_LM_NAMES = {"global_batch_size": "--global-batch-size", "seq_length": "--seq-length",
                     "max_position_embeddings": "--max-position-embeddings",
                     "tp_size": "--tensor-model-parallel-size",
                     "cp_size": "--context-parallel-size",
                     "pp_size": "--pipeline-model-parallel-size", "fp8_enabled": "--fp8-format",
                     "fp8_recipe": "--fp8-recipe"}


def host_settings(args: Any) -> HostSettings:
    """What Megatron-LM's arguments decide of the packing section, named by their flags."""
    return HostSettings(
        global_batch_size=args.global_batch_size, seq_length=args.seq_length,
        max_position_embeddings=args.max_position_embeddings,
        tp_size=args.tensor_model_parallel_size, cp_size=args.context_parallel_size,
        pp_size=args.pipeline_model_parallel_size, fp8_enabled=bool(getattr(args, "fp8", None)),
        fp8_recipe=getattr(args, "fp8_recipe", None), names=MEGATRON_LM_NAMES)


def resolve_packing_config(packing: PackingConfig | Mapping[str, Any], args: Any, *, dp_size: int,
                           explicit_keys: set[str], source: str) -> PackingConfig:
    """The YAML's packing section completed from (and checked against) Megatron's arguments:
    they own B, the row size and the parallel sizes (`resolve_packing_settings`)."""
    return resolve_packing_settings(packing, host_settings(args), dp_size=dp_size,
                                    explicit_keys=explicit_keys, source=source)


def check_padded_lengths(lengths: Any, seq_length: int, source: str) -> None:
    """In padded mode every example goes in whole, so it must fit ``--seq-length``."""
    check_examples_fit(lengths, HostSettings(global_batch_size=0, seq_length=seq_length,
                                             max_position_embeddings=seq_length,
                                             names=MEGATRON_LM_NAMES), source)
