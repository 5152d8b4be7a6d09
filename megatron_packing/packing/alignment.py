"""Alignment rules that tensor, context parallelism and FP8 impose on packed bins.

Two multiples matter:

* the **per-sequence** multiple: every packed sequence is padded up to it, because context
  parallelism splits each sequence into ``2 x cp`` load-balanced chunks that are further
  split across ``tp`` ranks by sequence parallelism;
* the **per-bin** (aggregate) multiple: the whole bin's token count must divide by it. It is
  paid once per bin, by growing only the last segment, never once per sequence.

=====================  ==============  ================================================
setting                per-sequence    per-bin
=====================  ==============  ================================================
cp = 1                 1               tp
cp > 1                 2 x tp x cp     2 x tp x cp
FP8 ``delayed`` /      (unchanged)     lcm(above, 16 x tp x cp) when tp > 1,
``tensorwise`` / None                  lcm(above, 16 x cp) when tp = 1
FP8 ``mxfp8``          (unchanged)     lcm(above, 32 x tp x cp)
FP8 ``blockwise``      (unchanged)     lcm(above, 128 x tp x cp) when tp > 1,
                                       lcm(above, 16 x cp) when tp = 1
=====================  ==============  ================================================

``None`` as the FP8 recipe means the default (``delayed``) recipe. A bin fits when the sum
of its padded sequence lengths is at most :meth:`Alignment.usable_capacity`, which is the same
as its :meth:`Alignment.footprint` being at most the capacity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from megatron_packing.common.validation import require_positive_int


class Fp8Recipe(StrEnum):
    """The FP8 recipes whose alignment rules are known."""

    DELAYED = "delayed"
    TENSORWISE = "tensorwise"
    MXFP8 = "mxfp8"
    BLOCKWISE = "blockwise"


FP8_RECIPES: tuple[str, ...] = tuple(r.value for r in Fp8Recipe)


@dataclass(frozen=True)
class Alignment:
    """Per-sequence and per-bin token multiples (see the module docstring for the rules)."""

    seq_multiple: int = 1
    bin_multiple: int = 1
    reason: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("seq_multiple", "bin_multiple"):
            object.__setattr__(self, name, _positive_int(getattr(self, name), name))

    def padded_length(self, length: int) -> int:
        """``length`` rounded up to the per-sequence multiple."""
        m = self.seq_multiple
        return -(-int(length) // m) * m  # -(-a // m) is ceil(a / m) in integers

    def padded_lengths(self, lengths: Iterable[int] | np.ndarray) -> np.ndarray:
        """Vectorised :meth:`padded_length`; returns int64."""
        arr = np.asarray(lengths, dtype=np.int64)
        m = self.seq_multiple
        if m == 1:
            return arr.copy()
        return -(-arr // m) * m

    def footprint(self, lengths: Iterable[int] | np.ndarray) -> int:
        """Tokens a bin holding ``lengths`` occupies: padded sum, rounded up once per bin."""
        total = int(self.padded_lengths(lengths).sum())
        m = self.bin_multiple
        return -(-total // m) * m

    def usable_capacity(self, bin_capacity: int) -> int:
        """Largest multiple of the per-bin multiple not above ``bin_capacity``.

        A bin fits iff the sum of its padded lengths is at most this value.
        """
        cap = _positive_int(bin_capacity, "bin_capacity")
        m = self.bin_multiple
        if cap < m:
            why = f" ({self.reason})" if self.reason else ""
            raise ValueError(
                f"bin_capacity {cap} is smaller than the per-bin multiple {m}{why}; "
                f"use a capacity that is a multiple of {m}"
            )
        return (cap // m) * m

    def max_sequence_length(self, bin_capacity: int) -> int:
        """Longest raw sequence whose padded length still fits an empty bin."""
        usable = self.usable_capacity(bin_capacity)
        # Rounding up to a multiple never passes the next multiple, so any length up to the
        # largest multiple of seq_multiple within ``usable`` aligns to at most ``usable``.
        return (usable // self.seq_multiple) * self.seq_multiple


def _positive_int(value: object, name: str) -> int:
    """``value`` as an int >= 1 (numpy integers accepted, bools refused), else a ValueError."""
    number = require_positive_int(name, value, error=ValueError)
    assert number is not None  # allow_none is off
    return number


def make_alignment(
    tp_size: int = 1,
    cp_size: int = 1,
    fp8_enabled: bool = False,
    fp8_recipe: str | None = None,
) -> Alignment:
    """Alignment for a tensor-parallel size, context-parallel size and FP8 setting."""
    tp = _positive_int(tp_size, "tp_size")
    cp = _positive_int(cp_size, "cp_size")
    recipe = "delayed" if fp8_recipe is None else str(fp8_recipe).lower()
    if recipe not in FP8_RECIPES:
        raise ValueError(
            f"unknown fp8_recipe {fp8_recipe!r}; valid recipes: {', '.join(FP8_RECIPES)}"
        )
    if cp > 1:
        # Context parallelism cuts every sequence into 2 x cp chunks (rank r holds chunks r and
        # 2cp - 1 - r, which balances causal attention), and sequence parallelism splits each
        # chunk over the tp ranks: every sequence must divide by 2 x tp x cp.
        seq = 2 * tp * cp
        bin_multiple = seq
        reasons = [f"context parallelism needs 2*tp*cp = {seq}"]
    else:
        # Without CP only the packed row as a whole is split over the tp ranks.
        seq = 1
        bin_multiple = tp
        reasons = [f"sequence parallelism needs tp = {tp}"] if tp > 1 else []
    if fp8_enabled:
        # FP8 GEMMs take the tokens each rank holds (the row divided by tp x cp) as a matrix
        # dimension, which must be a multiple of the recipe's block (the table above), so the
        # row divides by that block times tp x cp. Both rules must hold: hence the lcm.
        if recipe == "mxfp8":
            fp8 = 32 * tp * cp
            rule = "32*tp*cp"
        elif tp == 1:
            fp8 = 16 * cp
            rule = "16*cp"
        elif recipe == "blockwise":
            fp8 = 128 * tp * cp
            rule = "128*tp*cp"
        else:
            fp8 = 16 * tp * cp
            rule = "16*tp*cp"
        bin_multiple = math.lcm(bin_multiple, fp8)
        reasons.append(f"FP8 recipe {recipe!r} needs {rule} = {fp8}")
    return Alignment(seq, bin_multiple, reason="; ".join(reasons))
