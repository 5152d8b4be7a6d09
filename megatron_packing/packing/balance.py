"""Assigning packed bins to data-parallel ranks: equal counts per rank, balanced cost.

Every rank must run the same number of micro-batches (one bin each), so each rank gets
``len(bins) / dp`` bins. Among such assignments we want the slowest rank as fast as possible.

Cost model: a sequence of ``s`` tokens costs ``s + s**2 / k``. The linear term is the work
that grows with tokens (MLP and projection matmuls, about ``24 h^2`` FLOPs per token per
layer for hidden size ``h``); the quadratic term is attention (about ``4 h s`` FLOPs per
token per layer, i.e. ``4 h s^2`` per sequence). Their ratio makes ``k = 6 h``; the default
``k = 24576`` is ``6 x 4096``. Packed attention is block-diagonal, so a bin costs the sum
over its sequences, not ``(sum of lengths)^2``: equal token counts are not equal work.

A micro-batch also costs something of its own, whatever it holds: kernel launches, a pipeline
slot, the optimizer's per-micro-batch work. ``microbatch_cost`` (the YAML key
``microbatch_cost_tokens``, default 0) charges it in tokens of linear work, so a bin costs
``microbatch_cost + sum(s + s^2/k)`` and a placeholder bin ``microbatch_cost``. Every rank runs
the same number of micro-batches, so it never changes which hand-out is evener; it changes how
uneven a step looks beside its length, and what one more micro-batch costs.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from enum import StrEnum
from itertools import chain

import numpy as np

from megatron_packing.common.validation import require_positive_int

DEFAULT_ATTENTION_COST_CONSTANT = 24576.0

class RankAssignment(StrEnum):
    """How a step's work goes to DP ranks.

    ``rebalanced`` (the sampler's default): whole bins by Karmarkar-Karp, then single examples
    moved from the ranks above the mean cost to the lightest, and moved or swapped to even the
    slowest rank (`rebalance.rebalance_examples`); ``karmarkar_karp``: whole bins, balanced
    cost; ``round_robin``: bin ``i`` to rank ``i % dp``.
    """

    REBALANCED = "rebalanced"
    KARMARKAR_KARP = "karmarkar_karp"
    ROUND_ROBIN = "round_robin"


ASSIGN_METHODS: tuple[str, ...] = tuple(m.value for m in RankAssignment)


def sequence_cost(
    lengths: Sequence[int] | np.ndarray,
    attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
) -> np.ndarray:
    """Estimated compute of each sequence: ``s + s^2 / attention_constant`` (float64)."""
    if attention_constant <= 0:
        raise ValueError(f"attention_constant must be > 0, got {attention_constant!r}")
    s = np.asarray(lengths, dtype=np.float64)
    return s + s * s / float(attention_constant)


def bin_costs(
    bins: list[list[int]],
    lengths: Sequence[int] | np.ndarray,
    attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
    microbatch_cost: float = 0.0,
) -> np.ndarray:
    """Per bin, ``microbatch_cost`` plus the sum of :func:`sequence_cost` over its positions
    (an empty bin costs ``microbatch_cost`` alone)."""
    if microbatch_cost < 0:
        raise ValueError(f"microbatch_cost must be >= 0, got {microbatch_cost!r}")
    per_seq = sequence_cost(lengths, attention_constant)
    if not bins:
        return np.zeros(0, dtype=np.float64)
    ids = np.repeat(np.arange(len(bins)), [len(b) for b in bins])
    flat = np.fromiter(chain.from_iterable(bins), dtype=np.int64, count=len(ids))
    costs = np.bincount(ids, weights=per_seq[flat], minlength=len(bins))
    return costs + float(microbatch_cost) if microbatch_cost else costs


def _round_robin(costs: np.ndarray, dp_size: int) -> list[list[int]]:
    return [list(range(r, len(costs), dp_size)) for r in range(dp_size)]


def _karmarkar_karp(costs: np.ndarray, dp_size: int) -> list[list[int]]:
    """Largest differencing method for ``dp_size`` ways with equal cardinality.

    Sort bins by cost, largest first (ties by id), and cut them into rows of ``dp_size``.
    Each row is a partial solution: ``dp_size`` subsets of one bin each. Repeatedly take the
    two partial solutions with the largest spread (max minus min subset cost) and merge
    them, pairing the heaviest subset of one with the lightest of the other, and so on.
    Merging keeps every subset the same size, so the final subsets hold ``n / dp`` bins.
    """
    n = len(costs)
    order = np.argsort(-costs, kind="stable").tolist()
    values = costs.tolist()
    # Max-heap (negated spread) of partial solutions; the row/counter breaks ties by creation
    # order, so the result does not depend on comparing the subset lists.
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for row, start in enumerate(range(0, n, dp_size)):
        members = order[start : start + dp_size]
        subsets = [(values[i], [i]) for i in members]  # heaviest first
        spread = subsets[0][0] - subsets[-1][0]
        heap.append((-spread, row, subsets))
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        # Differencing: the two most unbalanced partial solutions, merged so that their
        # imbalances cancel (heaviest of one with lightest of the other). The merged spread is
        # at most the larger of the two, so the largest spreads shrink first.
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(ca + cb, ia + ib) for (ca, ia), (cb, ib) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda sub: (-sub[0], min(sub[1])))  # heaviest first again
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [sorted(ids) for _, ids in heap[0][2]]


def assign_bins_to_ranks(
    costs: Sequence[float] | np.ndarray, dp_size: int, method: str = "karmarkar_karp"
) -> list[list[int]]:
    """Bin ids for each of ``dp_size`` ranks, ``len(costs) / dp_size`` per rank.

    ``karmarkar_karp`` (default) balances cost with the equal-cardinality largest
    differencing method; the result is never worse than ``round_robin`` (bin ``i`` to rank
    ``i % dp``): both are computed and the one with the lower maximum rank cost is kept.
    ``rebalanced`` assigns the bins as ``karmarkar_karp`` does (the moving of examples that
    follows is `rebalance.rebalance_examples`, applied by the sampler).
    Deterministic; ids inside each rank ascending; ranks ordered by their smallest bin id.
    """
    ranks = require_positive_int("dp_size", dp_size, error=ValueError)
    assert ranks is not None  # allow_none is off
    dp_size = ranks
    if method not in ASSIGN_METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(ASSIGN_METHODS)}")
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 1:
        raise ValueError(f"costs must be 1-D, got shape {c.shape}")
    if len(c) % dp_size:
        raise ValueError(
            f"{len(c)} bins cannot be split equally over dp_size={dp_size} ranks; "
            f"the bin count must be a multiple of dp_size"
        )
    if np.any(~np.isfinite(c)) or np.any(c < 0):
        raise ValueError("costs must be finite and non-negative")
    rr = _round_robin(c, dp_size)
    if method == "round_robin" or len(c) <= dp_size:
        return rr  # one bin per rank: every assignment has the same cost
    kk = _karmarkar_karp(c, dp_size)
    if _max_rank_cost(c, kk) > _max_rank_cost(c, rr):
        kk = rr
    return sorted(kk, key=lambda ids: ids[0])


def _max_rank_cost(costs: np.ndarray, assignment: list[list[int]]) -> float:
    return max(float(costs[ids].sum()) for ids in assignment)


def imbalance(costs: Sequence[float] | np.ndarray, assignment: list[list[int]]) -> float:
    """Max rank cost over mean rank cost; 1.0 is perfect (and the value when all are zero)."""
    c = np.asarray(costs, dtype=np.float64)
    if not assignment:
        raise ValueError("assignment must list at least one rank")
    totals = np.array([c[np.asarray(ids, dtype=np.int64)].sum() for ids in assignment])
    mean = totals.mean()
    if mean <= 0:
        return 1.0
    return float(totals.max() / mean)
