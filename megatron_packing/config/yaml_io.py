"""Reading YAML config files: a mapping at the top level, errors that name the file and the key."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from megatron_packing.validation import ConfigError


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


def unknown_key_message(key: Any, known: Iterable[str], what: str = "key") -> str | None:
    """None for a known key; else ``unknown <what> 'key'; did you mean ...? (valid keys: ...)``."""
    valid = sorted(known)
    if key in valid:
        return None
    hint = difflib.get_close_matches(str(key), valid, n=1)
    suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
    return f"unknown {what} {key!r}{suggestion} (valid keys: {', '.join(valid)})"


def check_mapping(values: Any, known: Iterable[str], *, source: str, what: str = "key") -> None:
    """``values`` is a mapping whose every key is known; errors name the source and suggest."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: expected a mapping of {what}s, got {type(values).__name__}")
    known = tuple(known)
    for key in values:
        message = unknown_key_message(key, known, what)
        if message:
            raise ConfigError(f"{source}: {message}")


def dataclass_from_mapping(cls: type, values: Any, *, source: str, what: str = "key") -> Any:
    """Build a config dataclass from a YAML mapping; an unknown key gets a did-you-mean hint."""
    check_mapping(values, (f.name for f in fields(cls)), source=source, what=what)
    return cls(**values)


__all__ = ["check_mapping", "dataclass_from_mapping", "read_yaml_mapping", "unknown_key_message"]
