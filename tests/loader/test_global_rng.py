"""The loader never draws from torch's global generator: the model's checkpoint saves that
generator's state for dropout, and a resumed run makes its first loader iterator after the state
is restored, where the uninterrupted run made it steps before."""

from __future__ import annotations

import torch

from .streams import make_loader


def test_building_iterating_and_resuming_a_loader_leaves_the_global_generator_alone():
    torch.manual_seed(1)
    before = torch.get_rng_state().clone()
    loader = make_loader()
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    resumed = make_loader()
    resumed.load_state_dict(state)
    next(iter(resumed))
    for _ in range(6):  # into the next epoch: a new iterator
        next(batches, None)
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)
