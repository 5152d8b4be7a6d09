"""Print a benchmark's lines as they are measured and, with ``--out``, save them to a file that
starts with the exact command line that produced it."""

from __future__ import annotations

import datetime
import platform
import shlex
import sys
from pathlib import Path

import numpy as np


class Report:
    """Collects printed lines; `save` writes them under a header naming the command."""

    def __init__(self, out: str | None) -> None:
        self.out = Path(out) if out else None
        self.lines: list[str] = []

    def print(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self) -> None:
        if self.out is None:
            return
        command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        header = [f"Command: `{command}`", "",
                  f"Measured: {datetime.date.today().isoformat()}", "",
                  f"Python {platform.python_version()}, numpy {np.__version__}, "
                  f"{platform.machine()}; timings from a shared 2-core machine (noisy).", ""]
        self.out.write_text("\n".join(header + self.lines) + "\n")


def p99(values: list[float]) -> float:
    """The 99th percentile by rank (the nearest sample, no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
