"""`PlannerConfig`: how each step's size is chosen within B +- v and how its bins go to the DP
ranks; it builds the step sizer, and declares the YAML keys it holds on its fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_packing.common.config_fields import check_field, key_name, yaml_key
from megatron_packing.common.validation import (
    ConfigError,
    allowed_batch_variation,
    check_batch_window,
    require_bool,
    require_choice,
    require_int,
    require_number,
    require_positive_int,
)
from megatron_packing.packing.algorithms import SeqPacker
from megatron_packing.packing.balance import ASSIGN_METHODS, DEFAULT_ATTENTION_COST_CONSTANT
from megatron_packing.packing.planner.sizer import (
    DEFAULT_LOOKAHEAD_STEPS,
    DEFAULT_MAX_PACKS,
    StepSizer,
)
from megatron_packing.packing.tunables import DEFAULT_TUNABLES, PlannerTunables

RANK_ASSIGNMENTS: tuple[str, ...] = ASSIGN_METHODS


@dataclass(frozen=True)
class PlannerConfig:
    """How each step's size is chosen within B +- v and how its bins go to the DP ranks."""

    batch_size: int = field(metadata=yaml_key(
        "global_batch_size", "B: examples per step on average"))
    allowed_variation: float = field(default=0.05, metadata=yaml_key(
        "packing_batch_size_allowed_variation",
        "the window as a fraction of B, in (0, 1): v = floor(B x fraction) examples, v >= 1",
        "packed"))
    align_to_dp: bool = field(default=True, metadata=yaml_key(
        "align_packing_bins_to_dp", "vary the batch size so the bin count divides by dp",
        "packed"))
    lookahead_steps: int = field(default=DEFAULT_LOOKAHEAD_STEPS, metadata=yaml_key(
        "lookahead_steps", "steps planned together when choosing a boundary (1 = greedy)",
        "packed"))
    max_packs: int | None = DEFAULT_MAX_PACKS
    """Packer runs per step in the search on large windows; None searches the whole window
    (no YAML key)."""
    max_deferred_examples: int = field(default=0, metadata=yaml_key(
        "max_deferred_examples",
        "bounded deferral: a step may leave up to d examples of its window to lead the next "
        "step (at most one step late); needs `align_packing_bins_to_dp`", "packed"))
    rank_assignment: str = field(default="rebalanced", metadata=yaml_key(
        "rank_assignment",
        "work to ranks, by the cost `s + s^2/k`: whole bins balanced, then examples moved from "
        "the ranks above the mean to the lightest (`rebalanced`); whole bins only "
        "(`karmarkar_karp`, the earlier default: runs checkpointed under it resume with it); or "
        "`round_robin`", "packed"))
    attention_cost_constant: float = field(
        default=DEFAULT_ATTENTION_COST_CONSTANT,
        metadata=yaml_key("attention_cost_constant", "k in the cost, about 6 x hidden size",
                          "packed"))
    microbatch_cost_tokens: float = field(default=0.0, metadata=yaml_key(
        "microbatch_cost_tokens",
        "what one micro-batch costs of its own, in tokens: a bin costs this plus `s + s^2/k` of "
        "its sequences; 0 charges nothing per bin (`megatron-packing calibrate` measures both "
        "constants; [docs/calibrate.md](docs/calibrate.md))", "packed"))
    tunables: PlannerTunables = field(default=DEFAULT_TUNABLES, compare=False)
    """The planner's tuned constants (no YAML key: the benchmarks sweep them)."""

    def __post_init__(self) -> None:
        check_field(self, "batch_size", require_positive_int)
        check_field(self, "allowed_variation", require_number, minimum=0, maximum=1, exclusive=True)
        check_field(self, "align_to_dp", require_bool)
        check_field(self, "lookahead_steps", require_positive_int)
        check_field(self, "max_packs", require_positive_int, allow_none=True)
        check_field(self, "max_deferred_examples", require_int, minimum=0)
        check_field(self, "rank_assignment", require_choice, choices=RANK_ASSIGNMENTS)
        check_field(self, "attention_cost_constant", require_number, minimum=0, exclusive=True)
        check_field(self, "microbatch_cost_tokens", require_number, minimum=0)
        if self.align_to_dp:
            check_batch_window(self.batch_size, self.allowed_variation, None)
        deferred = self.max_deferred_examples
        if deferred and not self.align_to_dp:
            raise ConfigError(
                f"{key_name(self, 'max_deferred_examples')}={deferred} needs "
                f"{key_name(self, 'align_to_dp')}: true (deferral only serves alignment); set it to 0")
        if deferred and deferred >= self.batch_size - self.v:
            raise ConfigError(
                f"{key_name(self, 'max_deferred_examples')}={deferred} must be below the smallest "
                f"step size B - v = {self.batch_size - self.v}, so the next step can "
                "take them all")

    @property
    def v(self) -> int:
        """v = floor(B x allowed_variation), in examples."""
        return allowed_batch_variation(self.batch_size, self.allowed_variation)

    def build(self, packer: SeqPacker, dp_size: int, *, max_deferred: int) -> StepSizer:
        """The step sizer for ``packer`` (built without dp rounding) at ``dp_size``."""
        return StepSizer(packer, dp_size, max_deferred=max_deferred,
                         lookahead_steps=self.lookahead_steps, max_packs=self.max_packs,
                         tunables=self.tunables, microbatch_cost=self.microbatch_cost_tokens)


__all__ = ["RANK_ASSIGNMENTS", "PlannerConfig"]
