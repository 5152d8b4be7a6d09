"""Hand-worked packings for each algorithm, plus balanced splitting."""

from __future__ import annotations

from megatron_packing.packing.alignment import Alignment
from megatron_packing.packing.factory import make_seq_packer


def sizes_of(bins: list[list[int]], lengths: list[int]) -> list[list[int]]:
    return [[lengths[i] for i in b] for b in bins]


def test_mffd_differs_from_ffd() -> None:
    # Capacity 100; positions 0..6 already sorted.
    # FFD: 58 -> b0 (42); 30 -> b0 (12); 27, 22, 20, 19 -> b1 (12); 14 -> b2.   3 bins.
    # MFFD: 58 is large (> 50): b0 (room 42). No medium items (33, 50].
    #   Phase 3: the two smallest small items (16.7, 33.3], 19 + 20 = 39 <= 42: put 19,
    #   then the largest small that fits room 23: 22 (room 1).
    #   Phase 4: the smallest left, 14, does not fit room 1.
    #   Phase 5: FFD on 30, 27, 20, 14 -> one bin of 91.                         2 bins.
    lengths = [58, 30, 27, 22, 20, 19, 14]
    assert make_seq_packer("ffd", 100).pack(lengths) == [[0, 1], [2, 3, 4, 5], [6]]
    mffd = make_seq_packer("mffd", 100).pack(lengths)
    assert mffd == [[0, 3, 5], [1, 2, 4, 6]]
    assert sizes_of(mffd, lengths) == [[58, 22, 19], [30, 27, 20, 14]]


def test_mffd_medium_phase() -> None:
    # Capacity 100: 60 large (b0, room 40); 50 and 40 medium; 30 and 20 small.
    # Phase 2: the largest medium that fits room 40 is 40 -> b0 full.
    # Phase 5: FFD on 50, 30, 20 -> b1 = 100.
    assert make_seq_packer("mffd", 100).pack([60, 50, 40, 30, 20]) == [[0, 2], [1, 3, 4]]


def test_bfd_differs_from_ffd() -> None:
    # Capacity 10, sizes 7, 4, 4, 2: 7 -> b0 (room 3); 4 -> b1 (6); 4 -> b1 (2).
    # The 2: FFD takes the first bin with room (b0, room 3); BFD the tightest (b1, room 2).
    lengths = [7, 4, 4, 2]
    assert make_seq_packer("ffd", 10).pack(lengths) == [[0, 3], [1, 2]]
    assert make_seq_packer("bfd", 10).pack(lengths) == [[0], [1, 2, 3]]


def test_ties_break_by_position_and_bins_by_opening_order() -> None:
    # Capacity 10, three 6s and three 4s interleaved. Sorted by (-size, position):
    # 6@1, 6@3, 6@5, 4@0, 4@2, 4@4. Each 6 opens a bin; each 4 joins the first with room.
    lengths = [4, 6, 4, 6, 4, 6]
    for name in ("mffd", "ffd", "bfd"):
        assert make_seq_packer(name, 10).pack(lengths) == [[0, 1], [2, 3], [4, 5]]


def test_alignment_changes_the_packing() -> None:
    # cp=2, tp=1: sequences pad to 4, bins to 4. Capacity 16.
    # Raw 5, 5, 5 -> aligned 8, 8, 8: only two fit a bin (16), so 2 bins, though 15 <= 16.
    a = Alignment(seq_multiple=4, bin_multiple=4)
    for name in ("mffd", "ffd", "bfd"):
        assert make_seq_packer(name, 16, alignment=a).pack([5, 5, 5]) == [[0, 1], [2]]
    # Bin multiple 16 with capacity 40: usable 32, so 20 + 20 does not fit.
    b = Alignment(seq_multiple=1, bin_multiple=16)
    assert make_seq_packer("ffd", 40, alignment=b).pack([20, 12, 20]) == [[0, 1], [2]]


def test_balanced_split_takes_the_heaviest_bin() -> None:
    # Capacity 100. FFD: b0 = 50 + 45 (95), b1 = 30 + 10 + 10 + 10 + 10 (70).
    # dp_size=3: split the heaviest multi-item bin, b0 (95), into {50} and {45};
    # the first half keeps its place, the second is appended.
    lengths = [50, 45, 30, 10, 10, 10, 10]
    packer = make_seq_packer("ffd", 100, dp_size=3)
    assert packer.pack(lengths) == [[0], [2, 3, 4, 5, 6], [1]]
    # Four bins: then the heaviest multi-item bin is b1 (70). Items largest first, each into
    # the lighter half (ties: first): 30 -> first; 10, 10, 10 -> second (10, 20, 30);
    # last 10: 30 <= 30 -> first. Halves {30, 10} and {10, 10, 10}.
    packer4 = make_seq_packer("ffd", 100, dp_size=4)
    assert sizes_of(packer4.pack(lengths), lengths) == [[50], [30, 10], [45], [10, 10, 10]]


def test_dp_size_and_placeholder_bins() -> None:
    packer = make_seq_packer("mffd", 100, dp_size=4)
    bins = packer.pack([90, 80, 70])
    assert bins == [[0], [1], [2], []]
    assert make_seq_packer("mffd", 100, dp_size=2).pack([]) == [[], []]
    assert make_seq_packer("mffd", 100).pack([]) == []


def test_pack_to_count_up_and_down() -> None:
    packer = make_seq_packer("mffd", 100)
    lengths = [60, 50, 40, 30, 20]  # natural: [60, 40] [50, 30, 20]
    assert packer.pack_to_count(lengths, 2) == [[0, 2], [1, 3, 4]]
    # Three bins: the heaviest (tie at 100 -> lowest index) b0 splits into {60} and {40}.
    assert packer.pack_to_count(lengths, 3) == [[0], [1, 3, 4], [2]]
    assert packer.pack_to_count(lengths, 1) is None  # below the volume bound
    assert packer.pack_to_count(lengths, 6) is None  # more bins than items
    # 7, 4, 4, 2 at capacity 8: volume bound ceil(17 / 8) = 3, so 2 bins is impossible.
    assert make_seq_packer("ffd", 8).pack_to_count([7, 4, 4, 2], 2) is None


def test_pack_to_count_beats_the_natural_packing() -> None:
    # Capacity 20, sizes 9, 8, 7, 6, 5, 4. FFD: 9+8 | 7+6+5 | 4 = 3 bins, but 2 suffice:
    # {9, 6, 5} = 20 and {8, 7, 4} = 19.
    packer = make_seq_packer("ffd", 20)
    lengths = [9, 8, 7, 6, 5, 4]
    assert len(packer.pack(lengths)) == 3
    bins = packer.pack_to_count(lengths, 2)
    assert bins is not None and len(bins) == 2
    assert sorted(sum(lengths[i] for i in b) for b in bins) == [19, 20]
