"""Megatron-LM's own online SFT packing (``--sequence-packing-scheduler dp_balanced``) as a
reference planner, written from its described behaviour; pure numpy, no torch.

Per step it takes exactly the global batch of B samples, in arrival order, and:

1. packs them next-fit in arrival order: a sample goes into the open bin if it fits there,
   else it opens a new bin (a closed bin is never revisited);
2. while the bin count does not divide by dp, splits a single sample off the last bins: the
   last sample of the last bin holding two or more moves into a new bin of its own, placed
   right after the bin it left (so the bins stay in arrival order). Where every bin holds one
   sample and the count still does not divide (fewer samples than a multiple of dp allows),
   empty placeholder bins make up the rest;
3. gives bin k to rank k mod dp: equal counts per rank, not equal cost.

The batch size never varies and nothing is carried between steps, so the stream's steps are
its consecutive runs of B samples (the epoch's last step takes what is left).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Bins = list[list[int]]


def next_fit(sizes: Sequence[int] | np.ndarray, capacity: int) -> Bins:
    """Positions into ``sizes`` packed next-fit in order into bins of ``capacity`` (a size
    above the capacity gets a bin of its own)."""
    bins: Bins = []
    load = capacity + 1  # no open bin yet
    for position, size in enumerate(np.asarray(sizes, dtype=np.int64).tolist()):
        if bins and load + size <= capacity:
            bins[-1].append(position)
            load += size
        else:
            bins.append([position])
            load = size
    return bins


def split_to_multiple(bins: Bins, dp: int) -> tuple[Bins, int, int]:
    """``bins`` split until their count divides by ``dp`` (module docstring, rule 2): the bins,
    the samples split off, and the empty placeholder bins added."""
    out = [list(b) for b in bins]
    split = 0
    last = len(out) - 1  # no bin after the last multi-sample one holds two samples
    while len(out) % dp:
        while last >= 0 and len(out[last]) < 2:
            last -= 1
        if last < 0:
            placeholders = -len(out) % dp
            return out + [[] for _ in range(placeholders)], split, placeholders
        out.insert(last + 1, [out[last].pop()])
        split += 1
    if not out:  # no sample at all: one placeholder per rank
        return [[] for _ in range(dp)], 0, dp
    return out, split, 0


def round_robin_ranks(bins: int, dp: int) -> list[list[int]]:
    """Bin k to rank k mod dp."""
    return [list(range(rank, bins, dp)) for rank in range(dp)]


@dataclass(frozen=True)
class DpBalancedStep:
    """One step: its bins (positions into the step's samples), each rank's bin ids, the bins
    next-fit made, the samples split off, and the placeholder bins."""

    bins: Bins
    rank_bins: list[list[int]]
    packed_bins: int
    split: int
    placeholders: int

    @property
    def extra_bins(self) -> int:
        """Bins beyond next-fit's count: those the split and the placeholders added."""
        return len(self.bins) - self.packed_bins


def plan_step(sizes: Sequence[int] | np.ndarray, capacity: int, dp: int) -> DpBalancedStep:
    """One step of ``dp_balanced`` over a step's samples (their sizes, in arrival order)."""
    if dp < 1 or capacity < 1:
        raise ValueError(f"dp ({dp}) and capacity ({capacity}) must be >= 1")
    packed = next_fit(sizes, capacity)
    bins, split, placeholders = split_to_multiple(packed, dp)
    return DpBalancedStep(bins, round_robin_ranks(len(bins), dp), len(packed), split, placeholders)


def plan_stream(sizes: Sequence[int] | np.ndarray, batch_size: int, capacity: int, dp: int,
                steps: int) -> list[tuple[int, DpBalancedStep]]:
    """``steps`` steps over a stream: (the step's first position, its plan) each, every step
    B consecutive samples (the last one fewer if the stream runs out)."""
    array = np.asarray(sizes, dtype=np.int64)
    out = []
    for step in range(steps):
        start = step * batch_size
        if start >= len(array):
            break
        out.append((start, plan_step(array[start:start + batch_size], capacity, dp)))
    return out
