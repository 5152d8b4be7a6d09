"""`PackingConfig`: the dataloader's YAML keys, mapped onto the components that use them.

The YAML stays flat (section ``packing:`` or the top level); `YAML_KEYS` says which component
field each key sets. Defaults and checks live in the components; this module adds the rules
between components and those that need the data-parallel size. One place defines the batch-size
window ``v = floor(B x variation)`` (`allowed_batch_variation`); the sampler, the simulation and
the metrics all read it from there.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_packing.common.validation import ConfigError, check_batch_window, require_positive_int
from megatron_packing.config.components import (
    COMPONENTS,
    YAML_KEYS,
    CollatorConfig,
    LoaderConfig,
    PackerConfig,
    PaddedConfig,
    PlannerConfig,
)
from megatron_packing.config.mode_keys import check_mode_keys
from megatron_packing.config.yaml_io import check_mapping, read_yaml_mapping, unknown_key_message
from megatron_packing.packing.alignment import Alignment


@dataclass(frozen=True, init=False)
class PackingConfig:
    """Dataloader settings: five validated components; the flat YAML keys read and set them.

    Build it from YAML keys (``PackingConfig(global_batch_size=64, bin_capacity=2048)``, or
    `from_dict`), from components (``PackingConfig(planner=PlannerConfig(...))``), or both (the
    keys then change the given components). Read a key as an attribute (``config.seed``: the
    component field its `YAML_KEYS` row names); change keys with `with_keys`. The defaults below
    are the YAML's: B and C have no library default (a sampler must be told them), and the YAML
    opts in to DP alignment, which a sampler built on its own does unless told not to.
    """

    loader: LoaderConfig = LoaderConfig()
    packer: PackerConfig = PackerConfig(bin_capacity=4096)
    planner: PlannerConfig = PlannerConfig(batch_size=128, align_to_dp=False)
    collator: CollatorConfig = CollatorConfig()
    padded: PaddedConfig = PaddedConfig()

    def __init__(self, *, loader: LoaderConfig | None = None, packer: PackerConfig | None = None,
                 planner: PlannerConfig | None = None, collator: CollatorConfig | None = None,
                 padded: PaddedConfig | None = None, **keys: Any) -> None:
        given = {"loader": loader, "packer": packer, "planner": planner, "collator": collator,
                 "padded": padded}
        changes: dict[str, dict[str, Any]] = defaultdict(dict)
        for key, value in keys.items():
            message = unknown_key_message(key, YAML_KEYS, "packing key")
            if message:
                raise TypeError(f"PackingConfig got an {message}")
            row = YAML_KEYS[key]
            changes[row.component][row.field] = value
        for name, cls in COMPONENTS.items():
            part = given[name]
            if part is None:
                part = getattr(PackingConfig, name)
            elif not isinstance(part, cls):
                raise TypeError(f"PackingConfig {name} must be a {cls.__name__}, "
                                f"got {type(part).__name__}")
            if changes[name]:
                part = dataclasses.replace(part, **changes[name])
            object.__setattr__(self, name, part)
        self._check_between_components()

    def _check_between_components(self) -> None:
        if self.planner.align_to_dp and not self.loader.use_sequence_packing:
            raise ConfigError(
                "align_packing_bins_to_dp: true needs use_sequence_packing: true "
                "(bins only exist when examples are packed)")

    def __getattr__(self, key: str) -> Any:
        """A YAML key's value, read from the component field its `YAML_KEYS` row names."""
        row = YAML_KEYS.get(key)
        if row is None:
            raise AttributeError(f"PackingConfig has no attribute {key!r} (its YAML keys: "
                                 f"{', '.join(YAML_KEYS)})")
        return getattr(getattr(self, row.component), row.field)

    # ---------------------------------------------------------------- derived values
    @property
    def v(self) -> int:
        """v, in examples."""
        return self.planner.v

    @property
    def alignment(self) -> Alignment:
        return self.packer.alignment

    # ---------------------------------------------------------------- validation
    def validate(self, dp_size: int | None = None) -> PackingConfig:
        """The checks that need the data-parallel size (the rest ran when the config was built).

        Every rank needs at least one example per aligned step: B - v >= dp.
        """
        if dp_size is not None:
            require_positive_int("dp_size", dp_size)
            if self.planner.align_to_dp:
                check_batch_window(self.planner.batch_size, self.planner.allowed_variation, dp_size)
        return self

    def check_token_ids(self, vocab_size: int, *, source: str) -> None:
        """Every token id the section gives is a token of the model's vocabulary: the padding of
        rows, blocks and placeholder rows is ``pad_token_id``, an embedding lookup."""
        pad = self.collator.pad_token_id
        if pad >= vocab_size:
            raise ConfigError(
                f"{source}: packing.pad_token_id {pad} is not in the vocabulary ({vocab_size} "
                f"tokens, ids 0 to {vocab_size - 1}); give an id below {vocab_size}, e.g. the "
                "tokenizer's pad or end-of-text id")

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> PackingConfig:
        """Build from a mapping of YAML keys; errors name the source and the key.

        A key the chosen mode does not read is refused or warned about (`check_mode_keys`).
        """
        check_mapping(values, YAML_KEYS, source=source, what="packing key")
        try:
            config = cls(**values)
        except ConfigError as err:
            raise ConfigError(_in_source(source, err)) from None
        check_mode_keys(values, _DEFAULT_KEYS, config.use_sequence_packing, source=source)
        return config

    def with_keys(self, **keys: Any) -> PackingConfig:
        """A copy with some YAML keys changed (validated as a whole)."""
        return PackingConfig(loader=self.loader, packer=self.packer, planner=self.planner,
                             collator=self.collator, padded=self.padded, **keys)

    def to_dict(self) -> dict[str, Any]:
        """The flat YAML keys and their values."""
        return {key: getattr(getattr(self, row.component), row.field)
                for key, row in YAML_KEYS.items()}


_DEFAULT_KEYS = PackingConfig().to_dict()


def _in_source(source: str, err: Exception) -> str:
    message = str(err)
    return message if message.startswith(f"{source}:") else f"{source}: {message}"


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
        raise ConfigError(_in_source(str(path), err)) from None


__all__ = ["PackingConfig", "load_config"]
