"""A step's bins handed to data-parallel ranks: whole bins, then examples moved between them.

One function for the sampler and for the benchmarks' reference plans, so both are timed on the
same footing. With ``rebalanced``:
1. whole bins by Karmarkar-Karp (`balance.assign_bins_to_ranks`), then examples moved
   (`rebalance.rebalance_examples`) with the tunables' fill rounds, evens and partners;
2. where the slowest rank is still more than ``rebalance_retry_above`` x the mean rank above
   the best any hand-out of these bins could reach (`rank_bound.slowest_rank_bound`), once
   more: the moved bins handed out afresh by Karmarkar-Karp (moving examples made the bins'
   costs more even, so whole bins now pair better), then the evening transfers again with the
   ``rebalance_retry_partners`` lightest ranks as partners (no fill: the first pass has
   filled). The second result is kept only where its slowest rank is faster.

The retry costs a second pass only on the steps the first leaves uneven and that could be
evened (a few long sequences in bins with room); the bins, their count per rank and every
bin's budget are kept as in `rebalance_examples`, so the step's alignment and padding are
unchanged.

With a per-micro-batch cost (``microbatch_cost``, `balance.bin_costs`) every bin, a placeholder
too, costs it: every rank holds as many bins, so it shifts every rank's cost alike, and it
enters only the retry's test, where the ranks' spread is weighed against the mean rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_packing.packing.balance import (
    DEFAULT_ATTENTION_COST_CONSTANT,
    RankAssignment,
    assign_bins_to_ranks,
    bin_costs,
    sequence_cost,
)
from megatron_packing.packing.rank_bound import slowest_rank_bound
from megatron_packing.packing.rebalance import rebalance_examples
from megatron_packing.packing.tunables import PlannerTunables


def hand_out(bins: Sequence[Sequence[int]], lengths: Sequence[int] | np.ndarray,
             sizes: Sequence[int] | np.ndarray, dp_size: int, capacity: int, method: str,
             tunables: PlannerTunables,
             attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
             microbatch_cost: float = 0.0,
             ) -> tuple[list[list[int]], list[list[int]]]:
    """(bins, each rank's bin ids) for one step.

    ``bins`` hold positions into ``lengths`` (the examples as trained: their modeled cost) and
    ``sizes`` (the packer's aligned sizes, budgeted per bin by ``capacity``). ``method`` is a
    `balance.RankAssignment`; only ``rebalanced`` moves examples.
    """
    whole = [list(b) for b in bins]
    ranks = assign_bins_to_ranks(bin_costs(whole, lengths, attention_constant, microbatch_cost),
                                 dp_size, method=method)
    if method != RankAssignment.REBALANCED:
        return whole, ranks
    per_example = sequence_cost(lengths, attention_constant)

    def rebalanced(start: list[list[int]], owners: list[list[int]], *, fill_rounds: int,
                   partners: int) -> tuple[list[list[int]], list[float]]:
        return rebalance_examples(start, sizes, per_example, owners, capacity,
                                  fill_rounds=fill_rounds,
                                  evens_per_rank=tunables.rebalance_evens_per_rank,
                                  partners=partners,
                                  microbatch_cost=microbatch_cost)

    out, rank_costs = rebalanced(whole, ranks, fill_rounds=tunables.rebalance_fill_rounds,
                                 partners=tunables.rebalance_partners)
    retry = tunables.rebalance_retry_above
    if retry is None or dp_size < 2 or not out:
        return out, ranks
    slowest, mean = max(rank_costs), sum(rank_costs) / len(rank_costs)
    if slowest <= mean * (1.0 + retry):
        return out, ranks  # nearly even already: no bound needed
    used = [p for b in out for p in b]
    best = slowest_rank_bound(np.asarray(lengths)[used], np.asarray(sizes)[used],
                              len(out) // dp_size, dp_size, capacity, attention_constant,
                              microbatch_cost=microbatch_cost)
    if slowest <= best + mean * retry:
        return out, ranks  # as close to the bound as asked: the bins, not the hand-out, limit it
    again = assign_bins_to_ranks(bin_costs(out, lengths, attention_constant, microbatch_cost),
                                 dp_size, method=RankAssignment.KARMARKAR_KARP)
    moved, moved_costs = rebalanced(out, again, fill_rounds=0,
                                    partners=min(dp_size, tunables.rebalance_retry_partners))
    if max(moved_costs) < slowest:
        return moved, again
    return out, ranks
