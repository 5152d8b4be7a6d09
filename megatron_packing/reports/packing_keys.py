"""Setting keys in a training YAML's ``packing:`` section, the rest of the file kept as written.

``calibrate --write`` puts its two keys there. The edit is by lines, so comments, order and
every other section stay as they were: a key already in the block has its value replaced (its
comment kept), a new one goes after the block's last key, at the block's indentation, and a
file without a ``packing:`` section gets one at its end. The result is parsed again and checked
as a packing section before it replaces the file (atomically), so a file is never left broken.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from megatron_packing.common.validation import ConfigError
from megatron_packing.config import PackingConfig
from megatron_packing.config.yaml_io import load_yaml_text, read_config_text

_SECTION = re.compile(r"^packing:\s*(#.*)?$")


def _is_content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


def set_packing_keys(text: str, keys: Mapping[str, str], source: str) -> str:
    """``text`` with ``keys`` (values already written as YAML scalars) set in its packing block."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _SECTION.match(line)), None)
    if start is None:
        if any(line.startswith("packing:") for line in lines):
            raise ConfigError(f"{source}: its packing: section is written inline; write it as a "
                              "block (one key a line) for --write, or add the keys by hand")
        tail = [""] if lines and lines[-1].strip() else []
        return "\n".join(lines + tail + ["packing:"] + [f"  {k}: {v}" for k, v in keys.items()]) + "\n"
    end = start + 1
    while end < len(lines) and (not _is_content(lines[end]) or lines[end][:1] in (" ", "\t")):
        end += 1
    body = [i for i in range(start + 1, end) if _is_content(lines[i])]
    indent = re.match(r"[ \t]*", lines[body[0]]).group(0) if body else "  "  # type: ignore[union-attr]
    last = body[-1] if body else start
    for key, value in keys.items():
        pattern = re.compile(rf"^{re.escape(indent)}{re.escape(key)}\s*:")
        found = next((i for i in body if pattern.match(lines[i])), None)
        if found is not None:
            comment = re.search(r"\s+#.*$", lines[found])
            lines[found] = f"{indent}{key}: {value}" + (comment.group(0) if comment else "")
        else:
            last += 1
            lines.insert(last, f"{indent}{key}: {value}")
            body.append(last)  # every line of the block so far lies before it
    return "\n".join(lines) + "\n"


def write_packing_keys(path: str | Path, keys: Mapping[str, float]) -> Path:
    """Set ``keys`` in the file's packing: section (module docstring); returns the path."""
    target = Path(path)
    source = str(path)
    shown = {key: f"{value:.6g}" for key, value in keys.items()}
    text = set_packing_keys(read_config_text(target), shown, source)
    document = load_yaml_text(text, source)
    section = document.get("packing") if isinstance(document, dict) else None
    if not isinstance(section, dict) or any(
            float(section.get(key, float("nan"))) != float(value) for key, value in shown.items()):
        raise ConfigError(f"{source}: could not set {', '.join(keys)} in its packing: section "
                          "by lines (an unusual layout); add them by hand")
    PackingConfig.from_dict(section, source=source)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, target)
    return target
