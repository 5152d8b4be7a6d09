"""When alignment cannot succeed: a step packs into fewer bins than dp, so no size aligns.

`alignment_remedy` says what would make it possible on the examples read ahead: the smallest
batch-size variation at which the window's largest step has at least dp bins by the lower
bound, or the largest bin capacity at which a step of B examples (clipped to it) does. The bound
is below every packer's count, so either change guarantees a step of dp bins or more; the bound
only grows with the examples and as the capacity shrinks, so both are found by search. (Where
the packer lands above the bound, a smaller change may already do.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_packing.packing.planner.bounds import SegmentBound


@dataclass(frozen=True)
class AlignmentRemedy:
    """The least change that lets a step reach dp bins; None where no variation below 1 can."""

    variation: float | None  # smallest packing_batch_size_allowed_variation
    capacity: int  # largest bin capacity at which B examples need dp bins; 0: none can

    def describe(self) -> str:
        parts = []
        if self.variation is not None:
            parts.append(f"packing_batch_size_allowed_variation >= {self.variation:g}")
        if self.capacity:
            parts.append(f"bin_capacity <= {self.capacity}")
        if not parts:
            return "no variation or capacity makes it possible: fewer examples than ranks"
        return "a step reaches dp bins with " + " or ".join(parts)


def alignment_remedy(aligned: np.ndarray, capacity: int, batch_size: int, dp: int) -> AlignmentRemedy:
    """``aligned``: the packer-aligned sizes of the examples read ahead, in stream order."""
    bound = SegmentBound(aligned, capacity)
    prefixes = bound.prefixes(len(aligned))
    reaching = np.flatnonzero(prefixes >= dp)
    variation = None
    if reaching.size:
        size = int(reaching[0])  # the fewest examples whose bound reaches dp bins
        extra = max(0, size - batch_size)
        # floor(B x variation) >= extra; rounded up to two decimals, then checked.
        candidate = math.ceil(extra / batch_size * 100) / 100
        while math.floor(batch_size * candidate) < extra:
            candidate += 0.01
        if candidate < 1:
            variation = round(candidate, 2)
    step = aligned[:batch_size]

    def reaches(limit: int) -> bool:
        clipped = SegmentBound(np.minimum(step, limit), limit)
        return int(clipped.prefixes(len(step))[-1]) >= dp

    low, high = 1, capacity  # the largest capacity in [1, capacity] that reaches dp bins
    if not reaches(low):
        return AlignmentRemedy(variation, 0)  # fewer examples than ranks: no capacity can
    while low < high:
        middle = (low + high + 1) // 2
        if reaches(middle):
            low = middle
        else:
            high = middle - 1
    return AlignmentRemedy(variation, low)
