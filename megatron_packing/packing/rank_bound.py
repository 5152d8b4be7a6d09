"""How fast a step's slowest rank can be at best, given its examples and its bin count.

A step hands ``n`` bins of capacity ``C`` to each of ``dp`` ranks, and a rank's time is the
sum of its examples' costs ``s + s^2 / k`` (`balance.sequence_cost`). Whatever bins the
examples sit in and whichever ranks get them, the slowest rank costs at least:

- the mean rank cost (the total over ``dp``), and the costliest single example;
- for each ``q``: the ranks holding the ``q`` longest examples, ``m <= q`` of them, hold those
  examples (``S_q`` tokens, attention ``A_q``) and every token the other ``dp - m`` ranks
  cannot hold: at least ``need_m = T - (dp - m) n C`` of the step's ``T`` tokens. The tokens
  beyond the ``q`` longest come at the least attention when they are the shortest examples
  (attention per token ``s / k`` grows with ``s``); ``f(x)``, the attention of the shortest
  examples making up ``x`` tokens (the last one in part), is therefore a floor. One of those
  ranks costs at least ``(max(need_m, S_q) + A_q + f(need_m - S_q)) / m``, and since ``m`` is
  not known, the least of that over ``m = 1..q`` is the bound for ``q``.

The bound is what a bin count costs in balance: nearly full bins leave no rank room to shed
tokens, so the ranks holding the longest sequences pay their attention on top of a full load,
while a step with spare bins can give those ranks fewer tokens. A hand-out near the bound has
little left to gain (`hand_out` retries only above it); a planner whose bound is above
another's is behind it by its bins, not by its hand-out.

Every rank runs ``n`` micro-batches, so a per-micro-batch cost ``m`` (`balance.bin_costs`) adds
``n m`` to every rank, and to the bound. Where every row is padded to a full ``row_tokens``
(``pad_bins_to_capacity``), each bin's linear work is the whole row whatever it holds: a rank
costs ``n (m + row)`` plus its sequences' attention, and the bound is that plus the larger of
the mean rank's attention and the costliest example's (its row as long as the example, if
longer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_packing.packing.balance import DEFAULT_ATTENTION_COST_CONSTANT


def slowest_rank_bound(lengths: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray,
                       bins_per_rank: int, dp_size: int, capacity: int,
                       attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT, *,
                       microbatch_cost: float = 0.0, row_tokens: int | None = None) -> float:
    """The least modeled time the slowest of ``dp_size`` ranks can take (module docstring).

    ``lengths`` are the step's examples as trained (their cost), ``sizes`` their footprints in
    a bin (the packer's aligned sizes, at least the lengths), ``bins_per_rank`` the micro-batches
    each rank runs. An example larger than ``capacity`` (one in a bin of its own) widens every
    bin to its size here, so the bound stays a bound. ``microbatch_cost`` and ``row_tokens``:
    the module docstring's last paragraph.
    """
    ascending = np.sort(np.asarray(lengths, dtype=np.float64))
    fixed = bins_per_rank * float(microbatch_cost)  # every rank runs bins_per_rank micro-batches
    if ascending.size == 0 or dp_size < 1:
        return fixed
    attention = ascending * ascending / float(attention_constant)
    if row_tokens is not None:  # every row's linear work is its full length
        row, most = float(row_tokens), float(ascending[-1])
        rows = bins_per_rank * row
        # The rank holding the longest example (its row may be longer than the rest: an
        # oversize example in a bin of its own), or the mean rank's attention on full rows.
        holder = rows - row + max(row, most) + float(attention[-1])
        return fixed + max(holder, rows + float(attention.sum()) / dp_size)
    tokens = float(ascending.sum())
    bound = max((tokens + float(attention.sum())) / dp_size,
                float(ascending[-1] + attention[-1]))
    footprint = float(np.max(np.asarray(sizes, dtype=np.float64)))
    rank_room = bins_per_rank * max(float(capacity), footprint)
    top = min(dp_size, ascending.size)
    longest = np.cumsum(ascending[::-1][:top])  # S_q, q = 1..top
    heaviest = np.cumsum(attention[::-1][:top])  # A_q
    # The shortest examples' tokens and attention, running: f by interpolation.
    short_tokens = np.concatenate(([0.0], np.cumsum(ascending)))
    short_attention = np.concatenate(([0.0], np.cumsum(attention)))
    m = np.arange(1, top + 1, dtype=np.float64)
    need = tokens - (dp_size - m) * rank_room  # by m
    held = np.maximum(need[None, :], longest[:, None])  # [q, m]
    # The tokens beyond the q longest, drawn from the other examples (the shortest first):
    # need <= T, so they never exceed what the other examples hold.
    extra = np.maximum(need[None, :] - longest[:, None], 0.0)
    floor = np.interp(extra, short_tokens, short_attention)
    value = (held + heaviest[:, None] + floor) / m[None, :]
    value[m[None, :] > np.arange(1, top + 1)[:, None]] = np.inf  # m <= q
    return max(bound, float(value.min(axis=1).max())) + fixed
