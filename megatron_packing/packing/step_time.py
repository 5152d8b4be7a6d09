"""Modeled step time: a step lasts as long as its slowest rank.

A rank's time is the sum over its bins of the balance cost ``s + s^2 / k`` of each sequence
(`balance.sequence_cost`: attention makes equal tokens unequal work). Across steps we report
the step-time CV (std / mean of the slowest rank's cost: how much step times jump) and the
imbalance mean(slowest rank) / mean(rank cost), the share of a step the other ranks wait;
beside it, the least imbalance any hand-out of the same bins could reach
(`rank_bound.slowest_rank_bound`), which tells a bin count's cost from a hand-out's.

A bin also costs ``microbatch_cost`` of its own (a placeholder bin that alone; `balance`), and
with ``row_tokens`` (rows padded to the capacity: ``pad_bins_to_capacity``) its linear work is
the whole row, ``max(row_tokens, its tokens)``, not its tokens: the model then charges rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_packing.packing.balance import (
    DEFAULT_ATTENTION_COST_CONSTANT,
    bin_costs,
)
from megatron_packing.packing.hand_out import hand_out
from megatron_packing.packing.rank_bound import slowest_rank_bound
from megatron_packing.packing.tunables import DEFAULT_TUNABLES, PlannerTunables


def _flatten(bin_lengths: Sequence[Sequence[int]]) -> tuple[np.ndarray, list[list[int]]]:
    """The lengths of all bins in one array, and each bin as positions into it."""
    flat = np.asarray([int(s) for b in bin_lengths for s in b], dtype=np.int64)
    positions, start = [], 0
    for b in bin_lengths:
        positions.append(list(range(start, start + len(b))))
        start += len(b)
    return flat, positions


def modeled_bin_costs(bin_lengths: Sequence[Sequence[int]],
                      attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT, *,
                      microbatch_cost: float = 0.0, row_tokens: int | None = None) -> np.ndarray:
    """Each bin's modeled cost (``bin_lengths``: the sequence lengths in each bin): its
    micro-batch cost, then its tokens or, with ``row_tokens``, its whole row, then attention."""
    flat, positions = _flatten(bin_lengths)
    costs = bin_costs(positions, flat, attention_constant, microbatch_cost)
    if row_tokens is not None and costs.size:
        tokens = np.array([float(sum(b)) for b in bin_lengths])
        costs = costs - tokens + np.maximum(float(row_tokens), tokens)
    return costs


def rank_times(bin_lengths: Sequence[Sequence[int]], rank_bins: Sequence[Sequence[int]],
               attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT, *,
               microbatch_cost: float = 0.0, row_tokens: int | None = None) -> np.ndarray:
    """Each rank's modeled time: its bins' costs summed (``bin_lengths``: the sequence lengths
    in each bin; ``rank_bins``: each rank's bin ids; `modeled_bin_costs`)."""
    costs = modeled_bin_costs(bin_lengths, attention_constant, microbatch_cost=microbatch_cost,
                              row_tokens=row_tokens)
    return np.array([float(costs[list(ids)].sum()) for ids in rank_bins])


def assign_work(bin_lengths: Sequence[Sequence[int]], dp: int, capacity: int, method: str,
                attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
                tunables: PlannerTunables = DEFAULT_TUNABLES, *, microbatch_cost: float = 0.0,
                ) -> tuple[list[list[int]], list[list[int]]]:
    """(bin lengths, rank bins) of a plan without ranks (such as the exhaustive reference's),
    handed out as the sampler would with ``method`` (``rebalanced`` moves examples between bins
    within ``capacity``), so that it is timed on the same footing as the sampler's plans."""
    flat, positions = _flatten(bin_lengths)
    moved, ranks = hand_out(positions, flat, flat, dp, capacity, method, tunables,
                            attention_constant, microbatch_cost)
    return [[int(flat[p]) for p in b] for b in moved], ranks


@dataclass(frozen=True)
class StepTimes:
    """The slowest rank's and the mean rank's modeled time, per step, and where known the
    least the slowest rank could cost with the step's bins (`rank_bound`)."""

    slowest: np.ndarray
    mean_rank: np.ndarray
    bound: np.ndarray | None = None

    @property
    def cv(self) -> float:
        """Step-time CV across steps: std / mean of the slowest rank's time."""
        mean = float(self.slowest.mean()) if self.slowest.size else 0.0
        return float(self.slowest.std() / mean) if mean > 0 else 0.0

    @property
    def total(self) -> float:
        """The run's modeled time: every step's slowest rank, summed."""
        return float(self.slowest.sum())

    @property
    def imbalance(self) -> float:
        """mean(slowest rank) / mean(rank): 1.0 when no rank ever waits."""
        mean = float(self.mean_rank.mean()) if self.mean_rank.size else 0.0
        return float(self.slowest.mean() / mean) if mean > 0 else 1.0

    @property
    def imbalance_bound(self) -> float | None:
        """mean(bound) / mean(rank): the least imbalance a hand-out of these bins could reach
        (None where the bounds were not computed)."""
        if self.bound is None:
            return None
        mean = float(self.mean_rank.mean()) if self.mean_rank.size else 0.0
        return float(self.bound.mean() / mean) if mean > 0 else 1.0


def step_times(steps: Sequence[tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]]],
               attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT, *,
               capacity: int | None = None, microbatch_cost: float = 0.0,
               row_tokens: int | None = None) -> StepTimes:
    """`StepTimes` of a run: ``steps`` holds (bin lengths, rank bins) per step. With
    ``capacity``, also each step's bound (the lengths taken as their own footprints).
    ``microbatch_cost`` and ``row_tokens``: `modeled_bin_costs`."""
    slowest, mean, bound = [], [], []
    for bin_lengths, rank_bins in steps:
        times = rank_times(bin_lengths, rank_bins, attention_constant,
                           microbatch_cost=microbatch_cost, row_tokens=row_tokens)
        slowest.append(float(times.max()))
        mean.append(float(times.mean()))
        if capacity is not None:
            flat = [int(x) for b in bin_lengths for x in b]
            bound.append(slowest_rank_bound(flat, flat, len(bin_lengths) // len(rank_bins),
                                            len(rank_bins), capacity, attention_constant,
                                            microbatch_cost=microbatch_cost,
                                            row_tokens=row_tokens))
    return StepTimes(np.asarray(slowest), np.asarray(mean),
                     None if capacity is None else np.asarray(bound))
