"""Alignment rules against an independently written table, and once-per-bin padding."""

from __future__ import annotations

import pytest

from megatron_packing.packing.alignment import FP8_RECIPES, Alignment, make_alignment

# (tp, cp) -> (seq multiple, bin multiple without FP8, delayed/tensorwise/default, mxfp8,
# blockwise), worked out by hand from the rules in docs/packing.md.
TABLE = {
    (1, 1): (1, 1, 16, 32, 16),
    (1, 2): (4, 4, 32, 64, 32),
    (1, 4): (8, 8, 64, 128, 64),
    (2, 1): (1, 2, 32, 64, 256),
    (2, 2): (8, 8, 64, 128, 512),
    (2, 4): (16, 16, 128, 256, 1024),
    (4, 1): (1, 4, 64, 128, 512),
    (4, 2): (16, 16, 128, 256, 1024),
    (4, 4): (32, 32, 256, 512, 2048),
    (8, 1): (1, 8, 128, 256, 1024),
    (8, 2): (32, 32, 256, 512, 2048),
    (8, 4): (64, 64, 512, 1024, 4096),
}
RECIPE_COLUMN = {None: 2, "delayed": 2, "tensorwise": 2, "mxfp8": 3, "blockwise": 4}


@pytest.mark.parametrize(("tp", "cp"), sorted(TABLE))
def test_alignment_without_fp8(tp: int, cp: int) -> None:
    expected = TABLE[(tp, cp)]
    for recipe in (None, *FP8_RECIPES):  # the recipe is ignored when FP8 is off
        a = make_alignment(tp, cp, fp8_enabled=False, fp8_recipe=recipe)
        assert (a.seq_multiple, a.bin_multiple) == (expected[0], expected[1])


@pytest.mark.parametrize(("tp", "cp"), sorted(TABLE))
@pytest.mark.parametrize("recipe", [None, *FP8_RECIPES])
def test_alignment_with_fp8(tp: int, cp: int, recipe: str | None) -> None:
    expected = TABLE[(tp, cp)]
    a = make_alignment(tp, cp, fp8_enabled=True, fp8_recipe=recipe)
    assert a.seq_multiple == expected[0]
    assert a.bin_multiple == expected[RECIPE_COLUMN[recipe]]


def test_aggregate_padding_is_paid_once_per_bin() -> None:
    # cp=2, tp=1: sequences pad to 4, the bin to 4 as well.
    a = make_alignment(1, 2)
    assert a.padded_lengths([5, 3, 8]).tolist() == [8, 4, 8]
    assert a.footprint([5, 3, 8]) == 20
    # FP8 at tp=1, cp=1: sequences unpadded, bin padded to 16 once: 10+7+3=20 -> 32, not 3x16.
    f = make_alignment(1, 1, fp8_enabled=True)
    assert f.footprint([10, 7, 3]) == 32
    assert f.footprint([16]) == 16
    assert f.footprint([17]) == 32
    # tp=2, cp=2, delayed FP8: sequences to 8, bin to 64: 9->16, 1->8, 30->32 = 56 -> 64.
    g = make_alignment(2, 2, fp8_enabled=True, fp8_recipe="delayed")
    assert g.footprint([9, 1, 30]) == 64
    assert g.footprint([]) == 0


def test_usable_capacity_and_max_sequence_length() -> None:
    a = Alignment(seq_multiple=8, bin_multiple=64)
    assert a.usable_capacity(1000) == 960
    assert a.max_sequence_length(1000) == 960
    assert a.padded_length(953) == 960
    assert a.padded_length(961) == 968
    with pytest.raises(ValueError, match="per-bin multiple 64"):
        a.usable_capacity(63)
    odd = Alignment(seq_multiple=3, bin_multiple=1)
    assert odd.max_sequence_length(10) == 9  # aligned(10) = 12 would not fit


def test_capacity_error_says_why() -> None:
    a = make_alignment(2, 1, fp8_enabled=True, fp8_recipe="blockwise")
    with pytest.raises(ValueError, match=r"256.*blockwise"):
        a.usable_capacity(128)


@pytest.mark.parametrize(("tp", "cp"), [(0, 1), (1, 0), (-2, 1), (1.5, 1), (True, 1)])
def test_bad_parallel_sizes(tp, cp) -> None:
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        make_alignment(tp, cp)


def test_unknown_recipe_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="delayed, tensorwise, mxfp8, blockwise"):
        make_alignment(1, 1, fp8_enabled=True, fp8_recipe="nvfp4")
