"""The timings file of ``megatron-packing calibrate``: JSON lines, one composition a line.

Each line is ``{"lengths": [int, ...], "ms": float}``: the sequence lengths of one micro-batch
and its measured forward + backward time in milliseconds. `read_timings` checks every line and
refuses a bad one with one `ConfigError` naming the file, the line and what is wrong; an empty
file, or one whose compositions cannot fix the fit's three constants, is refused the same way.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_packing.common.validation import ConfigError
from megatron_packing.packing.cost_fit import Measured, design_rank

FORMAT = '{"lengths": [int, ...], "ms": float}'


def _problem(record: Any) -> str | None:
    """What is wrong with one parsed line, or None."""
    if not isinstance(record, dict):
        return f"expected an object {FORMAT}, got {type(record).__name__}"
    missing = [key for key in ("lengths", "ms") if key not in record]
    if missing:
        return f"missing {', '.join(repr(k) for k in missing)} (each line is {FORMAT})"
    extra = sorted(set(record) - {"lengths", "ms"})
    if extra:
        return f"unknown key {', '.join(repr(k) for k in extra)} (each line is {FORMAT})"
    lengths, ms = record["lengths"], record["ms"]
    if not isinstance(lengths, list) or not lengths:
        return f"lengths must be a non-empty list of sequence lengths, got {lengths!r}"
    bad = [s for s in lengths if isinstance(s, bool) or not isinstance(s, int) or s <= 0]
    if bad:
        return f"lengths must be integers >= 1, got {bad[0]!r}"
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not math.isfinite(ms) or ms <= 0:
        return f"ms must be a number > 0 (milliseconds), got {ms!r}"
    return None


def read_timings(path: str | Path) -> list[Measured]:
    """The compositions of a timings file, each line checked (module docstring)."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such timings file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: cannot read the timings file ({exc})") from None
    measured: list[Measured] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}, line {number}: not a JSON line ({exc.msg}); each line "
                              f"is {FORMAT}") from None
        problem = _problem(record)
        if problem is not None:
            raise ConfigError(f"{source}, line {number}: {problem}")
        measured.append(Measured(tuple(record["lengths"]), float(record["ms"])))
    if not measured:
        raise ConfigError(f"{source}: the timings file is empty; it needs one composition a line, "
                          f"{FORMAT}")
    rank = design_rank(measured)
    if rank < 3:
        distinct = len({(m.tokens, m.squares) for m in measured})
        raise ConfigError(
            f"{source}, lines 1-{number}: too few distinct compositions to fit three constants: "
            f"{len(measured)} lines, {distinct} distinct (token total, sum of squared lengths), "
            f"which fix {rank} of the 3 (a per micro-batch, b per token, c per squared length); "
            "time micro-batches of different token totals and of different sequence mixes")
    return measured


def write_timings(path: str | Path, measured: Sequence[Measured]) -> Path:
    """Write ``measured`` as a timings file (atomically: a reader never sees half of it)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text("".join(json.dumps({"lengths": list(m.lengths), "ms": round(m.ms, 6)}) + "\n"
                               for m in measured), encoding="utf-8")
    os.replace(partial, target)
    return target
