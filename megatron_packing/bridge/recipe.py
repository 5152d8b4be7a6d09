"""What the Bridge host reads from, and refuses in, a user's Bridge ``ConfigContainer``.

Every refusal names the recipe field and what to set instead, before Bridge builds anything:
a Bridge release outside the tested range, Bridge's own packing switched on beside the
plugin's, a dataset config the host would otherwise ignore, virtual pipeline stages (Bridge
saves no loader state with them), micro-batches of more than one packed row, a loss that is
not summed per token, and dropout whose generator state Bridge would checkpoint for DP rank 0
only.
"""

from __future__ import annotations

from typing import Any

from megatron_packing.config import ConfigError
from megatron_packing.megatron.packing_settings import HostSettings

TESTED_BRIDGE = ((0, 6), (0, 7))  # releases >= 0.6 and < 0.7

BRIDGE_NAMES = {"global_batch_size": "train.global_batch_size",
                "seq_length": "model.seq_length",
                "max_position_embeddings": "model.max_position_embeddings",
                "tp_size": "model.tensor_model_parallel_size",
                "cp_size": "model.context_parallel_size",
                "pp_size": "model.pipeline_model_parallel_size",
                "fp8_enabled": "model.fp8", "fp8_recipe": "model.fp8_recipe"}


class RecipeRefused(ConfigError):
    """The recipe asks for something the Bridge host cannot honour (the message says what)."""


def bridge_version() -> tuple[int, ...] | None:
    """The installed megatron-bridge release, or None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("megatron-bridge")
    except PackageNotFoundError:
        return None
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_bridge_version(found: tuple[int, ...] | None) -> None:
    low, high = TESTED_BRIDGE
    wanted = f"megatron-bridge >= {'.'.join(map(str, low))}, < {'.'.join(map(str, high))}"
    if found is None:
        raise RecipeRefused(f"megatron-bridge is not installed; the Bridge host needs {wanted}")
    if not low <= found[:2] < high:
        raise RecipeRefused(f"megatron-bridge {'.'.join(map(str, found))} is outside the tested "
                            f"range; install {wanted}")


def packed_data_config(seq_length: int) -> Any:
    """The dataset section the host gives Bridge: ``dataloader_type="external"``, whose iterable
    (the packing stream) Bridge passes through and checkpoints per DP rank."""
    from dataclasses import field, make_dataclass

    from megatron.bridge.data.base import DataloaderConfig

    global _PACKED_DATA
    if _PACKED_DATA is None:
        _PACKED_DATA = make_dataclass(
            "PackedByMegatronPacking",
            [("seq_length", int), ("packed_by_megatron_packing", bool, field(default=True))],
            bases=(DataloaderConfig,), kw_only=True)
    return _PACKED_DATA(seq_length=seq_length, dataloader_type="external", num_workers=0,
                        persistent_workers=False, pin_memory=False)


_PACKED_DATA: Any = None


def check_recipe(cfg: Any, *, source: str = "the recipe") -> None:
    """Refuse at start-up what the host cannot honour, naming the field (`RecipeRefused`)."""
    model, train = cfg.model, cfg.train
    vpp = getattr(model, "virtual_pipeline_model_parallel_size", None)
    if vpp not in (None, 1):
        raise RecipeRefused(
            f"{source}: model.virtual_pipeline_model_parallel_size {vpp}: with virtual pipeline "
            "stages Bridge saves no dataloader state, so a resume would replay or skip "
            "examples; set it to None")
    dataset = getattr(cfg, "dataset", None)
    if dataset is not None and not getattr(dataset, "packed_by_megatron_packing", False):
        own = _own_packing(dataset)
        if own:
            raise RecipeRefused(
                f"{source}: dataset.{own} turns on Megatron-Bridge's own packing beside "
                "megatron_packing's; set dataset = None (the training YAML's data: section is "
                "packed by the plugin)")
        raise RecipeRefused(
            f"{source}: dataset is a {type(dataset).__name__}, which the Bridge host would not "
            "read (it trains the training YAML's data: section); set dataset = None")
    if train.micro_batch_size != 1:
        raise RecipeRefused(
            f"{source}: train.micro_batch_size {train.micro_batch_size}: each micro-batch is one "
            "packed row (or one padded block); set it to 1")
    if getattr(train, "rampup_batch_size", None):
        raise RecipeRefused(
            f"{source}: train.rampup_batch_size {train.rampup_batch_size}: the plan sets each "
            "step's micro-batch count; remove the ramp-up")
    if train.train_iters is None:
        raise RecipeRefused(
            f"{source}: train.train_iters is not set: the plan repays its batch-size drift by "
            "the run's last step; give train_iters (not train_samples)")
    dropout = {name: getattr(model, name, 0.0) or 0.0
               for name in ("hidden_dropout", "attention_dropout")}
    if any(dropout.values()) and not getattr(cfg.rng, "data_parallel_random_init", False):
        given = ", ".join(f"model.{name} {value}" for name, value in dropout.items() if value)
        raise RecipeRefused(
            f"{source}: {given} with rng.data_parallel_random_init False: packed steps give the "
            "data-parallel ranks rows of different lengths, so their dropout generators drift "
            "apart, and Bridge then checkpoints DP rank 0's generator state only; a resumed run "
            "would not repeat the uninterrupted one. Set rng.data_parallel_random_init = True "
            "(each DP rank's state is saved) or the dropouts to 0")
    if not getattr(model, "calculate_per_token_loss", False):
        raise RecipeRefused(
            f"{source}: model.calculate_per_token_loss is False: packed steps differ in loss "
            "tokens, so gradients must be summed per token and divided by the step's count; "
            "set it to True")


def _own_packing(dataset: Any) -> str | None:
    """The field by which ``dataset`` turns on Bridge's own packing, if it does."""
    if getattr(dataset, "enable_offline_packing", False):
        return "enable_offline_packing"
    if getattr(dataset, "enable_in_batch_packing", False):
        return "enable_in_batch_packing"
    specs = getattr(dataset, "offline_packing_specs", None)
    if specs is not None and (getattr(specs, "packed_sequence_size", -1) or -1) > 0:
        return "offline_packing_specs.packed_sequence_size"
    return None


def host_settings(cfg: Any) -> HostSettings:
    """What the recipe decides of the packing section, named by its fields."""
    model = cfg.model
    fp8 = getattr(model, "fp8", None)
    return HostSettings(
        global_batch_size=int(cfg.train.global_batch_size), seq_length=int(model.seq_length),
        max_position_embeddings=int(getattr(model, "max_position_embeddings", None)
                                    or model.seq_length),
        tp_size=int(model.tensor_model_parallel_size or 1),
        cp_size=int(model.context_parallel_size or 1),
        pp_size=int(model.pipeline_model_parallel_size or 1), fp8_enabled=bool(fp8),
        fp8_recipe=getattr(model, "fp8_recipe", None), names=BRIDGE_NAMES)
