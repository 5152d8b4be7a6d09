"""Rounding a step's bin count up to a multiple of the data-parallel size.

Every rank must run the same number of micro-batches, so a step's bins are raised to
`first_multiple` of dp: the least multiple of dp at or above the count, and at least dp. One
mechanism does it, for the planner's padded steps and for ``make_sft_sequence_packer(dp_size=...)``:
`round_to_dp`. With as many examples as bins it splits the heaviest bins (`split_to_count`:
balanced halves, each still fitting), so every bin holds real work. With fewer examples than bins
each example gets a bin of its own, in position order, and the rest are placeholder bins (empty:
a rank's zero-loss row).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .rebin import split_to_count

Bins = list[list[int]]


def first_multiple(count: int, dp: int) -> int:
    """The least multiple of dp at or above ``count``, and at least dp (one bin per rank)."""
    return max(dp, -(-count // dp) * dp)


def first_multiples(counts: np.ndarray, dp: int) -> np.ndarray:
    """`first_multiple` of each count."""
    return np.maximum(dp, -(-counts // dp) * dp)


def round_to_dp(bins: Bins, sizes: Sequence[int] | np.ndarray, dp: int) -> tuple[Bins, int]:
    """``bins`` raised to `first_multiple` of dp bins, and how many of them are placeholders.

    ``bins`` hold positions into ``sizes`` (the packer's aligned sizes) and cover each exactly
    once; a count already a multiple of dp (and at least dp) is returned as it is.
    """
    target = first_multiple(len(bins), dp)
    if target == len(bins):
        return bins, 0
    items = len(sizes)
    if items >= target:
        size_list = sizes.tolist() if isinstance(sizes, np.ndarray) else list(sizes)
        return split_to_count(bins, size_list, target), 0
    placeholders = target - items
    return [[i] for i in range(items)] + [[] for _ in range(placeholders)], placeholders
