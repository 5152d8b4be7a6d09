"""The README's table of ``packing:`` keys, generated from the config tree.

Each row is a YAML key as its field declares it (`YAML_KEYS`: its meaning) with the default of a
`PackingConfig`. ``python -m megatron_packing.reports.key_table --write-docs`` rewrites the
table in README.md between its markers; a test fails when the README differs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from megatron_packing.config.components import YAML_KEYS
from megatron_packing.config.packing_config import PackingConfig

START, END = "<!-- config-keys:start -->", "<!-- config-keys:end -->"
README = Path(__file__).resolve().parents[2] / "README.md"


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def render() -> str:
    """The table, one row per YAML key, defaults read from a default `PackingConfig`."""
    defaults = PackingConfig().to_dict()
    rows = ["| key | default | meaning |", "|---|---|---|"]
    rows += [f"| `{key}` | {_show(defaults[key])} | {row.meaning} |"
             for key, row in YAML_KEYS.items()]
    return "\n".join(rows)


def replace_table(text: str, table: str) -> str:
    """``text`` with the part between the markers replaced by ``table``."""
    head, sep, rest = text.partition(START)
    _, sep_end, tail = rest.partition(END)
    if not sep or not sep_end:
        raise ValueError(f"README.md lacks the markers {START} ... {END}")
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str]) -> int:
    if argv != ["--write-docs"]:
        print("usage: python -m megatron_packing.reports.key_table --write-docs", file=sys.stderr)
        return 2
    README.write_text(replace_table(README.read_text(), render()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
