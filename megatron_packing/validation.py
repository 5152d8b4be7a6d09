"""Shared checks of configuration values, and the batch-size window they all agree on.

A leaf module: the config, the samplers and the simulation import it, and it imports nothing from
the project. Errors name the setting, the value and what would be valid.
"""

from __future__ import annotations

import math


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
            f"example per step; raise global_batch_size to at least {dp_size + v}"
        )
    return v
