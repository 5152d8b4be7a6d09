"""Steps that cannot align: which size to pad.

Among the sizes packed, `rank_padded` puts first those whose tokens stay within a fixed-B step's
token spread of the anchor, then the least of (squared token distance from the anchor, in
spreads) + ``padding_weight`` per padding bin (a padding bin less puts more of the stream into
bins spent anyway, but not at any cost to the token load), then nearest the target. With a
per-micro-batch cost, the distance is weighed with the charge of the size's micro-batches
(`charge.MicrobatchCharge`), so a size that runs fewer micro-batches per token can win. The chosen
size's bins are then rounded up by `dp_rounding.round_to_dp` (the heaviest bins split, so every
rank still gets real work).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megatron_packing.packing.dp_rounding import Bins, first_multiple, first_multiples


def rank_padded(packed: dict[int, Bins], dp: int, target: int, token_gap: Callable[[int], float],
                spread: float, padding_weight: float,
                charge: Callable[[int, int], float] | None = None) -> list[int]:
    """The packed sizes, best padded step first (see the module docstring); ``charge`` prices
    a size's micro-batches (size, bins), None when they cost nothing."""
    ranked = []  # (off the token spread, weighed token distance and padding, distance, k)
    for size, bins in packed.items():
        padding = first_multiple(len(bins), dp) - len(bins)
        gap = token_gap(size)
        priced = gap if charge is None else gap + charge(size, len(bins))
        weighed = (priced / spread) ** 2 + padding_weight * padding if spread > 0 else float(padding)
        ranked.append((gap > spread, weighed, abs(size - target), size))
    return [entry[-1] for entry in sorted(ranked)]


def fewest_padding_size(bounds: np.ndarray, lowest: int, highest: int, target: int, dp: int) -> int:
    """The size whose bound promises the fewest padding bins (ties: nearest the target)."""
    window = np.arange(lowest, highest + 1)
    estimated = bounds[window]
    est_padding = first_multiples(estimated, dp) - estimated
    return int(window[np.lexsort((np.abs(window - target), est_padding))[0]])
