"""The dataloader's components: one frozen dataclass each, validated once, when it is built.

`PackingConfig` composes five of them. Each YAML key is declared on the one field it sets
(`common.config_fields.yaml_key`: the key, its meaning, the loader mode that reads it);
`YAML_KEYS` collects them:

- `PackerConfig` (`packing/packer_config.py`, beside the packer it builds): how examples fit into
  rows (capacity, algorithm, oversize policy, TP/CP/FP8, rows padded to the capacity);
- `PlannerConfig` (`packing/planner/config.py`, beside the step sizer it builds): how steps are
  sized and bins go to ranks (B, the window, lookahead, deferral, the cost model);
- `LoaderConfig`: the mode, the base order and its seed;
- `PaddedConfig`: padded mode's micro-batches (token budget or fixed size);
- `CollatorConfig`: how rows are padded (the pad token both modes use).

Each sampler's config (`packed.sampler.PackedSamplerConfig`, `padded.sampler.
PaddedSamplerConfig`) sits beside the sampler it builds. Errors name the field's YAML key
(``global_batch_size``, not ``batch_size``), the value and what would be valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import NamedTuple

from megatron_packing.common.config_fields import check_field, check_seed, key_info, yaml_key
from megatron_packing.common.validation import (
    require_bool,
    require_choice,
    require_int,
    require_positive_int,
)
from megatron_packing.packing.microbatch import SPLIT_METHODS, SplitMethod
from megatron_packing.packing.packer_config import PackerConfig
from megatron_packing.packing.planner.config import PlannerConfig


class BaseOrder(StrEnum):
    """The example order within an epoch."""

    RANDOM = "random"
    SEQUENTIAL = "sequential"


BASE_ORDERS: tuple[str, ...] = tuple(o.value for o in BaseOrder)
SAMPLER_SPLIT_METHOD = SplitMethod.BALANCED
"""Padded mode's splitter: the balanced split won or tied every workload of the benchmark."""


# ---------------------------------------------------------------------------- components
@dataclass(frozen=True)
class CollatorConfig:
    """How rows are padded: the pad token (both modes). The packed rows' lengths are planned
    (`PackerConfig.pad_bins_to_capacity`)."""

    pad_token_id: int = field(default=0, metadata=yaml_key(
        "pad_token_id", "token id used for padding"))

    def __post_init__(self) -> None:
        check_field(self, "pad_token_id", require_int, minimum=0)


@dataclass(frozen=True)
class PaddedConfig:
    """Padded mode's micro-batches: filled up to a token budget, or of a fixed example count."""

    max_tokens_per_microbatch: int | None = field(default=None, metadata=yaml_key(
        "max_tokens_per_microbatch",
        "padded mode: fill each micro-batch up to this many padded tokens", "padded"))
    micro_batch_size: int = field(default=1, metadata=yaml_key(
        "micro_batch_size", "padded mode without a token budget", "padded"))
    split_method: str = SAMPLER_SPLIT_METHOD.value
    """How a rank's share is cut under the budget (`make_token_balanced_microbatches`)."""

    def __post_init__(self) -> None:
        check_field(self, "max_tokens_per_microbatch", require_positive_int, allow_none=True)
        check_field(self, "micro_batch_size", require_positive_int)
        check_field(self, "split_method", require_choice, choices=SPLIT_METHODS)


@dataclass(frozen=True)
class LoaderConfig:
    """Which mode the loader builds, and the epoch's example order."""

    use_sequence_packing: bool = field(default=True, metadata=yaml_key(
        "use_sequence_packing", "pack THD rows; false: padded `[b, max_len]` micro-batches"))
    base_order: str = field(default="random", metadata=yaml_key(
        "base_order", "`random` (seeded shuffle per epoch) or `sequential`"))
    seed: int = field(default=1234, metadata=yaml_key(
        "seed", "seeds the example order (and nothing else)"))

    def __post_init__(self) -> None:
        check_field(self, "use_sequence_packing", require_bool)
        check_field(self, "base_order", require_choice, choices=BASE_ORDERS)
        check_seed(self)

    def order_kind(self, eval_mode: bool) -> str:
        """The base order to build: evaluation always reads its examples in sequence."""
        return "sequential" if eval_mode else self.base_order


# ---------------------------------------------------------------------------- YAML keys
COMPONENTS: dict[str, type] = {
    "planner": PlannerConfig,
    "packer": PackerConfig,
    "loader": LoaderConfig,
    "padded": PaddedConfig,
    "collator": CollatorConfig,
}
"""`PackingConfig`'s components, by attribute name (the order of the YAML keys)."""


class YamlKey(NamedTuple):
    """One YAML key: the component field that declares it, its meaning, the mode reading it."""

    component: str
    field: str
    meaning: str
    mode: str


def _collect() -> dict[str, YamlKey]:
    table: dict[str, YamlKey] = {}
    for component, cls in COMPONENTS.items():
        for f in fields(cls):
            info = key_info(cls, f.name)
            if info is not None:
                if info.key in table:
                    raise AssertionError(f"two fields declare the YAML key {info.key!r}")
                table[info.key] = YamlKey(component, f.name, info.meaning, info.mode)
    return table


YAML_KEYS: dict[str, YamlKey] = _collect()
"""Each YAML key, as its field declares it, in component and field order (``to_dict`` and the
README list them so)."""


__all__ = [
    "BASE_ORDERS",
    "COMPONENTS",
    "SAMPLER_SPLIT_METHOD",
    "YAML_KEYS",
    "BaseOrder",
    "CollatorConfig",
    "LoaderConfig",
    "PackerConfig",
    "PaddedConfig",
    "PlannerConfig",
    "YamlKey",
]
