"""Bins -> `RowLayout`s: the THD row each bin becomes, decided when the step is planned.

Each sequence takes its TP/CP-aligned length; the row rounds the sum up to the per-bin multiple
(or widens it to the capacity, for static shapes), and that padding is paid once, by the last
segment. The collator then only writes tokens into the planned segments.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_packing.common.plan_types import RowLayout
from megatron_packing.packing.alignment import Alignment


class RowPlanner:
    """Lays out bins as rows under one alignment and capacity.

    ``pad_to_capacity`` makes every row, placeholders included, at least ``bin_capacity`` tokens
    long (exactly that, unless an ``own_bin`` example is longer).
    """

    def __init__(self, alignment: Alignment, bin_capacity: int, *,
                 pad_to_capacity: bool = False) -> None:
        self.bin_multiple = alignment.bin_multiple
        self.minimum = bin_capacity if pad_to_capacity else 0
        self.placeholder = RowLayout((1,), (max(alignment.footprint([1]), self.minimum),))

    def row(self, kept: Sequence[int], padded: Sequence[int]) -> RowLayout:
        """One bin's row from its sequences' kept and TP/CP-padded lengths; () is a placeholder."""
        if not kept:
            return self.placeholder
        total = sum(padded)
        multiple = self.bin_multiple
        length = max(-(-total // multiple) * multiple, self.minimum)  # ceil to the multiple
        return RowLayout(tuple(kept), (*padded[:-1], padded[-1] + length - total))

    def rows(self, bins: Sequence[Sequence[int]], kept: Sequence[int],
             padded: Sequence[int]) -> tuple[RowLayout, ...]:
        """Every bin's row; a bin lists positions into ``kept`` and ``padded`` (Python ints)."""
        return tuple(self.row([kept[p] for p in b], [padded[p] for p in b]) for b in bins)


__all__ = ["RowPlanner"]
