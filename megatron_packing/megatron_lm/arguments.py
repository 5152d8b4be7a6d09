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
from megatron_packing.padded.control_file import BUDGET_FILE

if TYPE_CHECKING:
    from megatron_packing.megatron_lm.data import SavedLoaderState

FP8_RECIPE_FROM_MEGATRON = {"delayed": "delayed", "tensorwise": "tensorwise",
                            "mxfp8": "mxfp8", "blockwise": "blockwise"}


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


def resolve_packing_config(packing: PackingConfig | Mapping[str, Any], args: Any, *, dp_size: int,
                           explicit_keys: set[str], source: str) -> PackingConfig:
    """The YAML's packing section completed from (and checked against) Megatron's arguments.

    ``packing`` is the section's mapping of keys (or a `PackingConfig`); it is validated only once
    completed, so a key that needs a Megatron value (an FP8 recipe needs FP8 on) is judged with
    it. Megatron's arguments own B, the row size and the parallel sizes; a YAML key that says
    otherwise is an error rather than a silent override.
    """
    values = dict(packing.to_dict() if isinstance(packing, PackingConfig) else packing)
    megatron_values: dict[str, Any] = {"global_batch_size": args.global_batch_size}
    if values.get("use_sequence_packing") is False:  # padded: no rows to size or align
        check_padded_parallelism(args, source)
        _check_agreement(values, megatron_values, explicit_keys, source)
        return PackingConfig.from_dict({**values, **megatron_values}, source=source
                                       ).validate(dp_size)
    megatron_values.update({
        "tp_size": args.tensor_model_parallel_size,
        "cp_size": args.context_parallel_size,
        "fp8_enabled": bool(getattr(args, "fp8", None)),
    })
    fp8_recipe = getattr(args, "fp8_recipe", None) if megatron_values["fp8_enabled"] else None
    if fp8_recipe is not None:
        if fp8_recipe not in FP8_RECIPE_FROM_MEGATRON:
            raise ConfigError(f"--fp8-recipe {fp8_recipe!r} has no packing alignment rule; "
                              f"known: {', '.join(FP8_RECIPE_FROM_MEGATRON)}")
        megatron_values["fp8_recipe"] = FP8_RECIPE_FROM_MEGATRON[fp8_recipe]
    _check_agreement(values, megatron_values, explicit_keys, source)
    capacity = values["bin_capacity"] if "bin_capacity" in explicit_keys else args.seq_length
    resolved = PackingConfig.from_dict({**values, **megatron_values, "bin_capacity": capacity},
                                       source=source)
    if resolved.bin_capacity > args.seq_length:
        raise ConfigError(
            f"{source}: packing.bin_capacity {capacity} exceeds --seq-length {args.seq_length}; "
            "a packed row must fit the model's sequence length (raise --seq-length or lower "
            "bin_capacity)")
    if resolved.bin_capacity > args.max_position_embeddings:
        raise ConfigError(
            f"{source}: packing.bin_capacity {capacity} exceeds --max-position-embeddings "
            f"{args.max_position_embeddings}")
    return resolved.validate(dp_size)


_FLAGS = {"global_batch_size": "--global-batch-size", "tp_size": "--tensor-model-parallel-size",
          "cp_size": "--context-parallel-size", "fp8_enabled": "--fp8-format",
          "fp8_recipe": "--fp8-recipe"}


def _check_agreement(values: dict[str, Any], megatron_values: dict[str, Any],
                     explicit_keys: set[str], source: str) -> None:
    """A YAML key that Megatron's argument decides must agree with it."""
    for key, value in megatron_values.items():
        if key in explicit_keys and values.get(key) != value:
            raise ConfigError(
                f"{source}: packing.{key} is {values.get(key)!r} but Megatron's "
                f"{_FLAGS[key]} gives {value!r}; remove the key from the YAML (Megatron's "
                "argument decides) or make them agree")


def check_padded_parallelism(args: Any, source: str) -> None:
    """Padded mode's ``[b, L]`` blocks change shape every micro-batch and are not split by
    sequence: pipeline stages (one activation shape per step) and context parallelism (each
    sequence split over ranks) need packed rows."""
    if args.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"{source}: use_sequence_packing: false (padded mode) with "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}: pipeline "
            "stages exchange activations of one shape per step, and padded micro-batches vary in "
            "both b and L; use packed mode (use_sequence_packing: true) or "
            "--pipeline-model-parallel-size 1")
    if args.context_parallel_size > 1:
        raise ConfigError(
            f"{source}: use_sequence_packing: false (padded mode) with --context-parallel-size "
            f"{args.context_parallel_size}: context parallelism splits packed THD rows by "
            "sequence; use packed mode (use_sequence_packing: true) or --context-parallel-size 1")


def check_padded_lengths(lengths: Any, seq_length: int, source: str) -> None:
    """In padded mode every example goes in whole (one longer than the token budget trains in a
    micro-batch of its own), so it must fit ``--seq-length``, the model's positions."""
    import numpy as np

    lengths = np.asarray(lengths)
    longest = int(lengths.max()) if lengths.size else 0
    if longest > seq_length:
        count = int((lengths > seq_length).sum())
        raise ConfigError(
            f"{source}: padded mode trains each example whole, but {count} example(s) are longer "
            f"than --seq-length {seq_length} (the longest has {longest} tokens); raise "
            f"--seq-length (and --max-position-embeddings) to at least {longest}, or use packed "
            "mode (use_sequence_packing: true) with oversize_policy: truncate")

