"""The flat YAML keys as typed, read-only attributes of `PackingConfig` (``config.seed``).

One property per key of `YAML_KEYS`, each returning its component's field, declared in the class
body so that type checkers see every attribute and its type. A key added to `YAML_KEYS` needs its
property here: tests/config/test_key_attributes.py fails until both agree.
"""

from __future__ import annotations

from megatron_packing.config.components import (
    CollatorConfig,
    LoaderConfig,
    PackerConfig,
    PaddedConfig,
    PlannerConfig,
)


class YamlKeyAttributes:
    """`PackingConfig`'s YAML keys, each read from the component field that `YAML_KEYS` names."""

    # The components, as `PackingConfig` (a dataclass) declares and sets them.
    loader: LoaderConfig
    packer: PackerConfig
    planner: PlannerConfig
    collator: CollatorConfig
    padded: PaddedConfig

    @property
    def global_batch_size(self) -> int:
        """YAML key, read from ``planner.batch_size``."""
        return self.planner.batch_size

    @property
    def bin_capacity(self) -> int:
        """YAML key, read from ``packer.bin_capacity``."""
        return self.packer.bin_capacity

    @property
    def use_sequence_packing(self) -> bool:
        """YAML key, read from ``loader.use_sequence_packing``."""
        return self.loader.use_sequence_packing

    @property
    def align_packing_bins_to_dp(self) -> bool:
        """YAML key, read from ``planner.align_to_dp``."""
        return self.planner.align_to_dp

    @property
    def packing_batch_size_allowed_variation(self) -> float:
        """YAML key, read from ``planner.allowed_variation``."""
        return self.planner.allowed_variation

    @property
    def packing_algorithm(self) -> str:
        """YAML key, read from ``packer.algorithm``."""
        return self.packer.algorithm

    @property
    def oversize_policy(self) -> str:
        """YAML key, read from ``packer.oversize_policy``."""
        return self.packer.oversize_policy

    @property
    def max_tokens_per_microbatch(self) -> int | None:
        """YAML key, read from ``padded.max_tokens_per_microbatch``."""
        return self.padded.max_tokens_per_microbatch

    @property
    def micro_batch_size(self) -> int:
        """YAML key, read from ``padded.micro_batch_size``."""
        return self.padded.micro_batch_size

    @property
    def tp_size(self) -> int:
        """YAML key, read from ``packer.tp_size``."""
        return self.packer.tp_size

    @property
    def cp_size(self) -> int:
        """YAML key, read from ``packer.cp_size``."""
        return self.packer.cp_size

    @property
    def fp8_enabled(self) -> bool:
        """YAML key, read from ``packer.fp8_enabled``."""
        return self.packer.fp8_enabled

    @property
    def fp8_recipe(self) -> str | None:
        """YAML key, read from ``packer.fp8_recipe``."""
        return self.packer.fp8_recipe

    @property
    def base_order(self) -> str:
        """YAML key, read from ``loader.base_order``."""
        return self.loader.base_order

    @property
    def seed(self) -> int:
        """YAML key, read from ``loader.seed``."""
        return self.loader.seed

    @property
    def rank_assignment(self) -> str:
        """YAML key, read from ``planner.rank_assignment``."""
        return self.planner.rank_assignment

    @property
    def attention_cost_constant(self) -> float:
        """YAML key, read from ``planner.attention_cost_constant``."""
        return self.planner.attention_cost_constant

    @property
    def microbatch_cost_tokens(self) -> float:
        """YAML key, read from ``planner.microbatch_cost_tokens``."""
        return self.planner.microbatch_cost_tokens

    @property
    def pad_bins_to_capacity(self) -> bool:
        """YAML key, read from ``packer.pad_bins_to_capacity``."""
        return self.packer.pad_bins_to_capacity

    @property
    def lookahead_steps(self) -> int:
        """YAML key, read from ``planner.lookahead_steps``."""
        return self.planner.lookahead_steps

    @property
    def max_deferred_examples(self) -> int:
        """YAML key, read from ``planner.max_deferred_examples``."""
        return self.planner.max_deferred_examples

    @property
    def pad_token_id(self) -> int:
        """YAML key, read from ``collator.pad_token_id``."""
        return self.collator.pad_token_id


__all__ = ["YamlKeyAttributes"]
