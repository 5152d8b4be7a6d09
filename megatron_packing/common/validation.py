"""Shared checks of configuration values, and the batch-size window they all agree on.

A leaf module: the config, the samplers and the simulation import it, and it imports nothing from
the project. Errors name the setting, the value and what would be valid.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and what would be valid."""


def allowed_batch_variation(global_batch_size: int, variation: float) -> int:
    """v = floor(B x variation): how many examples a step may differ from B."""
    # A small epsilon keeps 20 x 0.1 from flooring to 1 through float rounding.
    return int(math.floor(global_batch_size * variation + 1e-9))


def check_batch_window(global_batch_size: int, variation: float, dp_size: int | None) -> int:
    """Validate the DP-alignment window and return v; errors say what would be valid."""
    v = allowed_batch_variation(global_batch_size, variation)
    if v < 1:
        smallest = math.ceil(1e6 / global_batch_size) / 1e6
        raise ConfigError(
            f"packing_batch_size_allowed_variation={variation} gives a window of "
            f"floor({global_batch_size} x {variation}) = 0 examples for "
            f"global_batch_size={global_batch_size}; use at least {smallest:g} (a window of one "
            "example)"
        )
    if dp_size is not None and global_batch_size - v < dp_size:
        raise ConfigError(
            f"global_batch_size - v = {global_batch_size} - {v} = {global_batch_size - v} is "
            f"smaller than the data-parallel size {dp_size}: every rank needs at least one "
            f"example per step; raise global_batch_size to at least "
            f"{smallest_batch_for(dp_size, variation, global_batch_size)}"
        )
    return v


def smallest_batch_for(dp_size: int, variation: float, start: int = 1) -> int:
    """The smallest B >= ``start`` whose window passes: B - floor(B x variation) >= dp, v >= 1.

    Raising B also widens v, so B = dp + v (with the old v) can still fail; this searches.
    """
    batch = max(int(start), 1)
    while True:
        v = allowed_batch_variation(batch, variation)
        if v >= 1 and batch - v >= dp_size:
            return batch
        batch += 1


@overload
def require_int(name: str, value: Any, *, minimum: int | None = None,
                maximum: int | None = None, allow_none: Literal[False] = False,
                error: type[Exception] = ConfigError) -> int: ...


@overload
def require_int(name: str, value: Any, *, minimum: int | None = None,
                maximum: int | None = None, allow_none: bool = False,
                error: type[Exception] = ConfigError) -> int | None: ...


def require_int(name: str, value: Any, *, minimum: int | None = None,
                maximum: int | None = None, allow_none: bool = False,
                error: type[Exception] = ConfigError) -> int | None:
    """``value`` as an ``int`` (numpy integers accepted, bools refused), within the bounds.

    Returns None only when ``allow_none`` and the value is None. The error names the setting,
    the value and the valid range.
    """
    if value is None and allow_none:
        return None
    bounds = _describe_bounds(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        optional = " or None" if allow_none else ""
        raise error(f"{name} must be an integer{bounds}{optional}, got {value!r}")
    number = int(value)
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        raise error(f"{name} must be an integer{bounds}, got {number}")
    return number


@overload
def require_positive_int(name: str, value: Any, *, allow_none: Literal[False] = False,
                         error: type[Exception] = ConfigError) -> int: ...


@overload
def require_positive_int(name: str, value: Any, *, allow_none: bool = False,
                         error: type[Exception] = ConfigError) -> int | None: ...


def require_positive_int(name: str, value: Any, *, allow_none: bool = False,
                         error: type[Exception] = ConfigError) -> int | None:
    """``require_int`` with minimum 1: sizes, counts, capacities."""
    return require_int(name, value, minimum=1, allow_none=allow_none, error=error)


def require_number(name: str, value: Any, *, minimum: float | None = None,
                   maximum: float | None = None, exclusive: bool = False,
                   error: type[Exception] = ConfigError) -> float:
    """``value`` as a finite ``float`` within the bounds (open bounds with ``exclusive``).

    A one-sided bound reads as a comparison (``lr must be a number > 0``), two as an interval.
    """
    if minimum is not None and maximum is not None:
        low, high = ("(", ")") if exclusive else ("[", "]")
        interval = f" in {low}{minimum:g}, {maximum:g}{high}"
    elif minimum is not None:
        interval = f" {'>' if exclusive else '>='} {minimum:g}"
    elif maximum is not None:
        interval = f" {'<' if exclusive else '<='} {maximum:g}"
    else:
        interval = ""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise error(f"{name} must be a number{interval}, got {value!r}")
    number = float(value)
    outside = (
        not math.isfinite(number)
        or (minimum is not None and (number <= minimum if exclusive else number < minimum))
        or (maximum is not None and (number >= maximum if exclusive else number > maximum))
    )
    if outside:
        raise error(f"{name} must be a number{interval}, got {value!r}")
    return number


def require_bool(name: str, value: Any, *, error: type[Exception] = ConfigError) -> bool:
    """``value`` if it is a real bool: YAML's ``yes``/``"true"`` strings and 0/1 are refused."""
    if not isinstance(value, bool | np.bool_):
        raise error(f"{name} must be true or false, got {value!r}")
    return bool(value)


def require_choice(name: str, value: Any, choices: Iterable[str], *,
                   error: type[Exception] = ConfigError) -> str:
    """``value`` if it is one of ``choices`` (an enum member counts by its value)."""
    options = tuple(choices)
    plain = getattr(value, "value", value)
    if plain not in options:
        raise error(f"{name} must be one of {', '.join(options)}; got {value!r}")
    return str(plain)


def _describe_bounds(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def output_directory(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a directory this process can write into, created when missing; else one
    `ConfigError` naming ``what`` (the flag or key), the path and the OS error."""
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{what} {directory} is a file, not a directory; give a directory (it "
                          "is created when missing)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"{what} {directory} cannot be created: {error.strerror or error}; "
                          "give a directory that can be written") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {directory} is not writable by this user; give a directory "
                          "that can be written")
    return directory
