"""The seeded epoch order: torch.randperm's order, read as an array slice, resumed by position."""

from __future__ import annotations

import pytest
import torch

from megatron_packing.stream.base_order import EpochOrder, SeededRandomOrder


def randperm_order(n: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator()
    generator.manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 70_001])  # 70,001 spans two iteration chunks
@pytest.mark.parametrize("seed,epoch", [(0, 0), (5, 3)])
def test_the_order_is_torch_randperm_of_seed_and_epoch(n, seed, epoch):
    order = SeededRandomOrder(n, seed)
    order.set_epoch(epoch)
    expected = randperm_order(n, seed, epoch)
    assert order.epoch_permutation().tolist() == expected
    assert list(order) == expected
    assert all(type(i) is int for i in list(order)[:3])


class _NoIteration(SeededRandomOrder):
    """Fails if anything iterates it: the cursor must slice `epoch_permutation` instead."""

    def __iter__(self):
        raise AssertionError("the epoch order was iterated, not sliced")


def test_the_cursor_slices_the_array_and_resumes_by_position_across_epochs():
    n, seed = 1003, 9
    cursor = EpochOrder(_NoIteration(n, seed))
    states, read = [], []
    for epoch in range(2):
        cursor.start_epoch(epoch)
        while cursor.remaining:
            states.append(cursor.state_dict())
            read.append((epoch, cursor.take(97)))
    for epoch in range(2):
        taken = [i for e, part in read if e == epoch for i in part]
        assert taken == randperm_order(n, seed, epoch)
    for k, state in enumerate(states):
        resumed = EpochOrder(_NoIteration(n, seed))
        resumed.load_state_dict(state)
        assert resumed.state_dict().keys() == state.keys()
        assert resumed.take(97) == read[k][1]


def test_a_state_from_the_array_cursor_matches_the_iterating_cursor():
    """Same state keys and positions as a sampler read by iteration (old checkpoints load)."""

    class Iterated(torch.utils.data.Sampler):
        def __init__(self, n: int, seed: int) -> None:
            self.inner = SeededRandomOrder(n, seed)

        def set_epoch(self, epoch: int) -> None:
            self.inner.set_epoch(epoch)

        def __len__(self) -> int:
            return len(self.inner)

        def __iter__(self):
            return iter(self.inner)

    sliced, iterated = EpochOrder(SeededRandomOrder(500, 3)), EpochOrder(Iterated(500, 3))
    for cursor in (sliced, iterated):
        cursor.start_epoch(1)
    assert sliced.take(123) == iterated.take(123)
    state = iterated.state_dict()
    assert sliced.state_dict().keys() == state.keys()
    resumed = EpochOrder(SeededRandomOrder(500, 3))
    resumed.load_state_dict(state)
    assert resumed.take(400) == iterated.take(400)
