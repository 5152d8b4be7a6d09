"""tqdm progress bars for the long steps (index build, simulation, tuning), off a terminal quiet."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


def progress_enabled(quiet: bool = False) -> bool:
    """Bars are shown when stderr is a terminal and ``--quiet`` was not given."""
    if quiet:
        return False
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


class Progress:
    """A bar over a known amount of work; a no-op when disabled (no tqdm import then)."""

    def __init__(self, total: int | None, desc: str, enabled: bool, unit: str = "it") -> None:
        self._bar: Any = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def track(items: Iterable[T], total: int, desc: str, enabled: bool, unit: str = "it") -> Iterator[T]:
    """Iterate ``items`` with a bar of ``total`` (nothing shown when disabled)."""
    with Progress(total, desc, enabled, unit) as bar:
        for item in items:
            yield item
            bar.update()
