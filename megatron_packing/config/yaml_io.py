"""Reading YAML config files strictly: a mapping at the top level, no key given twice, and
errors that name the file (with the line) and the key.

Every config file of the project goes through `read_yaml_mapping`: the demo trainer, ``inspect``,
``simulate --config``, ``tune`` and the Megatron-LM entry point. PyYAML keeps the last of two
equal keys without a word (``global_batch_size: 16`` then ``64``, or a second ``train:``
section replacing the first); `StrictLoader` refuses them with both lines.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from megatron_packing.common.validation import ConfigError


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping that names one key twice (YAML says keys are unique; PyYAML keeps the last)."""

    def __init__(self, key: Any, first: yaml.Mark, second: yaml.Mark, section: bool) -> None:
        self.key, self.first, self.second, self.section = key, first, second, section
        super().__init__(problem=f"duplicate key {key!r}", problem_mark=second)


class StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a mapping with a repeated key (merge keys ``<<`` allowed)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader refuses it below with its mark
                continue
            if first is not None:
                raise DuplicateKeyError(key, first, key_node.start_mark,
                                        isinstance(value_node, yaml.MappingNode))
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: str, source: str) -> Any:
    """Parse YAML text with `StrictLoader`; every YAML error becomes a `ConfigError` on ``source``."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
    except DuplicateKeyError as err:
        what = "section" if err.section else "key"
        raise ConfigError(
            f"{source}:{err.second.line + 1}: duplicate {what} {err.key!r} (first at line "
            f"{err.first.line + 1}): YAML keeps only the last one, so the first would be ignored; "
            f"keep one {what} {err.key!r}") from None
    except yaml.YAMLError as err:
        raise ConfigError(_describe_yaml_error(source, err)) from None


def read_config_text(path: str | Path) -> str:
    """The text of a config file; a missing file, a directory, an unreadable file or a byte
    that is not UTF-8 is one `ConfigError` naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a config file; give the YAML file's "
                          "path") from None
    except PermissionError:
        raise ConfigError(f"{path}: cannot read the config file (permission denied)") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config file: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
            "save the config file as UTF-8") from None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Parse a YAML config file whose top level must be a mapping (an empty file is ``{}``).

    Errors name the file: a missing or unreadable file, a byte that is not UTF-8, a syntax
    error or a duplicate key (with its line), or a top level that is a list or a scalar.
    """
    path = Path(path)
    document = load_yaml_text(read_config_text(path), str(path))
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


def _describe_yaml_error(source: str, err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    context = getattr(err, "context", None)
    detail = f"{context}, {problem}" if context else problem
    where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
    return f"{where}: YAML syntax error: {detail}"


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


__all__ = [
    "DuplicateKeyError",
    "StrictLoader",
    "check_mapping",
    "dataclass_from_mapping",
    "load_yaml_text",
    "read_config_text",
    "read_yaml_mapping",
    "unknown_key_message",
]
