"""`PackerConfig`: how examples fit into rows, under the TP / CP / FP8 alignment; it builds the
packer (`make_sft_sequence_packer`), and declares the YAML keys it holds on its fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from megatron_packing.common.config_fields import check_field, key_name, yaml_key
from megatron_packing.common.validation import (
    ConfigError,
    require_bool,
    require_choice,
    require_positive_int,
)
from megatron_packing.packing.algorithms import OversizePolicy, PackingAlgorithm, SeqPacker
from megatron_packing.packing.alignment import FP8_RECIPES, Alignment, make_alignment
from megatron_packing.packing.factory import make_sft_sequence_packer

PACKING_ALGORITHMS: tuple[str, ...] = tuple(a.value for a in PackingAlgorithm)
OVERSIZE_POLICIES: tuple[str, ...] = tuple(p.value for p in OversizePolicy)
MAX_BIN_CAPACITY = 2**31 - 1
"""Packed rows are addressed by int32 ``cu_seqlens`` (THD), so a row holds fewer tokens."""


@dataclass(frozen=True)
class PackerConfig:
    """How examples fit into rows of ``bin_capacity`` tokens, under the TP/CP/FP8 alignment."""

    bin_capacity: int = field(metadata=yaml_key(
        "bin_capacity", "tokens per packed row, alignment padding included", "packed"))
    algorithm: str = field(default="mffd", metadata=yaml_key(
        "packing_algorithm", "`mffd`, `ffd` or `bfd`", "packed"))
    oversize_policy: str = field(default="error", metadata=yaml_key(
        "oversize_policy",
        "an example longer than the capacity: `error`, `truncate` or `own_bin`", "packed"))
    tp_size: int = field(default=1, metadata=yaml_key(
        "tp_size", "tensor-parallel size: a row's length divides by tp "
        "([docs/packing.md](docs/packing.md))", "packed"))
    cp_size: int = field(default=1, metadata=yaml_key(
        "cp_size", "context-parallel size: with cp > 1 each sequence rounds up to 2 x tp x cp",
        "packed"))
    fp8_enabled: bool = field(default=False, metadata=yaml_key(
        "fp8_enabled", "FP8 alignment: a row's length divides by the recipe's multiple",
        "packed"))
    fp8_recipe: str | None = field(default=None, metadata=yaml_key(
        "fp8_recipe", "`delayed`, `tensorwise`, `mxfp8` or `blockwise` (needs `fp8_enabled`)",
        "packed"))
    pad_bins_to_capacity: bool = field(default=False, metadata=yaml_key(
        "pad_bins_to_capacity", "pad every row to exactly C (static shapes, pipeline parallel)",
        "packed"))

    def __post_init__(self) -> None:
        check_field(self, "bin_capacity", require_positive_int)
        if self.bin_capacity > MAX_BIN_CAPACITY:
            raise ConfigError(f"{key_name(self, 'bin_capacity')} must be at most {MAX_BIN_CAPACITY} "
                              f"(packed rows are addressed by int32 cu_seqlens), got "
                              f"{self.bin_capacity}")
        check_field(self, "algorithm", require_choice, choices=PACKING_ALGORITHMS)
        check_field(self, "oversize_policy", require_choice, choices=OVERSIZE_POLICIES)
        check_field(self, "tp_size", require_positive_int)
        check_field(self, "cp_size", require_positive_int)
        check_field(self, "fp8_enabled", require_bool)
        if self.fp8_recipe is not None:
            check_field(self, "fp8_recipe", require_choice, choices=FP8_RECIPES)
            if not self.fp8_enabled:
                recipe, enabled = key_name(self, "fp8_recipe"), key_name(self, "fp8_enabled")
                raise ConfigError(
                    f"{recipe}={self.fp8_recipe!r} is set but {enabled} is {self.fp8_enabled!r}: "
                    f"the recipe only takes effect with {enabled}: true; set {enabled}: true, "
                    f"or remove {recipe}")
        multiple = self.alignment.bin_multiple
        if self.bin_capacity < multiple:
            raise ConfigError(
                f"{key_name(self, 'bin_capacity')}={self.bin_capacity} is smaller than the per-bin "
                f"alignment multiple {multiple} (tp={self.tp_size}, cp={self.cp_size}, "
                f"fp8={self.fp8_enabled}, recipe={self.fp8_recipe}); use a multiple of {multiple}")
        check_field(self, "pad_bins_to_capacity", require_bool)
        if self.pad_bins_to_capacity and self.bin_capacity % multiple:
            why = f" ({self.alignment.reason})" if self.alignment.reason else ""
            raise ConfigError(
                f"{key_name(self, 'pad_bins_to_capacity')}: true pads every row to "
                f"bin_capacity={self.bin_capacity} tokens, which must divide by the per-bin "
                f"multiple {multiple}{why}; use a multiple of {multiple}, e.g. "
                f"{self.bin_capacity - self.bin_capacity % multiple}")

    @cached_property
    def alignment(self) -> Alignment:
        """The per-sequence and per-bin multiples that TP, CP and FP8 impose."""
        return make_alignment(self.tp_size, self.cp_size, self.fp8_enabled, self.fp8_recipe)

    def build(self, dp_size: int | None = None) -> SeqPacker:
        """The packer (`make_sft_sequence_packer`); with ``dp_size`` its bin count is rounded up
        to a multiple of dp (the planner rounds its own steps: it builds without)."""
        return make_sft_sequence_packer(
            self.bin_capacity, self.tp_size, self.cp_size, dp_size=dp_size,
            fp8_enabled=self.fp8_enabled, fp8_recipe=self.fp8_recipe, algorithm=self.algorithm,
            oversize_policy=self.oversize_policy)


__all__ = ["MAX_BIN_CAPACITY", "OVERSIZE_POLICIES", "PACKING_ALGORITHMS", "PackerConfig"]
