"""`PackingConfig`: the dataloader's YAML keys, their defaults and their validation.

One place defines the batch-size window ``v = floor(B x variation)`` (`allowed_batch_variation`);
the sampler, the simulation and the metrics all read it from here.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from megatron_packing.packing.alignment import FP8_RECIPES, make_alignment
from megatron_packing.validation import ConfigError, allowed_batch_variation, check_batch_window

PACKING_ALGORITHMS = ("mffd", "ffd", "bfd")
OVERSIZE_POLICIES = ("error", "truncate", "own_bin")
BASE_ORDERS = ("random", "sequential")
RANK_ASSIGNMENTS = ("karmarkar_karp", "round_robin")


@dataclass
class PackingConfig:
    """Dataloader settings. Field names are the YAML keys (section ``packing:`` or top level)."""

    global_batch_size: int = 128
    """B: examples per optimizer step on average."""
    bin_capacity: int = 4096
    """C: tokens per packed row (micro-batch), including alignment padding."""
    use_sequence_packing: bool = True
    """Pack examples into THD rows. Off: padded [b, max_len] micro-batches."""
    align_packing_bins_to_dp: bool = False
    """Vary the step's batch size within +-v so its bin count divides by dp."""
    packing_batch_size_allowed_variation: float = 0.05
    """The window: v = floor(B x variation) examples, variation in (0, 1)."""
    packing_algorithm: str = "mffd"
    oversize_policy: str = "error"
    """An example whose aligned length exceeds the capacity: error, truncate or own_bin."""
    max_tokens_per_microbatch: int | None = None
    """Padded mode: token budget per micro-batch (count x max_len). None: fixed micro_batch_size."""
    micro_batch_size: int = 1
    """Padded mode without a token budget: examples per micro-batch."""
    tp_size: int = 1
    cp_size: int = 1
    fp8_enabled: bool = False
    fp8_recipe: str | None = None
    base_order: str = "random"
    """Example order within an epoch: seeded random (reshuffled per epoch) or sequential."""
    seed: int = 1234
    rank_assignment: str = "karmarkar_karp"
    """How bins go to DP ranks: balanced estimated cost, or round robin."""
    attention_cost_constant: float = 24576.0
    """k in the per-sequence cost s + s^2/k used to balance ranks (about 6 x hidden size)."""
    pad_bins_to_capacity: bool = False
    """Pad every packed row to exactly bin_capacity tokens (static shapes, pipeline parallel)."""
    lookahead_steps: int = 3
    """Steps planned jointly when choosing a boundary (1 = greedy)."""
    max_deferred_examples: int = 0
    """A step that cannot align may leave up to this many examples for the next step (0: off)."""
    pad_token_id: int = 0

    # ---------------------------------------------------------------- derived values
    @property
    def allowed_variation(self) -> int:
        """v, in examples."""
        return allowed_batch_variation(self.global_batch_size, self.packing_batch_size_allowed_variation)

    @property
    def alignment(self):  # -> Alignment (kept untyped to avoid an import cycle in docs tools)
        return make_alignment(self.tp_size, self.cp_size, self.fp8_enabled, self.fp8_recipe)

    # ---------------------------------------------------------------- validation
    def validate(self, dp_size: int | None = None) -> PackingConfig:
        """Check every key; raise `ConfigError` naming the key, the value and what is valid."""
        _require_int("global_batch_size", self.global_batch_size, minimum=1)
        _require_int("bin_capacity", self.bin_capacity, minimum=1)
        _require_int("micro_batch_size", self.micro_batch_size, minimum=1)
        _require_int("tp_size", self.tp_size, minimum=1)
        _require_int("cp_size", self.cp_size, minimum=1)
        _require_int("lookahead_steps", self.lookahead_steps, minimum=1)
        _require_int("seed", self.seed, minimum=0)
        _require_int("pad_token_id", self.pad_token_id, minimum=0)
        for name in ("use_sequence_packing", "align_packing_bins_to_dp", "fp8_enabled",
                     "pad_bins_to_capacity"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _require_choice("packing_algorithm", self.packing_algorithm, PACKING_ALGORITHMS)
        _require_choice("oversize_policy", self.oversize_policy, OVERSIZE_POLICIES)
        _require_choice("base_order", self.base_order, BASE_ORDERS)
        _require_choice("rank_assignment", self.rank_assignment, RANK_ASSIGNMENTS)
        if self.fp8_recipe is not None:
            _require_choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
            if self.fp8_enabled is not True:
                raise ConfigError(
                    f"fp8_recipe={self.fp8_recipe!r} is set but fp8_enabled is "
                    f"{self.fp8_enabled!r}: the recipe only takes effect with fp8_enabled: true; "
                    "set fp8_enabled: true, or remove fp8_recipe"
                )
        if not (isinstance(self.attention_cost_constant, int | float)
                and self.attention_cost_constant > 0):
            raise ConfigError(
                f"attention_cost_constant must be a positive number, got {self.attention_cost_constant!r}"
            )
        if self.max_tokens_per_microbatch is not None:
            _require_int("max_tokens_per_microbatch", self.max_tokens_per_microbatch, minimum=1)

        variation = self.packing_batch_size_allowed_variation
        if isinstance(variation, bool) or not isinstance(variation, int | float) or not 0 < variation < 1:
            raise ConfigError(
                f"packing_batch_size_allowed_variation must be a number in (0, 1), got {variation!r}"
            )

        bin_multiple = self.alignment.bin_multiple
        if self.use_sequence_packing and self.bin_capacity < bin_multiple:
            raise ConfigError(
                f"bin_capacity={self.bin_capacity} is smaller than the per-bin alignment multiple "
                f"{bin_multiple} (tp={self.tp_size}, cp={self.cp_size}, fp8={self.fp8_enabled}, "
                f"recipe={self.fp8_recipe}); use a multiple of {bin_multiple}"
            )
        if (self.use_sequence_packing and self.pad_bins_to_capacity
                and self.bin_capacity % bin_multiple):
            raise ConfigError(
                f"pad_bins_to_capacity: true pads every row to bin_capacity={self.bin_capacity} "
                f"tokens, which must divide by the per-bin alignment multiple {bin_multiple} "
                f"(tp={self.tp_size}, cp={self.cp_size}, fp8={self.fp8_enabled}); use a multiple "
                f"of {bin_multiple}, e.g. {self.bin_capacity - self.bin_capacity % bin_multiple}"
            )

        if self.align_packing_bins_to_dp:
            if not self.use_sequence_packing:
                raise ConfigError(
                    "align_packing_bins_to_dp: true needs use_sequence_packing: true "
                    "(bins only exist when examples are packed)"
                )
            check_batch_window(self.global_batch_size, variation, dp_size)
        _require_int("max_deferred_examples", self.max_deferred_examples, minimum=0)
        if self.max_deferred_examples:
            lowest = self.global_batch_size - self.allowed_variation
            if not self.align_packing_bins_to_dp:
                raise ConfigError(
                    f"max_deferred_examples={self.max_deferred_examples} needs "
                    "align_packing_bins_to_dp: true (deferral only serves alignment); set it to 0"
                )
            if self.max_deferred_examples >= lowest:
                raise ConfigError(
                    f"max_deferred_examples={self.max_deferred_examples} must be below the "
                    f"smallest step size B - v = {lowest}, so the next step can take them all"
                )
        if dp_size is not None:
            _require_int("dp_size", dp_size, minimum=1)
        return self

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> PackingConfig:
        """Build from a mapping, rejecting unknown keys with a suggestion."""
        return dataclass_from_mapping(cls, values, source=source, what="packing key")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path, *, dp_size: int | None = None) -> PackingConfig:
    """Read the ``packing:`` section of a training YAML (or a file of packing keys) and validate."""
    path = Path(path)
    document = read_yaml_mapping(path)
    section = document.get("packing", document)
    if section is None:
        section = {}
    try:
        return PackingConfig.from_dict(section, source=str(path)).validate(dp_size)
    except ConfigError as err:
        message = str(err)
        if not message.startswith(str(path)):
            message = f"{path}: {message}"
        raise ConfigError(message) from None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a YAML config file whose top level must be a mapping (an empty file is ``{}``).

    Errors name the file: a missing file, a syntax error (with its line and column), or a top
    level that is a list or a scalar rather than a mapping of keys.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (IsADirectoryError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config file: {err}") from None
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(_describe_yaml_error(path, err)) from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        shown = repr(document)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        raise ConfigError(
            f"{path}: expected a mapping of keys at the top level (e.g. 'packing:' or "
            f"'global_batch_size: 128'), got a YAML {_yaml_kind(document)}: {shown}"
        )
    return document


def _describe_yaml_error(path: Path, err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    detail = f"{context}, {problem}" if context else problem
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{path}: not valid YAML{where}: {detail}"


def _yaml_kind(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    return f"scalar ({type(value).__name__})"


def dataclass_from_mapping(cls: type, values: Any, *, source: str, what: str = "key") -> Any:
    """Build a config dataclass from a YAML mapping; an unknown key gets a did-you-mean hint."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a mapping of {what}s, got {type(values).__name__}")
    known = {f.name for f in fields(cls)}
    for key in values:
        if key not in known:
            hint = difflib.get_close_matches(str(key), sorted(known), n=1)
            suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(f"{source}: unknown {what} {key!r}{suggestion} "
                              f"(valid keys: {', '.join(sorted(known))})")
    return cls(**values)


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _require_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
