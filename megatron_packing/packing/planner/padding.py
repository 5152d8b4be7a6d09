"""Steps that cannot align: which size to pad, and how to pad it.

Among the sizes packed, `rank_padded` puts first those whose tokens stay within a fixed-B step's
token spread of the anchor, then the least of (squared token distance from the anchor, in
spreads) + ``padding_weight`` per padding bin (a padding bin less puts more of the stream into
bins spent anyway, but not at any cost to the token load), then nearest the target. `pad` makes
the missing bins by splitting the heaviest bins, so every rank still gets real work.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megatron_packing.packing.algorithms import SeqPacker
from megatron_packing.packing.planner.segments import Bins, first_multiple
from megatron_packing.packing.rebin import split_to_count


def rank_padded(packed: dict[int, Bins], dp: int, target: int, token_gap: Callable[[int], float],
                spread: float, padding_weight: float) -> list[int]:
    """The packed sizes, best padded step first (see the module docstring)."""
    ranked = []  # (off the token spread, weighed token distance and padding, distance, k)
    for size, bins in packed.items():
        padding = first_multiple(len(bins), dp) - len(bins)
        gap = token_gap(size)
        weighed = (gap / spread) ** 2 + padding_weight * padding if spread > 0 else float(padding)
        ranked.append((gap > spread, weighed, abs(size - target), size))
    return [entry[-1] for entry in sorted(ranked)]


def fewest_padding_size(bounds: np.ndarray, lowest: int, highest: int, target: int, dp: int) -> int:
    """The size whose bound promises the fewest padding bins (ties: nearest the target)."""
    window = np.arange(lowest, highest + 1)
    estimated = bounds[window]
    est_padding = np.maximum(dp, -(-estimated // dp) * dp) - estimated
    return int(window[np.lexsort((np.abs(window - target), est_padding))[0]])


def pad(packer: SeqPacker, dp: int, lengths: np.ndarray, bins: Bins,
        sizes: np.ndarray | None = None) -> tuple[Bins, int]:
    """Raise the bin count to a multiple of dp (at least dp) with balanced non-empty bins.

    With ``sizes`` (the packer's sizes of ``lengths``; ``bins`` its natural packing) the bins are
    split directly: what ``pack_to_count`` does after packing them again. Returns the bins and
    how many of them are placeholders (no example at all: fewer examples than dp)."""
    count = len(bins)
    target = first_multiple(count, dp)
    if target == count:
        return bins, 0
    items = len(lengths)
    if items >= target:  # more bins than the natural count: balanced splits of the heaviest
        natural = (sizes is not None and not packer.min_bin_count
                   and packer.bin_count_multiple in (None, 1))
        split = (split_to_count(bins, sizes.tolist(), target) if natural and sizes is not None
                 else packer.pack_to_count(lengths, target))
        if split is not None and len(split) == target:
            return split, 0
    # Fewer examples than rows: one example per row, the rest are placeholder rows.
    spread = [[i] for i in range(items)] if items <= target else bins
    placeholders = target - len(spread)
    return spread + [[] for _ in range(placeholders)], placeholders
