"""Moving single examples between ranks' bins so that the slowest rank finishes sooner.

`balance.assign_bins_to_ranks` moves whole bins. With a few bins per rank, or a few heavy
bins (one long sequence costs more than many short ones of the same tokens), whole bins cannot
balance the ranks. This pass then changes which bin an example sits in, in two phases:
1. fill, in rounds: each rank above the mean cost, heaviest first, moves its examples,
   costliest first, into the best-fitting bins of the rank that is lightest at that moment,
   while the cost moved keeps both ranks on their side of the mean; rounds repeat until one
   moves nothing or ``fill_rounds`` are done;
2. even: the slowest rank makes the one transfer that brings it closest to even with the
   first of the ``partners`` lightest ranks that can take one, up to ``evens_per_rank`` x dp
   times, until the slowest rank finds none. A transfer is a move of one example or a swap of
   two, among the example nearest the ideal cost on each side; where neither lowers the slowest
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

A rank's cost includes ``microbatch_cost`` per bin it holds (`balance.bin_costs`). Every
transfer keeps each rank's bins, so that part never changes and never decides a transfer (they
compare differences); it is in the rank costs returned, which the caller weighs against the mean.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import chain

import numpy as np

# Up to this many moves at once keep the ranks' sorted examples by insertion; more re-sort them
# (speed only: both give the same order).
INCREMENTAL_MOVES = 4


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    """0 followed by the running sums of ``values`` (one longer than ``values``)."""
    out = np.zeros(values.size + 1, dtype=values.dtype)
    np.cumsum(values, out=out[1:])
    return out


class _Arrays:
    """A rank's movable examples as arrays, by cost ascending (for the swap search), with the
    room left in each one's bin (valid until the rank's bins change, when it is rebuilt)."""

    def __init__(self, cost: np.ndarray, item: np.ndarray, owner: np.ndarray,
                 step: _Step) -> None:
        self.cost, self.item, self.owner = cost, item, owner
        self.size = step.size_array[item]
        self.free = step.capacity - step.load_array[owner]


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
        self.start = _exclusive_cumsum(held[:-1] + 1)
        first = _exclusive_cumsum(held)[:-1]  # bin j's first example, sorted
        begins = first[where]
        slots = self.start[where] + 1 + (np.arange(items.size) - begins)
        within = _exclusive_cumsum(sizes)
        within = within[1:] - within[begins]
        cost_within = _exclusive_cumsum(movable.cost[order])
        cost_within = cost_within[1:] - cost_within[begins]
        self.offset = np.arange(count, dtype=np.int64) * self.span
        self.tokens = np.repeat(self.offset, held + 1)
        self.tokens[slots] += within
        self.cost = np.zeros(items.size + count)
        self.cost[slots] = cost_within
        self.items = items
        self.first = first
        self.free = step.capacity - step.load_array[ids]

    def given_back(self, j: int, n: int) -> list[int]:
        """The ``n`` smallest examples of bin j (of this rank's movable bins)."""
        return [int(i) for i in self.items[self.first[j]:self.first[j] + n]]


class _Step:
    """The step's mutable state: bins, their loads and counts, and each rank's cost."""

    def __init__(self, bins: list[list[int]], size: list[int], cost: list[float],
                 ranks: Sequence[Sequence[int]], capacity: int) -> None:
        self.bins, self.size, self.cost, self.capacity = bins, size, cost, capacity
        self.around = np.arange(-1, 1)  # swap partners: the nearest on each side of the ideal
        self.size_array = np.asarray(size, dtype=np.int64)  # size and cost as arrays, for numpy
        self.cost_array = np.asarray(cost, dtype=np.float64)
        self.count = [len(b) for b in bins]
        self.rank_bins = [[int(b) for b in r] for r in ranks]
        self.bin_rank = [0] * len(bins)
        for r, ids in enumerate(self.rank_bins):
            for b in ids:
                self.bin_rank[b] = r
        # Loads and rank costs in one pass over the examples, rank by rank and bin by bin:
        # bincount adds in that order, as a running sum would. Only bins a rank lists are ever
        # read or moved, so only theirs are loaded.
        order = [b for r in self.rank_bins for b in r]
        flat = np.fromiter(chain.from_iterable(bins[b] for b in order), dtype=np.int64,
                           count=sum(self.count[b] for b in order))
        held = [self.count[b] for b in order]
        bin_of = np.repeat(np.asarray(order, dtype=np.int64), held)
        load = np.bincount(bin_of, weights=self.size_array[flat], minlength=len(bins))
        self.load_array = load.astype(np.int64)  # sums of integers, exact in float64
        self.load = self.load_array.tolist()  # the same, as a list, kept equal to it
        self.movable = [n > 0 and x <= capacity for n, x in zip(self.count, self.load,
                                                                strict=True)]
        rank_of = np.asarray(self.bin_rank, dtype=np.int64)[bin_of]
        self.rank_cost = np.bincount(rank_of, weights=self.cost_array[flat],
                                     minlength=len(self.rank_bins)).tolist()
        self._sorted: dict[int, tuple[list[float], list[int], list[int]]] = {}  # when first asked
        self._arrays: dict[int, _Arrays] = {}
        self._room: dict[int, _Room] = {}

    def _sort(self, rank: int) -> tuple[list[float], list[int], list[int]]:
        bins = [b for b in self.rank_bins[rank] if self.movable[b]]
        held = [self.count[b] for b in bins]
        items = np.fromiter(chain.from_iterable(self.bins[b] for b in bins), dtype=np.int64,
                            count=sum(held))
        owners = np.repeat(np.asarray(bins, dtype=np.int64), held)
        costs = self.cost_array[items]
        order = np.lexsort((items, costs))  # by (cost, example), as bisect on the lists expects
        costs, items, owners = costs[order], items[order], owners[order]
        self._arrays[rank] = _Arrays(costs, items, owners, self)  # in step with the lists
        return costs.tolist(), items.tolist(), owners.tolist()

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
        """``items(rank)`` as arrays (sorting the rank, if not sorted yet, makes both)."""
        if rank not in self._arrays:
            costs, items, owners = self.items(rank)
            if rank not in self._arrays:  # sorted earlier, and changed by insertion since
                self._arrays[rank] = _Arrays(np.asarray(costs, dtype=np.float64),
                                             np.asarray(items, dtype=np.int64),
                                             np.asarray(owners, dtype=np.int64), self)
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
        bins, load, count, size, cost = self.bins, self.load, self.count, self.size, self.cost
        bin_rank, incremental = self.bin_rank, len(moves) <= INCREMENTAL_MOVES
        heavy_cost, light_cost = self.rank_cost[heavy], self.rank_cost[light]
        for item, source, target in moves:
            gone.setdefault(source, set()).add(item)
            bins[target].append(item)
            load[source] -= size[item]
            load[target] += size[item]
            self.load_array[source] = load[source]
            self.load_array[target] = load[target]
            count[source] -= 1
            count[target] += 1
            if bin_rank[source] == heavy:
                heavy_cost -= cost[item]
                light_cost += cost[item]
            else:
                heavy_cost += cost[item]
                light_cost -= cost[item]
            if incremental:
                self._resort(item, bin_rank[source], bin_rank[target], target)
        self.rank_cost[heavy], self.rank_cost[light] = heavy_cost, light_cost
        for source, items in gone.items():
            bins[source] = [i for i in bins[source] if i not in items]
        self._forget(heavy, light, resorted=incremental)

    def _forget(self, heavy: int, light: int, *, resorted: bool) -> None:
        """Drop what was derived from the two ranks' bins; their sorted examples too, unless
        ``resorted`` kept them up to date by insertion (they are sorted afresh when asked)."""
        for rank in (heavy, light):
            if not resorted:
                self._sorted.pop(rank, None)
            self._arrays.pop(rank, None)
            self._room.pop(rank, None)

    def shift(self, heavy: int, light: int, outgoing: dict[int, list[int]],
              incoming: dict[int, list[int]], costs: tuple[float, float]) -> None:
        """Many examples moved at once from ``heavy``'s bins (``outgoing``: bin -> its examples
        leaving) into ``light``'s (``incoming``: bin -> examples arriving, in order), with the two
        ranks' costs after the move (summed by the caller, move by move, as `apply` would)."""
        size = self.size
        for source, items in outgoing.items():
            self.load[source] -= sum(size[i] for i in items)
            self.load_array[source] = self.load[source]
            self.count[source] -= len(items)
            drop = set(items)
            self.bins[source] = [i for i in self.bins[source] if i not in drop]
        for target, items in incoming.items():
            self.bins[target].extend(items)
            self.load[target] += sum(size[i] for i in items)
            self.load_array[target] = self.load[target]
            self.count[target] += len(items)
        self.rank_cost[heavy], self.rank_cost[light] = costs
        self._forget(heavy, light, resorted=False)

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
    partners: int,
    microbatch_cost: float = 0.0,
) -> tuple[list[list[int]], list[float]]:
    """``bins`` (positions into ``sizes`` and ``costs``) with examples moved between ranks, and
    each rank's cost after the moves (kept as they were made, so a caller need not sum again).

    ``ranks`` gives each rank's bin ids (they stay each rank's); ``sizes`` are the packer's
    aligned sizes, budgeted per bin by ``capacity``; ``costs`` the modeled cost of each
    example. A moved example goes to the end of its new bin; the rest keep their order.
    ``microbatch_cost`` is added to a rank's cost for each bin it holds.
    """
    out = [list(map(int, b)) for b in bins]
    if len(ranks) < 2 or not out:
        each = np.asarray(costs, dtype=np.float64)
        return out, [float(sum(each[p] for b in rank for p in out[b]))
                     + microbatch_cost * len(rank) for rank in ranks]
    step = _Step(out, np.asarray(sizes, dtype=np.int64).tolist(),
                 np.asarray(costs, dtype=np.float64).tolist(), ranks, int(capacity))
    if microbatch_cost:
        step.rank_cost = [c + microbatch_cost * len(ids)
                          for c, ids in zip(step.rank_cost, step.rank_bins, strict=True)]
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
        if not any(_even(step, heavy, light) for light in by_cost[:partners]):
            break
    return out, list(step.rank_cost)


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
    top = bisect_right(costs, share)  # examples of cost within the share
    # Room and the share only shrink, so an example too big for the widest room or too
    # costly now never fits later: only those that fit at the start are visited.
    fits = np.flatnonzero(step.arrays(heavy).size[:top] <= widest)[::-1].tolist()
    left, cheapest = share, costs[0] if costs else 0.0
    heavy_cost, light_cost = step.rank_cost[heavy], step.rank_cost[light]
    outgoing: dict[int, list[int]] = {}
    incoming: dict[int, list[int]] = {}
    count: dict[int, int] = {}
    size, held = step.size, step.count
    for k in fits:
        c = costs[k]
        if c > left:
            continue
        item, source = items[k], owners[k]
        s = size[item]
        n = count.get(source, held[source])
        if s > widest or n < 2:
            continue
        best, slack = -1, widest + 1
        for t, r in enumerate(room):
            if s <= r < s + slack:
                best, slack = t, r - s
        if room[best] == widest:  # the widest room shrinks: find the new widest
            room[best] -= s
            widest = max(room)
        else:
            room[best] -= s
        count[source] = n - 1
        left -= c
        heavy_cost -= c
        light_cost += c
        outgoing.setdefault(source, []).append(item)
        incoming.setdefault(targets[best], []).append(item)
        if left < cheapest:  # nothing left fits the share
            break
    if not outgoing:
        return False
    step.shift(heavy, light, outgoing, incoming, (heavy_cost, light_cost))
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
        for k in range(max(0, at - 1), min(len(costs), at + 1)):  # the nearest on each side
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
    near = np.minimum(np.maximum(at[:, None] + step.around, 0), lt.item.size - 1)
    delta = h.cost[:, None] - lt.cost[near]
    gain = np.minimum(delta, gap - delta)
    grow = h.size[:, None] - lt.size[near]  # tokens the light rank's bin gains
    ok = (gain > floor) & (grow <= lt.free[near]) & (-grow <= h.free[:, None])
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
    free_h = h.free[:, None]  # room in each heavy example's bin
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
