"""Moving single examples between ranks' bins so that the slowest rank finishes sooner.

`balance.assign_bins_to_ranks` moves whole bins. With a few bins per rank, or a few heavy
bins (one long sequence costs more than many short ones of the same tokens), whole bins cannot
balance the ranks. This pass then changes which bin an example sits in, in two phases:
1. fill, in rounds: each rank above the mean cost, heaviest first, moves its examples,
   costliest first, into the best-fitting bins of the rank that is lightest at that moment,
   while the cost moved keeps both ranks on their side of the mean; rounds repeat until one
   moves nothing or ``fill_rounds`` are done;
2. even: the slowest rank makes the one transfer that brings it closest to even with one of
   the lightest ranks, up to ``evens_per_rank`` x dp times, until the slowest rank finds none.
   A transfer is a move of one example or a swap of two; where neither lowers the slowest
   rank, an exchange: one example into a bin of the lighter rank that is too full for it, that
   bin's smallest examples back in its place, just enough of them to make room. Equal tokens
   are unequal work, so an exchange evens two ranks whose bins are full, where no move fits
   and a swap of one example for one changes too little or too much.

What it keeps: every bin's size budget (``capacity``, over the packer's aligned sizes), the
bin count and each rank's bin ids (so the micro-batch count per rank and the step's alignment
are unchanged), the multiset of examples, and non-empty bins non-empty (placeholder bins stay
empty, so the padding accounting holds). Bins over the budget (an oversize example in a bin of
its own) are left alone. A transfer lowers the larger cost of its pair and touches no other
rank, so the slowest rank's cost never rises. Deterministic.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np

# How many examples on each side of the ideal cost a move or a swap partner is sought among.
NEIGHBOURS = 2
# Up to this many moves at once keep the ranks' sorted examples by insertion; more re-sort them.
INCREMENTAL_MOVES = 4
# The slowest rank is evened with the first of this many lightest ranks that can take a transfer.
PARTNERS = 3


class _Arrays:
    """A rank's movable examples as arrays, by cost ascending (for the swap search)."""

    def __init__(self, step: _Step, rank: int) -> None:
        costs, items, owners = step.items(rank)
        self.cost = np.asarray(costs, dtype=np.float64)
        self.item = np.asarray(items, dtype=np.int64)
        self.owner = np.asarray(owners, dtype=np.int64)
        self.size = step.size_array[self.item]


class _Room:
    """A rank's movable bins for exchanges: each bin's examples smallest first, and the
    tokens and cost of every prefix, laid end to end. Bin j's prefix tokens are offset by
    j x ``span`` (more than any bin holds), so one sorted search answers every bin at once."""

    def __init__(self, step: _Step, rank: int) -> None:
        self.bins = step.targets(rank)
        self.span = 2 * step.capacity + 2
        count = len(self.bins)
        movable = step.arrays(rank)  # the same examples, by cost
        ids = np.asarray(self.bins, dtype=np.int64)
        by_id = np.argsort(ids)
        where = by_id[np.searchsorted(ids[by_id], movable.owner)]  # each example's bin, 0..count-1
        order = np.lexsort((movable.item, movable.size, where))  # by bin, then size, then example
        items, where, sizes = movable.item[order], where[order], movable.size[order]
        held = np.bincount(where, minlength=count)
        # Each bin's run of prefixes starts with its own zero: bin j's run begins at
        # (examples of the bins before it) + j and ends ``held[j]`` places later.
        self.start = np.concatenate(([0], np.cumsum(held[:-1] + 1))).astype(np.int64)
        first = np.concatenate(([0], np.cumsum(held)[:-1]))  # bin j's first example, sorted
        slots = self.start[where] + 1 + (np.arange(items.size) - first[where])
        within = np.cumsum(sizes) - np.concatenate(([0], np.cumsum(sizes)))[first[where]]
        cost = movable.cost[order]
        cost_within = np.cumsum(cost) - np.concatenate(([0.0], np.cumsum(cost)))[first[where]]
        self.offset = np.arange(count, dtype=np.int64) * self.span
        self.tokens = np.repeat(self.offset, held + 1)
        self.tokens[slots] += within
        self.cost = np.zeros(items.size + count)
        self.cost[slots] = cost_within
        self.items = items
        self.first = first
        self.free = step.capacity - np.asarray([step.load[b] for b in self.bins], dtype=np.int64)

    def given_back(self, j: int, n: int) -> list[int]:
        """The ``n`` smallest examples of bin j (of this rank's movable bins)."""
        return [int(i) for i in self.items[self.first[j]:self.first[j] + n]]


class _Step:
    """The step's mutable state: bins, their loads and counts, and each rank's cost."""

    def __init__(self, bins: list[list[int]], size: list[int], cost: list[float],
                 ranks: Sequence[Sequence[int]], capacity: int) -> None:
        self.bins, self.size, self.cost, self.capacity = bins, size, cost, capacity
        self.size_array = np.asarray(size, dtype=np.int64)  # size and cost as arrays, for numpy
        self.cost_array = np.asarray(cost, dtype=np.float64)
        self.load = [sum(size[i] for i in b) for b in bins]
        self.count = [len(b) for b in bins]
        self.movable = [n > 0 and load <= capacity for n, load in zip(self.count, self.load,
                                                                      strict=True)]
        self.rank_bins = [[int(b) for b in r] for r in ranks]
        self.rank_cost = [sum(cost[i] for b in r for i in bins[b]) for r in self.rank_bins]
        self.bin_rank = [0] * len(bins)
        for r, ids in enumerate(self.rank_bins):
            for b in ids:
                self.bin_rank[b] = r
        self._sorted: dict[int, tuple[list[float], list[int], list[int]]] = {}  # when first asked
        self._arrays: dict[int, _Arrays] = {}
        self._room: dict[int, _Room] = {}

    def _sort(self, rank: int) -> tuple[list[float], list[int], list[int]]:
        bins = [b for b in self.rank_bins[rank] if self.movable[b]]
        items = np.fromiter((i for b in bins for i in self.bins[b]), dtype=np.int64)
        owners = np.repeat(np.asarray(bins, dtype=np.int64), [len(self.bins[b]) for b in bins])
        costs = self.cost_array[items]
        order = np.lexsort((items, costs))  # by (cost, example), as bisect on the lists expects
        return costs[order].tolist(), items[order].tolist(), owners[order].tolist()

    def items(self, rank: int) -> tuple[list[float], list[int], list[int]]:
        """A rank's examples in movable bins, by (cost, example) ascending: (costs, examples,
        bins), kept sorted as examples move."""
        if rank not in self._sorted:
            self._sorted[rank] = self._sort(rank)
        return self._sorted[rank]

    def _place(self, rank: int, item: int) -> int:
        """Where ``item`` sits, or would sit, in ``rank``'s sorted examples."""
        costs, items, _ = self._sorted[rank]
        c = self.cost[item]
        p = bisect_left(costs, c)
        while p < len(costs) and costs[p] == c and items[p] < item:
            p += 1
        return p

    def arrays(self, rank: int) -> _Arrays:
        if rank not in self._arrays:
            self._arrays[rank] = _Arrays(self, rank)
        return self._arrays[rank]

    def room(self, rank: int) -> _Room:
        if rank not in self._room:
            self._room[rank] = _Room(self, rank)
        return self._room[rank]

    def targets(self, rank: int) -> list[int]:
        return [b for b in self.rank_bins[rank] if self.movable[b]]

    def apply(self, moves: list[tuple[int, int, int]], heavy: int, light: int) -> None:
        """(example, from bin, to bin) moves between ``heavy`` and ``light``."""
        gone: dict[int, set[int]] = {}
        for item, source, target in moves:
            gone.setdefault(source, set()).add(item)
            self.bins[target].append(item)
            self.load[source] -= self.size[item]
            self.load[target] += self.size[item]
            self.count[source] -= 1
            self.count[target] += 1
            sign = 1.0 if self.bin_rank[source] == heavy else -1.0
            self.rank_cost[heavy] -= sign * self.cost[item]
            self.rank_cost[light] += sign * self.cost[item]
            if len(moves) <= INCREMENTAL_MOVES:
                self._resort(item, self.bin_rank[source], self.bin_rank[target], target)
        for source, items in gone.items():
            self.bins[source] = [i for i in self.bins[source] if i not in items]
        for rank in (heavy, light):
            if len(moves) > INCREMENTAL_MOVES:
                self._sorted.pop(rank, None)  # sorted afresh when next asked
            self._arrays.pop(rank, None)
            self._room.pop(rank, None)

    def _resort(self, item: int, origin: int, dest: int, target: int) -> None:
        """Take ``item`` out of ``origin``'s sorted examples and put it, now in bin ``target``,
        into ``dest``'s (a rank not sorted yet is sorted when first asked)."""
        if origin in self._sorted:
            costs, items, owners = self._sorted[origin]
            p = self._place(origin, item)
            del costs[p], items[p], owners[p]
        if dest in self._sorted:
            costs, items, owners = self._sorted[dest]
            p = self._place(dest, item)
            costs.insert(p, self.cost[item])
            items.insert(p, item)
            owners.insert(p, target)


def rebalance_examples(
    bins: Sequence[Sequence[int]],
    sizes: Sequence[int] | np.ndarray,
    costs: Sequence[float] | np.ndarray,
    ranks: Sequence[Sequence[int]],
    capacity: int,
    *,
    fill_rounds: int,
    evens_per_rank: int,
) -> list[list[int]]:
    """``bins`` (positions into ``sizes`` and ``costs``) with examples moved between ranks.

    ``ranks`` gives each rank's bin ids (they stay each rank's); ``sizes`` are the packer's
    aligned sizes, budgeted per bin by ``capacity``; ``costs`` the modeled cost of each
    example. A moved example goes to the end of its new bin; the rest keep their order.
    """
    out = [[int(i) for i in b] for b in bins]
    if len(ranks) < 2 or not out:
        return out
    step = _Step(out, np.asarray(sizes, dtype=np.int64).tolist(),
                 np.asarray(costs, dtype=np.float64).tolist(), ranks, int(capacity))
    dp = len(step.rank_cost)
    for _ in range(fill_rounds):
        mean = sum(step.rank_cost) / dp
        above = sorted((r for r in range(dp) if step.rank_cost[r] > mean),
                       key=lambda r: -step.rank_cost[r])
        changed = False
        for heavy in above:
            light = min(range(dp), key=step.rank_cost.__getitem__)
            share = min(step.rank_cost[heavy] - mean, mean - step.rank_cost[light])
            changed |= _fill(step, heavy, light, share)
        if not changed:
            break
    for _ in range(evens_per_rank * dp):
        by_cost = sorted(range(dp), key=step.rank_cost.__getitem__)
        heavy = by_cost[-1]
        if not any(_even(step, heavy, light) for light in by_cost[:PARTNERS]):
            break
    return out


def _fill(step: _Step, heavy: int, light: int, share: float) -> bool:
    """Move ``heavy``'s examples, costliest first, into the best-fitting bins of ``light``
    while the cost moved stays within ``share``; a bin keeps at least one example. False if
    nothing moved."""
    targets = step.targets(light)
    if share <= 0 or not targets:
        return False
    room = [step.capacity - step.load[b] for b in targets]
    widest = max(room)
    costs, items, owners = step.items(heavy)
    left = share
    moves: list[tuple[int, int, int]] = []
    count: dict[int, int] = {}
    k = bisect_right(costs, left) - 1
    while k >= 0:
        item, source = items[k], owners[k]
        s = step.size[item]
        n = count.get(source, step.count[source])
        if s > widest or n < 2:
            k -= 1
            continue
        best, slack = -1, widest + 1
        for t, r in enumerate(room):
            if s <= r < s + slack:
                best, slack = t, r - s
        room[best] -= s
        widest = max(room)
        count[source] = n - 1
        left -= costs[k]
        moves.append((item, source, targets[best]))
        k = min(k - 1, bisect_right(costs, left) - 1)  # the costliest that still fits the share
    if not moves:
        return False
    step.apply(moves, heavy, light)
    return True


def _even(step: _Step, heavy: int, light: int) -> bool:
    """Make the move or swap that brings ``heavy`` and ``light`` closest to even; False if
    none lowers the heavier cost."""
    gap = step.rank_cost[heavy] - step.rank_cost[light]
    if gap <= 0:
        return False
    costs, items, owners = step.items(heavy)
    if not items:
        return False
    # A transfer of cost d (0 < d < gap) leaves the pair's larger cost lower by min(d, gap - d).
    best_gain, best = 0.0, None
    targets = step.targets(light)
    if targets:
        room = [step.capacity - step.load[b] for b in targets]
        widest = max(room)
        at = bisect_left(costs, gap / 2)
        for k in range(max(0, at - NEIGHBOURS), min(len(costs), at + NEIGHBOURS)):
            c, item, source = costs[k], items[k], owners[k]
            gain = min(c, gap - c)
            if gain <= best_gain or step.count[source] < 2 or step.size[item] > widest:
                continue
            s = step.size[item]
            fit = min((r - s, t) for t, r in enumerate(room) if r >= s)[1]
            best_gain, best = gain, [(item, source, targets[fit])]
    swap = _best_swap(step, heavy, light, gap, best_gain)
    if swap is not None:
        best = swap
    if best is None:  # no move or swap lowers the pair's larger cost: try an exchange
        best = _best_exchange(step, heavy, light, gap)
    if best is None:
        return False
    step.apply(best, heavy, light)
    return True


def _best_swap(step: _Step, heavy: int, light: int, gap: float, floor: float
               ) -> list[tuple[int, int, int]] | None:
    """The swap of an example of ``heavy`` for one of ``light`` that brings the pair closest to
    even, with a gain above ``floor``; each of ``heavy``'s examples is tried against the
    ``light`` examples nearest in cost to its ideal partner (cost minus half the gap)."""
    h, lt = step.arrays(heavy), step.arrays(light)
    if not h.item.size or not lt.item.size:
        return None
    at = np.searchsorted(lt.cost, h.cost - gap / 2)
    near = np.clip(at[:, None] + np.arange(-NEIGHBOURS, NEIGHBOURS), 0, lt.item.size - 1)
    delta = h.cost[:, None] - lt.cost[near]
    gain = np.minimum(delta, gap - delta)
    grow = h.size[:, None] - lt.size[near]  # tokens the light rank's bin gains
    load = np.asarray(step.load, dtype=np.int64)
    ok = ((gain > floor) & (grow <= step.capacity - load[lt.owner[near]])
          & (-grow <= (step.capacity - load[h.owner])[:, None]))
    if not ok.any():
        return None
    flat = int(np.argmax(np.where(ok, gain, -np.inf)))
    i, j = divmod(flat, near.shape[1])
    other = int(near[i, j])
    item, source = int(h.item[i]), int(h.owner[i])
    partner, target = int(lt.item[other]), int(lt.owner[other])
    return [(item, source, target), (partner, target, source)]


def _best_exchange(step: _Step, heavy: int, light: int, gap: float
                   ) -> list[tuple[int, int, int]] | None:
    """The exchange that brings the pair closest to even, if any lowers its larger cost: an
    example of ``heavy`` goes into a bin of ``light`` without room for it, and that bin's
    smallest examples, the fewest that make room, go back into the example's bin.

    Under the balance cost, which grows faster than size, the smallest examples carry the
    least cost per token: the cheapest room to make. The bin keeps the incoming example and
    the example's bin gets at least one back, so neither is left empty."""
    h, room = step.arrays(heavy), step.room(light)
    if not h.item.size or not room.bins:
        return None
    load = np.asarray(step.load, dtype=np.int64)
    free_h = (step.capacity - load[h.owner])[:, None]  # room in each heavy example's bin
    size = h.size[:, None]
    need = size - room.free[None, :]  # tokens each light bin must give back (rows: examples)
    at = np.searchsorted(room.tokens, need + room.offset[None, :], side="left")
    # No movable example exceeds the capacity, so the need never exceeds the bin's load and
    # the search stays within bin j's run of prefixes.
    ok = need > 0  # no need: a move fits (tried as a move)
    given = room.tokens[at] - room.offset[None, :]  # the fewest smallest examples' tokens
    ok &= given <= free_h + size  # what comes back fits the example's bin
    delta = h.cost[:, None] - room.cost[at]
    gain = np.minimum(delta, gap - delta)
    ok &= gain > gap * 1e-9  # lowers the larger cost by more than rounding
    if not ok.any():
        return None
    i, j = divmod(int(np.argmax(np.where(ok, gain, -np.inf))), len(room.bins))
    item, source, target = int(h.item[i]), int(h.owner[i]), room.bins[j]
    back = int(at[i, j] - room.start[j])
    return [(item, source, target)] + [(m, target, source) for m in room.given_back(j, back)]
