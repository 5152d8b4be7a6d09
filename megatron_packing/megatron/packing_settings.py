"""The training YAML's ``packing:`` section completed from a Megatron host's own settings.

A Megatron host (Megatron-LM's arguments, a Megatron-Bridge ``ConfigContainer``) owns B, the
row size and the parallel sizes. The YAML may repeat them but never override them: a key that
disagrees is refused, naming the host's own setting (``--seq-length`` for Megatron-LM,
``model.seq_length`` for Bridge), so one reader serves every host and each message speaks the
user's own vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_packing.config import ConfigError, PackingConfig

FP8_RECIPES = {"delayed": "delayed", "tensorwise": "tensorwise", "mxfp8": "mxfp8",
               "blockwise": "blockwise"}


@dataclass(frozen=True)
class HostSettings:
    """What the host decides, and (``names``) the flag or field by which its user sets each."""

    global_batch_size: int
    seq_length: int
    max_position_embeddings: int
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    fp8_enabled: bool = False
    fp8_recipe: str | None = None
    names: Mapping[str, str] = field(default_factory=dict)

    def name(self, key: str) -> str:
        return self.names.get(key, key)


def resolve_packing_settings(packing: PackingConfig | Mapping[str, Any], host: HostSettings, *,
                             dp_size: int, explicit_keys: set[str], source: str
                             ) -> PackingConfig:
    """The YAML's packing section completed from (and checked against) the host's settings.

    ``packing`` is the section's mapping of keys (or a `PackingConfig`); it is validated only once
    completed, so a key that needs a host value (an FP8 recipe needs FP8 on) is judged with it.
    """
    values = dict(packing.to_dict() if isinstance(packing, PackingConfig) else packing)
    decided: dict[str, Any] = {"global_batch_size": host.global_batch_size}
    if values.get("use_sequence_packing") is False:  # padded: no rows to size or align
        check_padded_parallelism(host, source)
        _check_agreement(values, decided, explicit_keys, source, host)
        return PackingConfig.from_dict({**values, **decided}, source=source).validate(dp_size)
    decided.update({"tp_size": host.tp_size, "cp_size": host.cp_size,
                    "fp8_enabled": host.fp8_enabled})
    if host.fp8_enabled and host.fp8_recipe is not None:
        if host.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(f"{host.name('fp8_recipe')} {host.fp8_recipe!r} has no packing "
                              f"alignment rule; known: {', '.join(FP8_RECIPES)}")
        decided["fp8_recipe"] = FP8_RECIPES[host.fp8_recipe]
    _check_agreement(values, decided, explicit_keys, source, host)
    capacity = values["bin_capacity"] if "bin_capacity" in explicit_keys else host.seq_length
    resolved = PackingConfig.from_dict({**values, **decided, "bin_capacity": capacity},
                                       source=source)
    if resolved.bin_capacity > host.seq_length:
        raise ConfigError(
            f"{source}: packing.bin_capacity {capacity} exceeds {host.name('seq_length')} "
            f"{host.seq_length}; a packed row must fit the model's sequence length (raise "
            f"{host.name('seq_length')} or lower bin_capacity)")
    if resolved.bin_capacity > host.max_position_embeddings:
        raise ConfigError(
            f"{source}: packing.bin_capacity {capacity} exceeds "
            f"{host.name('max_position_embeddings')} {host.max_position_embeddings}")
    return resolved.validate(dp_size)


def _check_agreement(values: dict[str, Any], decided: dict[str, Any], explicit_keys: set[str],
                     source: str, host: HostSettings) -> None:
    """A YAML key that the host decides must agree with it."""
    for key, value in decided.items():
        if key in explicit_keys and values.get(key) != value:
            raise ConfigError(
                f"{source}: packing.{key} is {values.get(key)!r} but {host.name(key)} gives "
                f"{value!r}; remove the key from the YAML (the host's setting decides) or make "
                "them agree")


def check_padded_parallelism(host: HostSettings, source: str) -> None:
    """Padded mode's ``[b, L]`` blocks change shape every micro-batch and are not split by
    sequence: pipeline stages (one activation shape per step) and context parallelism (each
    sequence split over ranks) need packed rows."""
    if host.pp_size > 1:
        raise ConfigError(
            f"{source}: use_sequence_packing: false (padded mode) with {host.name('pp_size')} "
            f"{host.pp_size}: pipeline stages exchange activations of one shape per step, and "
            "padded micro-batches vary in both b and L; use packed mode "
            f"(use_sequence_packing: true) or {host.name('pp_size')} 1")
    if host.cp_size > 1:
        raise ConfigError(
            f"{source}: use_sequence_packing: false (padded mode) with {host.name('cp_size')} "
            f"{host.cp_size}: context parallelism splits packed THD rows by sequence; use packed "
            f"mode (use_sequence_packing: true) or {host.name('cp_size')} 1")


def check_examples_fit(lengths: Any, host: HostSettings, source: str) -> None:
    """In padded mode every example goes in whole (one longer than the token budget trains in a
    micro-batch of its own), so it must fit the model's sequence length and positions."""
    import numpy as np

    lengths = np.asarray(lengths)
    longest = int(lengths.max()) if lengths.size else 0
    if longest > host.seq_length:
        count = int((lengths > host.seq_length).sum())
        raise ConfigError(
            f"{source}: padded mode trains each example whole, but {count} example(s) are longer "
            f"than {host.name('seq_length')} {host.seq_length} (the longest has {longest} "
            f"tokens); raise {host.name('seq_length')} (and "
            f"{host.name('max_position_embeddings')}) to at least {longest}, or use packed "
            "mode (use_sequence_packing: true) with oversize_policy: truncate")
