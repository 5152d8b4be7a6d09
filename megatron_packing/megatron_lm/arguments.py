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
from typing import Any

from megatron_packing.config import ConfigError, PackingConfig

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
    return parser


class MegatronArgumentError(ValueError):
    """A Megatron-LM argument the packing loop cannot honour; the message says what to use."""


def check_megatron_arguments(args: Any) -> None:
    """Refuse Megatron-LM settings that contradict a per-step micro-batch count."""
    problems = []
    if getattr(args, "rampup_batch_size", None):
        problems.append(
            "--rampup-batch-size: the packing loop already varies the batch per step and "
            "cannot ramp it; remove the argument (warm up with --lr-warmup-iters instead)")
    if args.micro_batch_size != 1:
        problems.append(
            f"--micro-batch-size {args.micro_batch_size}: one micro-batch is one packed row; "
            "use --micro-batch-size 1 and size rows with --seq-length / bin_capacity")
    if not args.train_iters:
        problems.append(
            "--train-samples: the packing loop schedules by iterations (the final one repays "
            "the batch-size drift); use --train-iters")
    if not getattr(args, "calculate_per_token_loss", False):
        problems.append(
            "--calculate-per-token-loss is required: the loss is a token sum divided once by "
            "the step's global loss-token count, which is what makes packing exact")
    if getattr(args, "use_legacy_models", False):
        problems.append("--use-legacy-models: the packing loop drives megatron-core models only")
    if getattr(args, "num_experts", None) and getattr(args, "moe_router_load_balancing_type",
                                                        "none") != "none":
        problems.append("MoE auxiliary losses are normalised per micro-batch; not supported yet "
                        "(use --moe-router-load-balancing-type none)")
    if getattr(args, "virtual_pipeline_model_parallel_size", None):
        problems.append(
            "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank: "
            "the interleaved schedule needs the micro-batch count to divide by the pipeline "
            "size, which a per-step count does not guarantee; use the plain 1F1B pipeline "
            "(drop the virtual pipeline arguments)")
    if problems:
        raise MegatronArgumentError(
            "Megatron-LM arguments the packing loop cannot honour:\n  - " + "\n  - ".join(problems))


def resolve_packing_config(packing: PackingConfig | Mapping[str, Any], args: Any, *, dp_size: int,
                           explicit_keys: set[str], source: str) -> PackingConfig:
    """The YAML's packing section completed from (and checked against) Megatron's arguments.

    ``packing`` is the section's mapping of keys (or a `PackingConfig`); it is validated only once
    completed, so a key that needs a Megatron value (an FP8 recipe needs FP8 on) is judged with
    it. Megatron's arguments own B, the row size and the parallel sizes; a YAML key that says
    otherwise is an error rather than a silent override.
    """
    values = dict(packing.to_dict() if isinstance(packing, PackingConfig) else packing)
    megatron_values: dict[str, Any] = {
        "global_batch_size": args.global_batch_size,
        "tp_size": args.tensor_model_parallel_size,
        "cp_size": args.context_parallel_size,
        "fp8_enabled": bool(getattr(args, "fp8", None)),
    }
    fp8_recipe = getattr(args, "fp8_recipe", None) if megatron_values["fp8_enabled"] else None
    if fp8_recipe is not None:
        if fp8_recipe not in FP8_RECIPE_FROM_MEGATRON:
            raise ConfigError(f"--fp8-recipe {fp8_recipe!r} has no packing alignment rule; "
                              f"known: {', '.join(FP8_RECIPE_FROM_MEGATRON)}")
        megatron_values["fp8_recipe"] = FP8_RECIPE_FROM_MEGATRON[fp8_recipe]
    flags = {"global_batch_size": "--global-batch-size", "tp_size": "--tensor-model-parallel-size",
             "cp_size": "--context-parallel-size", "fp8_enabled": "--fp8-format",
             "fp8_recipe": "--fp8-recipe"}
    for key, value in megatron_values.items():
        if key in explicit_keys and values.get(key) != value:
            raise ConfigError(
                f"{source}: packing.{key} is {values.get(key)!r} but Megatron's "
                f"{flags[key]} gives {value!r}; remove the key from the YAML (Megatron's "
                "argument decides) or make them agree")
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
    if not resolved.use_sequence_packing:
        raise ConfigError(
            f"{source}: use_sequence_packing: false (padded mode) is not served by the "
            "Megatron-LM entry point, which trains packed THD rows; set it to true")
    return resolved.validate(dp_size)
