"""The padded micro-batch count sync takes the largest count over the ranks (all_reduce MAX).

A rank that ran fewer micro-batches than another would leave it waiting in the gradient
all-reduce, and a rank cut below its own count would drop examples. A single-process group
cannot tell MAX from MIN, so a fake collective stands in for ``torch.distributed`` here: each
all_reduce applies the op it is given over this rank's values and the other ranks'.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from megatron_packing.padded import sync
from megatron_packing.padded.sync import align_microbatch_count


@pytest.fixture
def other_ranks(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[int]], None]:
    """Set the values the other ranks bring to the next all_reduce (in a group of them + 1)."""
    peers: list[list[int]] = []

    def all_reduce(tensor: torch.Tensor, op: object = dist.ReduceOp.SUM, group: object = None,
                   async_op: bool = False) -> None:
        stacked = torch.stack([tensor, *(torch.tensor(values, dtype=tensor.dtype)
                                         for values in peers)])
        if op == dist.ReduceOp.MAX:
            tensor.copy_(stacked.amax(dim=0))
        elif op == dist.ReduceOp.MIN:
            tensor.copy_(stacked.amin(dim=0))
        elif op == dist.ReduceOp.SUM:
            tensor.copy_(stacked.sum(dim=0))
        else:
            raise NotImplementedError(op)

    monkeypatch.setattr(sync.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sync.dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(sync.dist, "all_reduce", all_reduce)
    return lambda values: peers.__setitem__(slice(None), [[v] for v in values])


def test_a_rank_with_fewer_micro_batches_pads_up_to_the_largest_count(other_ranks):
    other_ranks([5, 3, 1])
    assert align_microbatch_count([[0], [1]]) == [[0], [1], None, None, None]


def test_the_rank_with_the_largest_count_keeps_its_schedule(other_ranks):
    other_ranks([2, 1])
    schedule = [[0], [1, 2], [3], [4]]
    assert align_microbatch_count(schedule) == schedule


def test_an_empty_rank_runs_as_many_dummies_as_the_others_run_micro_batches(other_ranks):
    other_ranks([3])
    assert align_microbatch_count([]) == [None, None, None]
