"""Keys that only one loader mode reads: refused, or warned about, in the other mode.

A key the chosen mode never reads must not be accepted without a word. Its `YAML_KEYS` row says
which mode reads it; per key, one of:

- **refused** in packed mode: ``max_tokens_per_microbatch`` and ``micro_batch_size``. Packed
  mode's micro-batch is one bin of ``bin_capacity`` tokens; a user who sets Megatron's
  ``micro_batch_size`` expects it to apply, so a file that sets it in packed mode is a mistake.
- **warned about once** in padded mode: the packing keys (``bin_capacity``, the algorithm, the
  planner's and alignment keys). Padded mode is the baseline a packed run is compared with, and
  keeping the packing keys in one file while switching ``use_sequence_packing`` is reasonable;
  the warning names the keys that padded mode does not read.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from megatron_packing.common.user_warnings import UserFacingWarning
from megatron_packing.common.validation import ConfigError
from megatron_packing.config.components import YAML_KEYS

PADDED_ONLY_KEYS = tuple(key for key, row in YAML_KEYS.items() if row.mode == "padded")
"""Refused when ``use_sequence_packing`` is true."""

PACKED_ONLY_KEYS = tuple(key for key, row in YAML_KEYS.items() if row.mode == "packed")
"""Warned about (once per file and key) when ``use_sequence_packing`` is false."""


class UnusedKeyWarning(UserFacingWarning):
    """A config key that the chosen mode does not read (it has no effect)."""


_warned: set[tuple[str, str]] = set()


def check_mode_keys(values: Mapping[str, Any], defaults: Mapping[str, Any],
                    use_sequence_packing: bool, *, source: str) -> None:
    """Refuse padded-only keys in packed mode; warn once about packing keys in padded mode.

    Only a value that differs from the key's default counts: it is the one that would change
    something, and a config's own ``to_dict()`` (every key, defaults included) loads again.
    """
    given = {key for key, value in values.items() if key in defaults and value != defaults[key]}
    if use_sequence_packing:
        wrong = [key for key in PADDED_ONLY_KEYS if key in given]
        if wrong:
            raise ConfigError(
                f"{source}: {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} only read in "
                "padded mode (use_sequence_packing: false), but this config packs "
                "(use_sequence_packing: true), where each micro-batch is one bin of "
                "bin_capacity tokens; remove the key, or set use_sequence_packing: false")
        return
    unused = [key for key in PACKED_ONLY_KEYS if key in given and (source, key) not in _warned]
    if unused:
        _warned.update((source, key) for key in unused)
        warnings.warn(
            f"{source}: {', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect in "
            "padded mode (use_sequence_packing: false); kept for a packed run of the same file",
            UnusedKeyWarning, stacklevel=3)


__all__ = ["PACKED_ONLY_KEYS", "PADDED_ONLY_KEYS", "UnusedKeyWarning", "check_mode_keys"]
