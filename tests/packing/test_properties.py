"""Property tests over random lengths, capacities, alignments and algorithms."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_packing.packing.algorithms import PackingAlgorithm
from megatron_packing.packing.alignment import Alignment
from megatron_packing.packing.factory import make_seq_packer

from ._helpers import check_fits, check_partition, optimal_bins

ALGORITHMS = [a.value for a in PackingAlgorithm]
SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def instances(draw, max_items: int = 60):
    seq = draw(st.sampled_from([1, 2, 4, 8]))
    bin_mult = seq * draw(st.sampled_from([1, 2, 4]))
    capacity = draw(st.integers(bin_mult, 512))
    usable = capacity // bin_mult * bin_mult
    max_len = usable // seq * seq
    lengths = draw(st.lists(st.integers(1, max_len), max_size=max_items))
    algorithm = draw(st.sampled_from(ALGORITHMS))
    return Alignment(seq, bin_mult), capacity, lengths, algorithm


@SETTINGS
@given(instances())
def test_pack_is_a_fitting_partition(inst) -> None:
    alignment, capacity, lengths, algorithm = inst
    packer = make_seq_packer(algorithm, capacity, alignment=alignment)
    bins = packer.pack(lengths)
    check_partition(bins, len(lengths))
    check_fits(bins, lengths, alignment, capacity)
    assert all(bins)
    assert len(bins) >= packer.lower_bound(lengths)
    total = int(alignment.padded_lengths(lengths).sum())
    assert len(bins) >= -(-total // packer.usable_capacity)
    # Deterministic, and list / numpy inputs agree.
    assert packer.pack(np.asarray(lengths, dtype=np.int32)) == bins


@SETTINGS
@given(instances(), st.integers(1, 9))
def test_dp_size_rounds_the_bin_count(inst, dp) -> None:
    alignment, capacity, lengths, algorithm = inst
    packer = make_seq_packer(algorithm, capacity, alignment=alignment, dp_size=dp)
    natural = len(make_seq_packer(algorithm, capacity, alignment=alignment).pack(lengths))
    target = -(-max(natural, dp) // dp) * dp
    bins = packer.pack(lengths)
    assert len(bins) == target
    check_partition([b for b in bins if b], len(lengths))
    check_fits(bins, lengths, alignment, capacity)
    assert sum(1 for b in bins if b) == min(len(lengths), target)  # empty only when too few


@SETTINGS
@given(instances(max_items=40), st.integers(-2, 3))
def test_pack_to_count(inst, delta) -> None:
    alignment, capacity, lengths, algorithm = inst
    packer = make_seq_packer(algorithm, capacity, alignment=alignment)
    natural = len(packer.pack(lengths))
    k = max(0, natural + delta)
    bins = packer.pack_to_count(lengths, k)
    if delta >= 0 and k <= len(lengths):
        assert bins is not None  # splitting up always works when items suffice
    if k < packer.lower_bound(lengths) or k > len(lengths):
        assert bins is None
    if bins is not None:
        assert len(bins) == k
        assert all(bins)
        check_partition(bins, len(lengths))
        check_fits(bins, lengths, alignment, capacity)


@settings(max_examples=120, deadline=None)
@given(st.integers(6, 40), st.lists(st.integers(1, 40), min_size=1, max_size=9))
def test_worst_case_bounds_against_brute_force(capacity, raw) -> None:
    lengths = [min(x, capacity) for x in raw]
    opt = optimal_bins(lengths, capacity)
    mffd = len(make_seq_packer("mffd", capacity).pack(lengths))
    ffd = len(make_seq_packer("ffd", capacity).pack(lengths))
    bfd = len(make_seq_packer("bfd", capacity).pack(lengths))
    assert opt <= min(mffd, ffd, bfd)
    assert 60 * mffd <= 71 * opt + 60
    assert 9 * ffd <= 11 * opt + 6
    assert 9 * bfd <= 11 * opt + 6


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([64, 512, 4096]))
def test_large_random_instances(seed, capacity) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, capacity + 1, size=int(rng.integers(100, 3000)))
    lengths[rng.random(len(lengths)) < 0.5] //= 8
    lengths = np.maximum(lengths, 1)
    for algorithm in ALGORITHMS:
        packer = make_seq_packer(algorithm, capacity)
        bins = packer.pack(lengths)
        check_partition(bins, len(lengths))
        loads = [int(lengths[b].sum()) for b in bins]
        assert max(loads) <= capacity
        # Any-fit packings: at most one bin is at most half full.
        assert sum(1 for x in loads if 2 * x <= capacity) <= 1
        assert len(bins) >= packer.lower_bound(lengths)


def test_ffd_and_bfd_match_naive_references() -> None:
    rng = np.random.default_rng(7)
    for _ in range(30):
        capacity = int(rng.integers(10, 5000))
        lengths = rng.integers(1, capacity + 1, size=int(rng.integers(1, 400))).tolist()
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        ffd_rooms: list[int] = []
        ffd_bins: list[list[int]] = []
        bfd_rooms: list[int] = []
        bfd_bins: list[list[int]] = []
        for i in order:
            s = lengths[i]
            j = next((b for b, r in enumerate(ffd_rooms) if r >= s), None)
            if j is None:
                ffd_rooms.append(capacity)
                ffd_bins.append([])
                j = len(ffd_rooms) - 1
            ffd_rooms[j] -= s
            ffd_bins[j].append(i)
            fits = [(r, b) for b, r in enumerate(bfd_rooms) if r >= s]
            if fits:
                j = min(fits)[1]
            else:
                bfd_rooms.append(capacity)
                bfd_bins.append([])
                j = len(bfd_rooms) - 1
            bfd_rooms[j] -= s
            bfd_bins[j].append(i)
        assert make_seq_packer("ffd", capacity).pack(lengths) == [sorted(b) for b in ffd_bins]
        assert make_seq_packer("bfd", capacity).pack(lengths) == [sorted(b) for b in bfd_bins]


def naive_mffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """MFFD written directly from its phase description, quadratic time."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    large = [i for i in order if 2 * lengths[i] > capacity]
    rest = [i for i in order if 2 * lengths[i] <= capacity]
    medium = [i for i in rest if 3 * lengths[i] > capacity]
    small = [i for i in rest if 3 * lengths[i] <= capacity < 6 * lengths[i]]
    bins = [[i] for i in large]
    rooms = [capacity - lengths[i] for i in large]
    used: set[int] = set()
    got_medium = [False] * len(bins)
    for b in range(len(bins)):
        fit = [i for i in medium if i not in used and lengths[i] <= rooms[b]]
        if fit:
            bins[b].append(fit[0])
            rooms[b] -= lengths[fit[0]]
            used.add(fit[0])
            got_medium[b] = True
    for b in reversed(range(len(bins))):
        if got_medium[b]:
            continue
        left = [i for i in small if i not in used]
        if len(left) < 2:
            break
        c1, c2 = left[-1], left[-2]
        if lengths[c1] + lengths[c2] > rooms[b]:
            continue
        bins[b].append(c1)
        rooms[b] -= lengths[c1]
        used.add(c1)
        j = next(i for i in small if i not in used and lengths[i] <= rooms[b])
        bins[b].append(j)
        rooms[b] -= lengths[j]
        used.add(j)
    for b in range(len(bins)):
        while True:
            left = [i for i in rest if i not in used]
            if not left or lengths[left[-1]] > rooms[b]:
                break
            j = next(i for i in left if lengths[i] <= rooms[b])
            bins[b].append(j)
            rooms[b] -= lengths[j]
            used.add(j)
    for i in rest:
        if i in used:
            continue
        j = next((b for b, r in enumerate(rooms) if r >= lengths[i]), None)
        if j is None:
            bins.append([])
            rooms.append(capacity)
            j = len(bins) - 1
        bins[j].append(i)
        rooms[j] -= lengths[i]
    return [sorted(b) for b in bins]


def test_mffd_matches_a_naive_reference() -> None:
    rng = np.random.default_rng(11)
    for _ in range(60):
        capacity = int(rng.integers(12, 3000))
        n = int(rng.integers(1, 120))
        lengths = rng.integers(1, capacity + 1, size=n)
        # Skew towards the class boundaries so every phase has work.
        cut = rng.random(n)
        lengths[cut < 0.3] = rng.integers(
            capacity // 6, capacity // 3 + 2, size=int((cut < 0.3).sum())
        )
        lengths = np.clip(lengths, 1, capacity).tolist()
        assert make_seq_packer("mffd", capacity).pack(lengths) == naive_mffd(lengths, capacity)


@SETTINGS
@given(instances(), st.sampled_from(["truncate", "own_bin"]), st.integers(0, 4), st.data())
def test_oversize_policies(inst, policy, n_long, data) -> None:
    alignment, capacity, lengths, algorithm = inst
    long = data.draw(
        st.lists(st.integers(capacity + 1, 3 * capacity), min_size=n_long, max_size=n_long)
    )
    lengths = lengths + long
    packer = make_seq_packer(algorithm, capacity, alignment=alignment, oversize_policy=policy)
    bins = packer.pack(lengths)
    check_partition(bins, len(lengths))
    effective = packer.effective_lengths(lengths)
    oversize = alignment.padded_lengths(effective) > packer.usable_capacity
    assert oversize.sum() == (n_long if policy == "own_bin" else 0)
    for b in bins:
        if len(b) == 1 and oversize[b[0]]:
            continue
        assert not oversize[b].any()
        assert alignment.footprint(effective[b]) <= capacity
    assert len(bins) >= packer.lower_bound(lengths)
    k = len(bins) + 1
    more = packer.pack_to_count(lengths, k)
    assert (more is None) == (k > len(lengths))
