"""Steps where no size can change any step's bins: there a step evens its tokens instead.

A step costs its packed bins rounded up to a multiple of dp. No size of its window packs into
fewer bins than the bound of its smallest size (the bound never falls as a prefix grows), so
that bound, rounded up, is the step's floor (`floor_bins`). A step that can align normally does
(`search`): the aligning size puts more examples into bins the step pays for anyway, which saves
bins wherever a later step can then fall to a lower multiple of dp. Where no step ahead can
(`no_step_can_drop`: each one's smallest size, less a margin for the stream beyond the read-ahead,
rounds up to the same multiple of dp as its nominal size), that saving is worth nothing and
alignment only swings the tokens: an aligned step carries a whole multiple of dp bins and the
steps that repay its drift carry fewer. The sizer then takes the size whose tokens are nearest
B x the read-ahead's mean length, when that size packs into the floor.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_packing.packing.dp_rounding import first_multiple, first_multiples
from megatron_packing.packing.planner.bounds import SegmentBound


def floor_bins(bounds: np.ndarray, lowest: int, dp: int) -> int:
    """The fewest bins, rounded up to dp, that any size from ``lowest`` up can cost
    (``bounds``: the bound of each prefix, which never decreases)."""
    return first_multiple(int(bounds[lowest]), dp)


def no_step_can_drop(bound: SegmentBound, start: int, batch: int, v: int, steps: int,
                     available: int, dp: int, relative_margin: float) -> bool:
    """Can none of the next ``steps`` steps, at nominal boundaries ``start + j x B``, fall to a
    lower multiple of dp by taking B - v examples instead of B (by the bound)?

    Each smallest size's bound is first lowered by ``relative_margin`` x the steps' mean
    nominal bound, rounded up: the steps beyond the read-ahead differ from these by about the
    stream's spread, and the drift an uneven step builds is repaid there. Steps past the
    read-ahead (``available`` examples) are not judged; with none to judge (no lookahead), one
    might drop (False).
    """
    if steps <= 0 or v <= 0:
        return False
    starts = start + batch * np.arange(steps, dtype=np.int64)
    starts = starts[starts + batch <= available]
    if starts.size == 0:
        return False
    nominal = bound(starts, starts + batch)
    margin = math.ceil(relative_margin * float(nominal.mean()))
    smallest = np.maximum(bound(starts, starts + (batch - v)) - margin, 1)
    return bool(np.array_equal(first_multiples(smallest, dp), first_multiples(nominal, dp)))
