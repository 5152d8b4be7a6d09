"""How fast a step's slowest rank can be at best, given its examples and its bin count.

A step hands ``n`` bins of capacity ``C`` to each of ``dp`` ranks, and a rank's time is the
sum of its examples' costs ``s + s^2 / k`` (`balance.sequence_cost`). Whatever bins the
examples sit in and whichever ranks get them, the slowest rank costs at least:

- the mean rank cost (the total over ``dp``), and the costliest single example;
- for each ``q``: the ranks holding the ``q`` longest examples (``m <= q`` of them) hold their
  attention ``A_q`` (the ``q`` largest ``s^2 / k``) and every token the other ``dp - m`` ranks
  cannot hold, at least ``T - (dp - m) n C`` of the step's ``T`` tokens. So one of them costs
  at least ``n C + (T - dp n C + A_q) / m``, which is at least ``n C + (T - dp n C + A_q) / q``
  when the bracket is positive. (When it is negative, that is below the mean rank cost, which
  is ``n C + (T - dp n C + A) / dp`` with ``A >= A_q``.)

The bound is what a bin count costs in balance: nearly full bins leave no rank room to shed
tokens, so the ranks holding the longest sequences pay their attention on top of a full load,
while a step with spare bins can give those ranks fewer tokens. A hand-out within a small
factor of the bound has little left to gain (`hand_out` retries only above it); a planner whose
bound is above another's is behind it by its bins, not by its hand-out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_packing.packing.balance import DEFAULT_ATTENTION_COST_CONSTANT


def slowest_rank_bound(lengths: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray,
                       bins_per_rank: int, dp_size: int, capacity: int,
                       attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT) -> float:
    """The least modeled time the slowest of ``dp_size`` ranks can take (module docstring).

    ``lengths`` are the step's examples as trained (their cost), ``sizes`` their footprints in
    a bin (the packer's aligned sizes, at least the lengths), ``bins_per_rank`` the micro-batches
    each rank runs. An example larger than ``capacity`` (one in a bin of its own) widens every
    bin to its size here, so the bound stays a bound.
    """
    s = np.asarray(lengths, dtype=np.float64)
    if s.size == 0 or dp_size < 1:
        return 0.0
    footprint = np.asarray(sizes, dtype=np.float64)
    attention = s * s / float(attention_constant)
    total = float(s.sum()) + float(attention.sum())
    bound = max(total / dp_size, float((s + attention).max()))
    rank_room = bins_per_rank * max(float(capacity), float(footprint.max()))
    # Tokens beyond what every rank can hold (<= 0 unless bins are nearly full).
    excess = float(s.sum()) - dp_size * rank_room
    q = np.arange(1, min(dp_size, s.size) + 1, dtype=np.float64)
    top = np.cumsum(np.sort(attention)[::-1][: q.size])  # A_q
    return max(bound, rank_room + float(((excess + top) / q).max()))
