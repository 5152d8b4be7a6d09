"""When alignment cannot succeed, the planner names the change that makes it possible."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import SequentialSampler

from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.packing.factory import make_seq_packer
from megatron_packing.packing.planner.bounds import SegmentBound
from megatron_packing.packing.planner.feasibility import alignment_remedy


def test_a_worked_remedy():
    # Five examples of 3 tokens, capacity 16, B = 4, dp = 4: all five fit one bin, so no
    # variation helps; at capacity 5 no two share a bin (3 + 3 > 5): four bins for four ranks.
    remedy = alignment_remedy(np.array([3] * 5), 16, 4, 4)
    assert remedy.variation is None and remedy.capacity == 5
    assert remedy.describe() == "a step reaches dp bins with bin_capacity <= 5"
    # Examples of 10 tokens, capacity 150, B = 10, dp = 2: 151 tokens need two bins, so 16
    # examples, 6 more than B: variation 0.6. Or capacity 99: B's 100 tokens need two bins.
    remedy = alignment_remedy(np.array([10] * 100), 150, 10, 2)
    assert remedy.variation == 0.6 and remedy.capacity == 99
    # Fewer examples than ranks: nothing helps.
    remedy = alignment_remedy(np.array([5, 5]), 100, 2, 4)
    assert remedy.variation is None and remedy.capacity == 0
    assert "fewer examples than ranks" in remedy.describe()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=40, max_size=120), st.integers(4, 30),
       st.integers(2, 8))
def test_the_remedy_is_enough_and_the_capacity_the_largest(lengths, batch, dp):
    capacity = 4000
    values = np.asarray(lengths, dtype=np.int64)
    remedy = alignment_remedy(values, capacity, batch, dp)
    if remedy.variation is not None:
        v = math.floor(batch * remedy.variation)
        packed = make_seq_packer("mffd", bin_capacity=capacity).pack(values[:batch + v])
        assert len(packed) >= dp
        # One example fewer does not reach dp bins by the bound: the variation is the least.
        if v > 0:
            assert SegmentBound(values, capacity).prefixes(batch + v - 1)[-1] < dp
    if remedy.capacity:
        limit = remedy.capacity
        packer = make_seq_packer("mffd", bin_capacity=limit, oversize_policy="truncate")
        assert len(packer.pack(values[:batch])) >= dp
        if limit < capacity:
            above = np.minimum(values[:batch], limit + 1)
            assert SegmentBound(above, limit + 1).prefixes(batch)[-1] < dp


def test_the_sampler_says_so_once_with_the_remedy():
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(40)), [3] * 40, 4, 4, bin_capacity=16, allowed_variation=0.25)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans = [b.plan for b in sampler]
    said = [w for w in caught if "alignment cannot succeed" in str(w.message)]
    assert len(said) == 1 and sum(p.hopeless for p in plans) > 1
    assert "bin_capacity <= 5" in str(said[0].message)
    with pytest.warns(UserWarning, match="bin_capacity <= 5"):
        list(DPAlignedPackingBatchSampler(
            SequentialSampler(range(40)), [3] * 40, 4, 4, bin_capacity=16, allowed_variation=0.25))
