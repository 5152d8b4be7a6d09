"""The dataloader's components: one frozen dataclass each, validated once, when it is built.

`PackingConfig` composes five of them, and every YAML key maps onto exactly one of their fields
(`YAML_KEYS`):

- `PackerConfig`: how examples fit into rows (capacity, algorithm, oversize policy, TP/CP/FP8,
  rows padded to the capacity);
- `PlannerConfig`: how steps are sized and bins go to ranks (B, the window, lookahead, deferral);
- `CollatorConfig`: how rows are padded (the pad token both modes use);
- `PaddedConfig`: padded mode's micro-batches (token budget or fixed size);
- `LoaderConfig`: the mode, the base order and its seed.

The samplers take `PackedSamplerConfig` and `PaddedSamplerConfig`, which add the data-parallel
size, the seed and evaluation; `WorkerConfig` holds the DataLoader's worker options. Their typed
keyword forms (`config.keywords`) build these through `config_from_keywords`, so no default is
written twice.
Errors name the field's YAML key (``global_batch_size``, not ``batch_size``), the value and what
would be valid.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from enum import StrEnum
from functools import cache, cached_property
from typing import Any, TypeVar, cast

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
from megatron_packing.packing.algorithms import OversizePolicy, PackingAlgorithm
from megatron_packing.packing.alignment import FP8_RECIPES, Alignment, make_alignment
from megatron_packing.packing.balance import ASSIGN_METHODS, DEFAULT_ATTENTION_COST_CONSTANT
from megatron_packing.packing.microbatch import SPLIT_METHODS, SplitMethod
from megatron_packing.packing.planner.tunables import DEFAULT_LOOKAHEAD_STEPS


class BaseOrder(StrEnum):
    """The example order within an epoch."""

    RANDOM = "random"
    SEQUENTIAL = "sequential"


# Each choice list is its enum's values: validation, the factories and argparse all read these.
PACKING_ALGORITHMS: tuple[str, ...] = tuple(a.value for a in PackingAlgorithm)
OVERSIZE_POLICIES: tuple[str, ...] = tuple(p.value for p in OversizePolicy)
BASE_ORDERS: tuple[str, ...] = tuple(o.value for o in BaseOrder)
RANK_ASSIGNMENTS: tuple[str, ...] = ASSIGN_METHODS
SAMPLER_SPLIT_METHOD = SplitMethod.BALANCED
"""Padded mode's splitter: the balanced split won or tied every workload of the benchmark."""

MAX_SEED = 2**63 - 1
"""Seeds are signed 64-bit integers in torch and numpy; a larger one would overflow there."""
MAX_BIN_CAPACITY = 2**31 - 1
"""Packed rows are addressed by int32 ``cu_seqlens`` (THD), so a row holds fewer tokens."""

Config = TypeVar("Config")


_KEY_OF: dict[tuple[type, str], str] = {}  # (component class, field) -> YAML key; filled below


def _key(config: Any, name: str) -> str:
    """The YAML key of a component's field (the field's own name when no key maps to it)."""
    return _KEY_OF.get((type(config), name), name)


def _check(config: Any, name: str, check: Any, **options: Any) -> None:
    """Validate one field under its YAML key and store the normalised value (numpy -> int)."""
    object.__setattr__(config, name, check(_key(config, name), getattr(config, name), **options))


def _check_seed(config: Any) -> None:
    """A seed: an integer >= 0 that fits the signed 64 bits torch and numpy seed with."""
    _check(config, "seed", require_int, minimum=0)
    if config.seed > MAX_SEED:
        raise ConfigError(f"{_key(config, 'seed')} must be at most 2**63 - 1 (torch and numpy "
                          f"seed with signed 64-bit integers), got {config.seed}")


def _require_component(config: Any, name: str, cls: type) -> None:
    value = getattr(config, name)
    if not isinstance(value, cls):
        raise TypeError(f"{type(config).__name__}.{name} must be a {cls.__name__}, "
                        f"got {type(value).__name__}")


# ---------------------------------------------------------------------------- components
@dataclass(frozen=True)
class PackerConfig:
    """How examples fit into rows of ``bin_capacity`` tokens, under the TP/CP/FP8 alignment."""

    bin_capacity: int
    """C: tokens per packed row (micro-batch), including alignment padding."""
    algorithm: str = "mffd"
    oversize_policy: str = "error"
    """An example whose aligned length exceeds the capacity: error, truncate or own_bin."""
    tp_size: int = 1
    cp_size: int = 1
    fp8_enabled: bool = False
    fp8_recipe: str | None = None
    pad_bins_to_capacity: bool = False
    """Plan every row exactly bin_capacity tokens long (static shapes, pipeline parallel)."""

    def __post_init__(self) -> None:
        _check(self, "bin_capacity", require_positive_int)
        if self.bin_capacity > MAX_BIN_CAPACITY:
            raise ConfigError(f"{_key(self, 'bin_capacity')} must be at most {MAX_BIN_CAPACITY} "
                              f"(packed rows are addressed by int32 cu_seqlens), got "
                              f"{self.bin_capacity}")
        _check(self, "algorithm", require_choice, choices=PACKING_ALGORITHMS)
        _check(self, "oversize_policy", require_choice, choices=OVERSIZE_POLICIES)
        _check(self, "tp_size", require_positive_int)
        _check(self, "cp_size", require_positive_int)
        _check(self, "fp8_enabled", require_bool)
        if self.fp8_recipe is not None:
            _check(self, "fp8_recipe", require_choice, choices=FP8_RECIPES)
            if not self.fp8_enabled:
                recipe, enabled = _key(self, "fp8_recipe"), _key(self, "fp8_enabled")
                raise ConfigError(
                    f"{recipe}={self.fp8_recipe!r} is set but {enabled} is {self.fp8_enabled!r}: "
                    f"the recipe only takes effect with {enabled}: true; set {enabled}: true, "
                    f"or remove {recipe}")
        multiple = self.alignment.bin_multiple
        if self.bin_capacity < multiple:
            raise ConfigError(
                f"{_key(self, 'bin_capacity')}={self.bin_capacity} is smaller than the per-bin "
                f"alignment multiple {multiple} (tp={self.tp_size}, cp={self.cp_size}, "
                f"fp8={self.fp8_enabled}, recipe={self.fp8_recipe}); use a multiple of {multiple}")
        _check(self, "pad_bins_to_capacity", require_bool)
        if self.pad_bins_to_capacity and self.bin_capacity % multiple:
            why = f" ({self.alignment.reason})" if self.alignment.reason else ""
            raise ConfigError(
                f"{_key(self, 'pad_bins_to_capacity')}: true pads every row to "
                f"bin_capacity={self.bin_capacity} tokens, which must divide by the per-bin "
                f"multiple {multiple}{why}; use a multiple of {multiple}, e.g. "
                f"{self.bin_capacity - self.bin_capacity % multiple}")

    @cached_property
    def alignment(self) -> Alignment:
        """The per-sequence and per-bin multiples that TP, CP and FP8 impose."""
        return make_alignment(self.tp_size, self.cp_size, self.fp8_enabled, self.fp8_recipe)


@dataclass(frozen=True)
class PlannerConfig:
    """How each step's size is chosen within B +- v and how its bins go to the DP ranks."""

    batch_size: int
    """B: examples per optimizer step on average."""
    allowed_variation: float = 0.05
    """The window as a fraction of B, in (0, 1): v = floor(B x allowed_variation) examples."""
    align_to_dp: bool = True
    """Vary the step's size within +-v so its bin count divides by dp (False: always B)."""
    lookahead_steps: int = DEFAULT_LOOKAHEAD_STEPS
    """Steps planned jointly when choosing a boundary (1 = greedy)."""
    max_packs: int | None = 8
    """Packer runs per step in the search on large windows; None searches the whole window."""
    max_deferred_examples: int = 0
    """A step that cannot align may leave up to this many examples for the next step (0: off)."""
    rank_assignment: str = "rebalanced"
    """How a step's work goes to DP ranks: whole bins by balanced estimated cost, then examples
    moved to the lightest ranks (`rebalanced`); whole bins only; or round robin."""
    attention_cost_constant: float = DEFAULT_ATTENTION_COST_CONSTANT
    """k in the per-sequence cost s + s^2/k used to balance ranks (about 6 x hidden size)."""
    microbatch_cost_tokens: float = 0.0
    """What one micro-batch costs of its own (launches, a pipeline slot), in tokens of linear
    work: a bin costs this plus its sequences' s + s^2/k; 0 charges nothing per bin."""

    def __post_init__(self) -> None:
        _check(self, "batch_size", require_positive_int)
        _check(self, "allowed_variation", require_number, minimum=0, maximum=1, exclusive=True)
        _check(self, "align_to_dp", require_bool)
        _check(self, "lookahead_steps", require_positive_int)
        _check(self, "max_packs", require_positive_int, allow_none=True)
        _check(self, "max_deferred_examples", require_int, minimum=0)
        _check(self, "rank_assignment", require_choice, choices=RANK_ASSIGNMENTS)
        _check(self, "attention_cost_constant", require_number, minimum=0, exclusive=True)
        _check(self, "microbatch_cost_tokens", require_number, minimum=0)
        if self.align_to_dp:
            check_batch_window(self.batch_size, self.allowed_variation, None)
        deferred = self.max_deferred_examples
        if deferred and not self.align_to_dp:
            raise ConfigError(
                f"{_key(self, 'max_deferred_examples')}={deferred} needs "
                f"{_key(self, 'align_to_dp')}: true (deferral only serves alignment); set it to 0")
        if deferred and deferred >= self.batch_size - self.v:
            raise ConfigError(
                f"{_key(self, 'max_deferred_examples')}={deferred} must be below the smallest "
                f"step size B - v = {self.batch_size - self.v}, so the next step can "
                "take them all")

    @property
    def v(self) -> int:
        """v = floor(B x allowed_variation), in examples."""
        return allowed_batch_variation(self.batch_size, self.allowed_variation)


@dataclass(frozen=True)
class CollatorConfig:
    """How rows are padded: the pad token (both modes). The packed rows' lengths are planned
    (`PackerConfig.pad_bins_to_capacity`)."""

    pad_token_id: int = 0

    def __post_init__(self) -> None:
        _check(self, "pad_token_id", require_int, minimum=0)


@dataclass(frozen=True)
class PaddedConfig:
    """Padded mode's micro-batches: filled up to a token budget, or of a fixed example count."""

    max_tokens_per_microbatch: int | None = None
    """Token budget per micro-batch (count x max_len). None: fixed micro_batch_size."""
    micro_batch_size: int = 1
    """Examples per micro-batch when there is no token budget."""
    split_method: str = SAMPLER_SPLIT_METHOD.value
    """How a rank's share is cut under the budget (`make_token_balanced_microbatches`)."""

    def __post_init__(self) -> None:
        _check(self, "max_tokens_per_microbatch", require_positive_int, allow_none=True)
        _check(self, "micro_batch_size", require_positive_int)
        _check(self, "split_method", require_choice, choices=SPLIT_METHODS)


@dataclass(frozen=True)
class LoaderConfig:
    """Which mode the loader builds, and the epoch's example order."""

    use_sequence_packing: bool = True
    """Pack examples into THD rows. Off: padded [b, max_len] micro-batches."""
    base_order: str = "random"
    """Example order within an epoch: seeded random (reshuffled per epoch) or sequential."""
    seed: int = 1234
    """Seeds the example order (and nothing else)."""

    def __post_init__(self) -> None:
        _check(self, "use_sequence_packing", require_bool)
        _check(self, "base_order", require_choice, choices=BASE_ORDERS)
        _check_seed(self)

    def order_kind(self, eval_mode: bool) -> str:
        """The base order to build: evaluation always reads its examples in sequence."""
        return "sequential" if eval_mode else self.base_order


# ---------------------------------------------------------------------------- what the objects take
@dataclass(frozen=True)
class PackedSamplerConfig:
    """Everything `DPAlignedPackingBatchSampler` plans with, besides the data and the rank."""

    packer: PackerConfig
    planner: PlannerConfig
    dp_size: int
    seed: int = 0
    """Seeds the epochs of a random base sampler that has no generator of its own."""
    eval_mode: bool = False
    """A fixed batch size, never varied, for evaluation."""

    def __post_init__(self) -> None:
        _require_component(self, "packer", PackerConfig)
        _require_component(self, "planner", PlannerConfig)
        _check(self, "dp_size", require_positive_int)
        _check_seed(self)
        _check(self, "eval_mode", require_bool)

    @property
    def align_to_dp(self) -> bool:
        """Alignment in force: evaluation keeps every step at B."""
        return self.planner.align_to_dp and not self.eval_mode

    @property
    def v(self) -> int:
        """v when steps align, else 0."""
        return self.planner.v if self.align_to_dp else 0

    @property
    def max_deferred_examples(self) -> int:
        """The deferral limit in force (only aligned steps defer)."""
        return self.planner.max_deferred_examples if self.align_to_dp else 0


@dataclass(frozen=True)
class PaddedSamplerConfig:
    """Everything `TokenBudgetBatchSampler` plans with, besides the data and the rank."""

    global_batch_size: int
    dp_size: int
    padded: PaddedConfig = PaddedConfig()
    seed: int = 0
    """Seeds the epochs of a random base sampler that has no generator of its own."""
    eval_mode: bool = False
    """Marks the plans as evaluation; an evaluation reads whole epochs whatever total_steps."""

    def __post_init__(self) -> None:
        _check(self, "global_batch_size", require_positive_int)
        _check(self, "dp_size", require_positive_int)
        _require_component(self, "padded", PaddedConfig)
        _check_seed(self)
        _check(self, "eval_mode", require_bool)


@dataclass(frozen=True)
class WorkerConfig:
    """The DataLoader's worker options (``build_sft_dataloader``'s keywords of the same names)."""

    num_workers: int = 0
    persistent_workers: bool = False
    prefetch_factor: int | None = None
    pin_memory: bool = False
    multiprocessing_context: Any = None

    def __post_init__(self) -> None:
        _check(self, "num_workers", require_int, minimum=0)
        _check(self, "persistent_workers", require_bool)
        _check(self, "prefetch_factor", require_positive_int, allow_none=True)
        _check(self, "pin_memory", require_bool)
        if self.num_workers == 0:  # these only shape worker processes: without any, no effect
            for name, unset in (("prefetch_factor", None), ("persistent_workers", False),
                                ("multiprocessing_context", None)):
                if getattr(self, name) != unset:
                    raise ConfigError(
                        f"{name}={getattr(self, name)!r} only applies to loader worker "
                        f"processes, but num_workers is 0 (the main process loads); set "
                        f"num_workers >= 1, or remove {name}")

    def loader_options(self) -> dict[str, Any]:
        """Keywords for the DataLoader; the worker-only ones only when there are workers."""
        options: dict[str, Any] = {"num_workers": self.num_workers, "pin_memory": self.pin_memory}
        if self.num_workers > 0:
            options["persistent_workers"] = self.persistent_workers
            if self.prefetch_factor is not None:
                options["prefetch_factor"] = self.prefetch_factor
            if self.multiprocessing_context is not None:
                options["multiprocessing_context"] = self.multiprocessing_context
        return options


# ---------------------------------------------------------------------------- YAML keys
COMPONENTS: dict[str, type] = {
    "loader": LoaderConfig,
    "packer": PackerConfig,
    "planner": PlannerConfig,
    "collator": CollatorConfig,
    "padded": PaddedConfig,
}
"""`PackingConfig`'s components, by attribute name."""

YAML_KEYS: dict[str, tuple[str, str]] = {
    "global_batch_size": ("planner", "batch_size"),
    "bin_capacity": ("packer", "bin_capacity"),
    "use_sequence_packing": ("loader", "use_sequence_packing"),
    "align_packing_bins_to_dp": ("planner", "align_to_dp"),
    "packing_batch_size_allowed_variation": ("planner", "allowed_variation"),
    "packing_algorithm": ("packer", "algorithm"),
    "oversize_policy": ("packer", "oversize_policy"),
    "max_tokens_per_microbatch": ("padded", "max_tokens_per_microbatch"),
    "micro_batch_size": ("padded", "micro_batch_size"),
    "tp_size": ("packer", "tp_size"),
    "cp_size": ("packer", "cp_size"),
    "fp8_enabled": ("packer", "fp8_enabled"),
    "fp8_recipe": ("packer", "fp8_recipe"),
    "base_order": ("loader", "base_order"),
    "seed": ("loader", "seed"),
    "rank_assignment": ("planner", "rank_assignment"),
    "attention_cost_constant": ("planner", "attention_cost_constant"),
    "microbatch_cost_tokens": ("planner", "microbatch_cost_tokens"),
    "pad_bins_to_capacity": ("packer", "pad_bins_to_capacity"),
    "lookahead_steps": ("planner", "lookahead_steps"),
    "max_deferred_examples": ("planner", "max_deferred_examples"),
    "pad_token_id": ("collator", "pad_token_id"),
}
"""Each YAML key (in the order ``to_dict`` lists them) -> (component, field)."""

_KEY_OF.update({
    (COMPONENTS[component], name): key for key, (component, name) in YAML_KEYS.items()
})


# ---------------------------------------------------------------------------- keyword forms
@cache
def _nested_components(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)
            if isinstance(hints[f.name], type) and dataclasses.is_dataclass(hints[f.name])}


@cache
def keyword_names(cls: type) -> tuple[str, ...]:
    """The flat keywords that build ``cls``: its own fields and those of the components it nests."""
    names: list[str] = []
    for f in fields(cls):
        nested = _nested_components(cls).get(f.name)
        names.extend(keyword_names(nested) if nested else [f.name])
    if len(set(names)) != len(names):
        raise AssertionError(f"{cls.__name__}: a keyword names two fields: {names}")
    return tuple(names)


def config_from_keywords(cls: type[Config], keywords: Mapping[str, Any], *, owner: str) -> Config:
    """Build ``cls`` from flat keywords, each going to the (nested) field of its name.

    An unknown keyword is a TypeError naming the valid ones; defaults are the dataclasses' own.
    """
    valid = keyword_names(cast(type, cls))
    unknown = sorted(set(keywords) - set(valid))
    if unknown:
        raise TypeError(f"{owner} got unexpected keyword argument(s) "
                        f"{', '.join(map(repr, unknown))}; valid: {', '.join(valid)}")
    return _build(cls, keywords, owner)


def _build(cls: type[Config], keywords: Mapping[str, Any], owner: str) -> Config:
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        nested = _nested_components(cast(type, cls)).get(f.name)
        if nested is not None:
            values[f.name] = _build(nested, keywords, owner)
        elif f.name in keywords:
            values[f.name] = keywords[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:
            raise TypeError(f"{owner} needs the keyword argument {f.name!r}")
    return cls(**values)


def config_or_keywords(cls: type[Config], config: Config | None, keywords: Mapping[str, Any], *,
                       owner: str) -> Config:
    """``config`` itself, or one built from the keyword form; giving both is an error."""
    if config is None:
        return config_from_keywords(cls, keywords, owner=owner)
    if keywords:
        raise TypeError(f"{owner} takes config= or the keyword form, not both "
                        f"(also given: {', '.join(sorted(keywords))})")
    if not isinstance(config, cls):
        raise TypeError(f"{owner} config must be a {cls.__name__}, got {type(config).__name__}")
    return config


__all__ = [
    "BASE_ORDERS",
    "COMPONENTS",
    "OVERSIZE_POLICIES",
    "PACKING_ALGORITHMS",
    "RANK_ASSIGNMENTS",
    "SAMPLER_SPLIT_METHOD",
    "YAML_KEYS",
    "CollatorConfig",
    "LoaderConfig",
    "PackedSamplerConfig",
    "PackerConfig",
    "PaddedConfig",
    "PaddedSamplerConfig",
    "PlannerConfig",
    "WorkerConfig",
    "config_from_keywords",
    "config_or_keywords",
    "keyword_names",
]
