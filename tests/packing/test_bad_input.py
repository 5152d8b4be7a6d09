"""Validation: bad lengths, capacities, parallel sizes, names and oversize examples."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_packing.packing.algorithms import (
    MFFDPacker,
    OversizePolicy,
    OversizeSequenceError,
)
from megatron_packing.packing.alignment import Alignment
from megatron_packing.packing.factory import make_seq_packer, make_sft_sequence_packer
from megatron_packing.packing.microbatch import (
    fixed_size_microbatches,
    make_token_balanced_microbatches,
)
from megatron_packing.packing.planner.sizer import StepSizer

from ._helpers import check_fits, check_partition


@pytest.mark.parametrize(
    ("lengths", "fragment"),
    [
        ([3, 0, 2], r"lengths\[1\] = 0"),
        ([3, 4, -5], r"lengths\[2\] = -5"),
        ([3, 2.5], r"lengths\[1\] = 2.5"),
        ([3, True], r"lengths\[1\] = True"),
        (np.array([True, False]), "bool"),
        ([1, float("nan")], r"lengths\[1\]"),
        (["a", 3], "lengths"),
        (np.ones((2, 2), dtype=int), "1-D"),
        ([1, None], r"lengths\[1\]"),
    ],
)
def test_bad_lengths(lengths, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        make_seq_packer("mffd", 100).pack(lengths)


def test_integral_floats_are_accepted() -> None:
    assert make_seq_packer("ffd", 10).pack(np.array([4.0, 6.0])) == [[0, 1]]


@pytest.mark.parametrize("capacity", [0, -4, 2.5, True])
def test_bad_capacity(capacity) -> None:
    with pytest.raises(ValueError, match="bin_capacity"):
        make_seq_packer("mffd", capacity)


def test_capacity_below_bin_multiple_explains_the_multiple() -> None:
    with pytest.raises(
        ValueError, match=r"per-bin multiple 32.*context parallelism needs 2\*tp\*cp"
    ):
        make_sft_sequence_packer(16, tp_size=4, cp_size=4)
    with pytest.raises(ValueError, match=r"per-bin multiple 16.*FP8"):
        make_sft_sequence_packer(8, fp8_enabled=True)


@pytest.mark.parametrize("field", ["tp_size", "cp_size", "dp_size"])
@pytest.mark.parametrize("value", [0, -1, 1.0])
def test_bad_parallel_sizes(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        make_sft_sequence_packer(4096, **{field: value})


def test_unknown_algorithm_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="mffd, ffd, bfd"):
        make_seq_packer("next_fit", 100)
    with pytest.raises(ValueError, match="mffd, ffd, bfd"):
        make_sft_sequence_packer(100, algorithm="worst")


def test_unknown_oversize_policy_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="error, truncate, own_bin"):
        make_seq_packer("mffd", 100, oversize_policy="drop")


def test_oversize_error_names_example_and_lengths() -> None:
    packer = make_seq_packer("mffd", 64, alignment=Alignment(8, 16))
    with pytest.raises(OversizeSequenceError) as info:
        packer.pack([10, 63, 70])
    message = str(info.value)
    # Usable capacity 64. Position 1: 63 -> aligned 64, fits. Position 2: 70 -> 72, too long.
    assert "position 2" in message and "length 70" in message and "72" in message
    assert "64" in message
    assert isinstance(info.value, ValueError)


def test_oversize_truncate_clips_to_the_longest_fitting_length() -> None:
    alignment = Alignment(8, 16)
    packer = make_seq_packer("ffd", 70, alignment=alignment, oversize_policy="truncate")
    lengths = [10, 100, 64]
    assert packer.usable_capacity == 64
    assert packer.effective_lengths(lengths).tolist() == [10, 64, 64]
    bins = packer.pack(lengths)
    check_partition(bins, 3)
    check_fits(bins, packer.effective_lengths(lengths), alignment, 70)
    assert packer.lower_bound(lengths) == 3  # 16 + 64 + 64 over 64


def test_oversize_own_bin_puts_the_example_alone() -> None:
    packer = make_seq_packer("mffd", 100, oversize_policy=OversizePolicy.OWN_BIN)
    lengths = [30, 250, 40, 150, 20]
    bins = packer.pack(lengths)
    # Own-bin singletons first, largest first; then the regular packing.
    assert bins == [[1], [3], [0, 2, 4]]
    assert packer.lower_bound(lengths) == 3
    assert packer.effective_lengths(lengths).tolist() == lengths
    # Four bins: split {30, 40, 20}: 40 -> first; 30 -> second; 20 -> second (30 < 40).
    assert packer.pack_to_count(lengths, 4) == [[1], [3], [2], [0, 4]]
    assert packer.pack_to_count(lengths, 2) is None


def test_bin_count_errors() -> None:
    with pytest.raises(ValueError, match=r"dp_size must be an integer >= 1 or None, got 2.0"):
        MFFDPacker(100, dp_size=2.0)
    with pytest.raises(ValueError, match=r"dp_size must be an integer >= 1, got 0"):
        MFFDPacker(100, dp_size=0)
    # The planner rounds padded steps itself: a packer that already rounds is refused.
    with pytest.raises(ValueError, match=r"rounds them to dp_size=2; build it without dp_size"):
        StepSizer(make_sft_sequence_packer(100, dp_size=2), 2)
    with pytest.raises(ValueError, match="num_bins"):
        MFFDPacker(100).pack_to_count([1], -1)


def test_sft_packer_with_dp() -> None:
    packer = make_sft_sequence_packer(
        4096, tp_size=2, cp_size=2, dp_size=4, fp8_enabled=True, fp8_recipe="mxfp8"
    )
    assert packer.alignment == Alignment(8, 128)
    assert packer.usable_capacity == 4096
    assert len(packer.pack([100] * 3)) == 4  # fewer examples than ranks: one empty bin
    bins = packer.pack([3000] * 9)
    assert len(bins) == 12 and all(bins[:9]) and not any(bins[9:])
    assert packer.pack([]) == [[], [], [], []]
    assert len(packer.pack([10] * 500)) % 4 == 0


def test_counts_accept_numpy_integers_and_name_the_setting_when_bad() -> None:
    # One integer rule everywhere: numpy integers count, bools and fractions do not.
    packer = make_sft_sequence_packer(4096, tp_size=np.int64(2), dp_size=np.int32(2))
    assert packer.alignment.bin_multiple == 2 and packer.dp_size == 2
    assert sorted(packer.pack_to_count([3, 4, 5], np.int64(3))) == [[0], [1], [2]]
    assert make_token_balanced_microbatches([0, 1], [4, 4], np.int64(8)) == [[0, 1]]
    assert fixed_size_microbatches([5, 6, 7], np.int64(2)) == [[5, 6], [7]]
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=rf"max_tokens must be an integer >= 1, got {bad!r}"):
            make_token_balanced_microbatches([0], [4], bad)
        with pytest.raises(ValueError, match=rf"micro_batch_size must be an integer >= 1, got {bad!r}"):
            fixed_size_microbatches([5], bad)
    with pytest.raises(ValueError, match=r"num_bins must be an integer >= 0, got 1.0"):
        MFFDPacker(100).pack_to_count([1], 1.0)
    with pytest.raises(ValueError, match=r"dp_size must be an integer >= 1, got 0"):
        StepSizer(make_seq_packer("mffd", 100), 0)
    with pytest.raises(ValueError, match=r"max_deferred must be an integer >= 0, got -1"):
        StepSizer(make_seq_packer("mffd", 100), 2, max_deferred=-1)
