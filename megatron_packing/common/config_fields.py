"""Fields of the frozen config dataclasses: the YAML key each declares, and their checks.

A component config (`PackerConfig` beside the packer, `PlannerConfig` beside the planner, the
loader's, collator's and padded mode's in `config/`) declares a YAML key on the field it sets:
``field(metadata=yaml_key("bin_capacity", "tokens per packed row ...", "packed"))``. That one
declaration is the key: `config.components.YAML_KEYS` collects the table from it, errors name
the key (``global_batch_size must be ...``, not ``batch_size``), and the README's key table shows
its meaning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, NamedTuple

from megatron_packing.common.validation import ConfigError, require_int

MAX_SEED = 2**63 - 1
"""Seeds are signed 64-bit integers in torch and numpy; a larger one would overflow there."""


class KeyInfo(NamedTuple):
    """A field's YAML key, what it means (one README line), and the loader mode that reads it
    (``both``, ``packed`` or ``padded``: `config.mode_keys`)."""

    key: str
    meaning: str
    mode: str = "both"


def yaml_key(key: str, meaning: str, mode: str = "both") -> dict[str, KeyInfo]:
    """The metadata that makes a dataclass field the home of a YAML key."""
    return {"yaml": KeyInfo(key, meaning, mode)}


def key_info(cls: type, name: str) -> KeyInfo | None:
    """The YAML key a field declares, or None."""
    for f in fields(cls):
        if f.name == name:
            info = f.metadata.get("yaml")
            return info if isinstance(info, KeyInfo) else None
    return None


def key_name(config: Any, name: str) -> str:
    """The YAML key of a config's field (the field's own name when it declares none)."""
    info = key_info(type(config), name)
    return name if info is None else info.key


def check_field(config: Any, name: str, check: Any, **options: Any) -> None:
    """Validate one field under its YAML key and store the normalised value (numpy -> int)."""
    object.__setattr__(config, name, check(key_name(config, name), getattr(config, name),
                                           **options))


def check_seed(config: Any) -> None:
    """A seed: an integer >= 0 that fits the signed 64 bits torch and numpy seed with."""
    check_field(config, "seed", require_int, minimum=0)
    if config.seed > MAX_SEED:
        raise ConfigError(f"{key_name(config, 'seed')} must be at most 2**63 - 1 (torch and "
                          f"numpy seed with signed 64-bit integers), got {config.seed}")


def require_component(config: Any, name: str, cls: type) -> None:
    """A nested component field holds a ``cls``."""
    value = getattr(config, name)
    if not isinstance(value, cls):
        raise TypeError(f"{type(config).__name__}.{name} must be a {cls.__name__}, "
                        f"got {type(value).__name__}")


def split_settings(classes: Sequence[type], settings: Mapping[str, Any], *,
                   owner: str) -> list[dict[str, Any]]:
    """Flat keyword settings, each sent to the one of ``classes`` that has a field of its name
    (a component's own defaults apply to the rest); an unknown name is a TypeError naming the
    valid ones."""
    out: list[dict[str, Any]] = [{} for _ in classes]
    valid = [f.name for cls in classes for f in fields(cls)]
    for name, value in settings.items():
        for part, cls in zip(out, classes, strict=True):
            if any(f.name == name for f in fields(cls)):
                part[name] = value
                break
        else:
            raise TypeError(f"{owner} got an unexpected keyword argument {name!r}; valid: "
                            f"{', '.join(valid)}")
    return out


__all__ = ["MAX_SEED", "KeyInfo", "check_field", "check_seed", "key_info", "key_name",
           "require_component", "split_settings", "yaml_key"]
