"""Builders for sequence packers: by algorithm name, or from a parallelism/FP8 setup."""

from __future__ import annotations

from typing import Any

from megatron_packing.common.validation import require_positive_int

from .algorithms import (
    BFDPacker,
    FFDPacker,
    MFFDPacker,
    PackingAlgorithm,
    SeqPacker,
)
from .alignment import make_alignment

_PACKERS: dict[PackingAlgorithm, type[SeqPacker]] = {
    PackingAlgorithm.MFFD: MFFDPacker,
    PackingAlgorithm.FFD: FFDPacker,
    PackingAlgorithm.BFD: BFDPacker,
}


def _algorithm(name: PackingAlgorithm | str) -> PackingAlgorithm:
    try:
        return PackingAlgorithm(name.lower() if isinstance(name, str) else name)
    except ValueError:
        valid = ", ".join(a.value for a in PackingAlgorithm)
        raise ValueError(f"unknown packing algorithm {name!r}; valid names: {valid}") from None


def make_seq_packer(
    algorithm: PackingAlgorithm | str = "mffd", bin_capacity: int = 4096, **kwargs: Any
) -> SeqPacker:
    """A packer for ``algorithm`` (``mffd``, ``ffd`` or ``bfd``); kwargs go to :class:`SeqPacker`."""
    return _PACKERS[_algorithm(algorithm)](bin_capacity, **kwargs)


def _at_least_one(value: object, name: str) -> int:
    number = require_positive_int(name, value, error=ValueError)
    assert number is not None  # allow_none is off
    return number


def make_sft_sequence_packer(
    bin_capacity: int,
    tp_size: int = 1,
    cp_size: int = 1,
    *,
    dp_size: int | None = None,
    fp8_enabled: bool = False,
    fp8_recipe: str | None = None,
    algorithm: str = "mffd",
    oversize_policy: str = "error",
) -> SeqPacker:
    """The packer SFT training uses: alignment from TP/CP/FP8, bin count a multiple of dp.

    With ``dp_size`` the bin count is at least ``dp_size`` and a multiple of it (the planner's
    rounding, `dp_rounding.round_to_dp`): the heaviest bins are split, and when there are fewer
    examples than that, each gets a bin and the rest are empty placeholder bins.
    """
    _at_least_one(tp_size, "tp_size")
    _at_least_one(cp_size, "cp_size")
    kind = _algorithm(algorithm)
    alignment = make_alignment(tp_size, cp_size, fp8_enabled, fp8_recipe)
    alignment.usable_capacity(bin_capacity)  # clear error when capacity < per-bin multiple
    return _PACKERS[kind](bin_capacity, alignment=alignment, dp_size=dp_size,
                          oversize_policy=oversize_policy)
