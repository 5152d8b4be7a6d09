"""Moving single examples between ranks' bins so that the slowest rank finishes sooner.

`balance.assign_bins_to_ranks` moves whole bins. With a few bins per rank, or a few heavy
bins (one long sequence costs more than many short ones of the same tokens), whole bins cannot
balance the ranks. This pass then pairs the ranks, the heaviest with the lightest, the second
heaviest with the second lightest and so on, and evens each pair: first it moves the heavier
rank's examples, largest first, into the lighter rank's bins while each move keeps the pair's
transfer at or below half their gap; then it makes the one move or swap that brings the two
closest to even, up to ``transfers_per_pair`` times. A round does that for every pair;
rounds repeat until one changes nothing or ``rounds`` are done.

What it keeps: every bin's size budget (``capacity``, over the packer's aligned sizes), the
bin count and each rank's bin ids (so the micro-batch count per rank and the step's alignment
are unchanged), the multiset of examples, and non-empty bins non-empty (placeholder bins stay
empty, so the padding accounting holds). Bins over the budget (an oversize example in a bin of
its own) are left alone. A transfer lowers the larger cost of its pair and touches no other
rank, so the slowest rank's cost never rises. Deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# A swap is looked for among this many examples of the lighter rank nearest in cost to the
# ideal partner of each example of the heavier one (sorted search, not every pair).
SWAP_NEIGHBOURS = 4


@dataclass
class _Step:
    """The step's mutable state: bins, their loads and costs, and each rank's cost."""

    bins: list[list[int]]
    size: np.ndarray
    cost: np.ndarray
    load: np.ndarray
    count: np.ndarray  # examples per bin
    movable: np.ndarray
    rank_bins: list[list[int]]
    rank_cost: np.ndarray
    capacity: int

    def items(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """The examples in a rank's movable bins, and the bin of each."""
        ids = [b for b in self.rank_bins[rank] if self.movable[b]]
        items = [i for b in ids for i in self.bins[b]]
        owner = [b for b in ids for _ in self.bins[b]]
        return np.asarray(items, dtype=np.int64), np.asarray(owner, dtype=np.int64)

    def shift(self, item: int, source: int, target: int) -> None:
        self.bins[source].remove(item)
        self.bins[target].append(item)
        self.load[source] -= self.size[item]
        self.load[target] += self.size[item]
        self.count[source] -= 1
        self.count[target] += 1


def rebalance_examples(
    bins: Sequence[Sequence[int]],
    sizes: Sequence[int] | np.ndarray,
    costs: Sequence[float] | np.ndarray,
    ranks: Sequence[Sequence[int]],
    capacity: int,
    *,
    rounds: int,
    transfers_per_pair: int,
) -> list[list[int]]:
    """``bins`` (positions into ``sizes`` and ``costs``) with examples moved between ranks.

    ``ranks`` gives each rank's bin ids (they stay each rank's); ``sizes`` are the packer's
    aligned sizes, budgeted per bin by ``capacity``; ``costs`` the modeled cost of each
    example. At most ``rounds`` rounds of at most ``transfers_per_pair`` transfers per pair of
    ranks. A moved example goes to the end of its new bin; the rest keep their order.
    """
    out = [list(b) for b in bins]
    size = np.asarray(sizes, dtype=np.int64)
    cost = np.asarray(costs, dtype=np.float64)
    if len(ranks) < 2 or rounds <= 0 or not out:
        return out
    count = np.array([len(b) for b in out], dtype=np.int64)
    flat = np.fromiter((i for b in out for i in b), dtype=np.int64, count=int(count.sum()))
    home = np.repeat(np.arange(len(out)), count)
    load = np.bincount(home, weights=size[flat], minlength=len(out)).astype(np.int64)
    bin_cost = np.bincount(home, weights=cost[flat], minlength=len(out))
    step = _Step(
        bins=out, size=size, cost=cost, load=load, count=count,
        movable=(count > 0) & (load <= capacity),
        rank_bins=[[int(b) for b in r] for r in ranks],
        rank_cost=np.array([float(bin_cost[list(r)].sum()) for r in ranks]),
        capacity=capacity,
    )
    for _ in range(rounds):
        order = np.argsort(-step.rank_cost, kind="stable")
        changed = False
        for k in range(len(order) // 2):
            heavy, light = int(order[k]), int(order[-1 - k])
            changed |= _fill(step, heavy, light)
            for _ in range(transfers_per_pair):
                if not _transfer(step, heavy, light):
                    break
                changed = True
        if not changed:
            break
    return out


def _fill(step: _Step, heavy: int, light: int) -> bool:
    """Move ``heavy``'s examples, costliest first, into the best-fitting bins of ``light``
    while the cost moved stays within half the pair's gap (each move brings the pair closer
    to even); a bin keeps at least one example. False if nothing moved."""
    remaining = float(step.rank_cost[heavy] - step.rank_cost[light]) / 2
    targets = [b for b in step.rank_bins[light] if step.movable[b]]
    if remaining <= 0 or not targets:
        return False
    items, owner = step.items(heavy)
    if items.size == 0:
        return False
    room = [step.capacity - int(step.load[b]) for b in targets]
    c_h = step.cost[items]
    # Only examples that fit the roomiest bin and stay within the gap can go (checked anew
    # below, as rooms shrink): few, when bins are full.
    may = np.flatnonzero((c_h <= remaining) & (step.size[items] <= max(room))
                         & (step.count[owner] > 1))
    moved = 0.0
    for p in may[np.argsort(-c_h[may], kind="stable")].tolist():
        item, source, c = int(items[p]), int(owner[p]), float(c_h[p])
        if c > remaining - moved or step.count[source] < 2:
            continue
        s = int(step.size[item])
        fits = [(r - s, t) for t, r in enumerate(room) if r >= s]
        if not fits:
            continue
        _, t = min(fits)
        step.shift(item, source, targets[t])
        room[t] -= s
        moved += c
    step.rank_cost[heavy] -= moved
    step.rank_cost[light] += moved
    return moved > 0


def _transfer(step: _Step, heavy: int, light: int) -> bool:
    """Make the move or swap that brings ``heavy`` and ``light`` closest to even; False if
    none lowers the heavier cost."""
    gap = float(step.rank_cost[heavy] - step.rank_cost[light])
    if gap <= 0:
        return False
    items, owner = step.items(heavy)
    if items.size == 0:
        return False
    c_h, s_h = step.cost[items], step.size[items]
    # A transfer of cost d (0 < d < gap) leaves the pair's larger cost at top - min(d, gap - d).
    best_gain = 0.0
    best: tuple[int, int, int, int | None] | None = None

    targets = np.asarray([b for b in step.rank_bins[light] if step.movable[b]], dtype=np.int64)
    if targets.size:
        room = step.capacity - step.load[targets]
        ok = (step.count[owner] > 1) & (s_h <= room.max()) & (c_h < gap)
        if ok.any():
            gain = np.where(ok, np.minimum(c_h, gap - c_h), 0.0)
            i = int(np.argmax(gain))
            if gain[i] > best_gain:
                slack = np.where(s_h[i] <= room, room - s_h[i], np.iinfo(np.int64).max)
                best_gain = float(gain[i])
                best = (int(items[i]), int(owner[i]), int(targets[int(np.argmin(slack))]), None)

    others, other_owner = step.items(light)
    if others.size:
        by_cost = np.argsort(step.cost[others], kind="stable")
        others, other_owner = others[by_cost], other_owner[by_cost]
        c_l, s_l = step.cost[others], step.size[others]
        # For each example of the heavy rank, the light rank's examples nearest the ideal
        # partner cost c - gap / 2.
        at = np.searchsorted(c_l, c_h - gap / 2)
        near = np.clip(at[:, None] + np.arange(-SWAP_NEIGHBOURS // 2, SWAP_NEIGHBOURS // 2),
                       0, others.size - 1)
        delta = c_h[:, None] - c_l[near]
        grow = s_h[:, None] - s_l[near]  # tokens the light rank's bin gains
        ok = ((delta > 0) & (delta < gap)
              & (grow <= (step.capacity - step.load[other_owner[near]]))
              & (-grow <= (step.capacity - step.load[owner])[:, None]))
        if ok.any():
            gain = np.where(ok, np.minimum(delta, gap - delta), 0.0)
            flat = int(np.argmax(gain))
            i, j = divmod(flat, gain.shape[1])
            if gain[i, j] > best_gain:
                other = int(near[i, j])
                best = (int(items[i]), int(owner[i]), int(other_owner[other]), int(others[other]))

    if best is None:
        return False
    item, source, target, swapped = best
    step.shift(item, source, target)
    moved = step.cost[item]
    if swapped is not None:
        step.shift(swapped, target, source)
        moved -= step.cost[swapped]
    step.rank_cost[heavy] -= moved
    step.rank_cost[light] += moved
    return True
