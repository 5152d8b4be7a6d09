"""Digests of the plans the samplers make on the shipped length pools.

A digest covers every field of every step that decides what trains where: the global batch, the
bins, the bins' ranks, the padding and placeholder counts, the deferred examples, the drift (packed
mode); the per-rank micro-batch schedules (padded mode). Restructuring the code must leave them
all unchanged; a deliberate change of the planner updates them (``python -m
tests.golden.plan_digests`` prints the current ones).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from functools import cache
from typing import Any

import numpy as np
from torch.utils.data import SequentialSampler

from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream

# (name, batch size, capacity, dp, steps, options)
PACKED_GEOMETRIES: list[tuple[str, int, int, int, int, dict[str, Any]]] = [
    ("128/4K/dp8", 128, 4096, 8, 40, {}),
    ("128/4K/dp8 deferral", 128, 4096, 8, 40, {"max_deferred_examples": 12}),
    ("256/16K/dp4 ffd", 256, 16384, 4, 20, {"algorithm": "ffd"}),
    ("64/8K/dp4 bfd tp2 cp2", 64, 8192, 4, 30, {"algorithm": "bfd", "tp_size": 2, "cp_size": 2}),
    ("96/4K/dp2 round robin", 96, 4096, 2, 30, {"rank_assignment": "round_robin",
                                               "lookahead_steps": 1}),
    ("128/4K/dp8 fixed B", 128, 4096, 8, 30, {"align_to_dp": False}),
    ("128/4K/dp8 whole bins", 128, 4096, 8, 40, {"rank_assignment": "karmarkar_karp"}),
    ("1024/64K/dp8", 1024, 65536, 8, 6, {}),
]

# (name, batch size, dp, steps, max tokens per micro-batch, micro batch size)
PADDED_GEOMETRIES: list[tuple[str, int, int, int, int | None, int]] = [
    ("padded 64/dp4 budget 16K", 64, 4, 20, 16384, 1),
    ("padded 48/dp2 mbs 4", 48, 2, 20, None, 4),
]


@cache
def pool_stream(count: int, capacity: int) -> np.ndarray:
    stream = mixed_stream(load_pools(find_pool_dir()), count, capacity, seed=7)
    stream.setflags(write=False)
    return stream


def _digest(rows: list[Any]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:32]


def packed_digest(batch: int, capacity: int, dp: int, steps: int, options: dict[str, Any], *,
                  hand_out: bool = True) -> str:
    """Every field of every step; without ``hand_out``, what each step takes (its examples, bin
    count, padding, deferral, drift) but not which bin or rank an example went to: the hand-out
    to ranks cannot change that part."""
    from megatron_packing import DPAlignedPackingBatchSampler

    lengths = pool_stream(batch * steps + batch, capacity)
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, batch, dp, bin_capacity=capacity,
        total_steps=steps, oversize_policy="truncate", **options)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in sampler:
            plan = step.plan
            placed = ([[list(b) for b in plan.bins], [list(r) for r in plan.rank_bins]]
                      if hand_out else [plan.num_bins])
            rows.append([list(plan.example_indices), *placed, plan.packed_bins,
                         plan.padding_bins, plan.placeholder_bins, plan.aligned,
                         list(plan.deferred), plan.drift, sorted(plan.truncated.items()),
                         plan.num_tokens])
    assert len(rows) == steps
    return _digest(rows)


def padded_digest(batch: int, dp: int, steps: int, max_tokens: int | None,
                  micro_batch_size: int) -> str:
    from megatron_packing.padded.sampler import TokenBudgetBatchSampler

    lengths = pool_stream(batch * steps, 16384)
    rows = []
    for rank in range(dp):
        sampler = TokenBudgetBatchSampler(
            SequentialSampler(range(len(lengths))), lengths, batch, dp, dp_rank=rank,
            max_tokens_per_microbatch=max_tokens, micro_batch_size=micro_batch_size)
        for step in sampler:
            rows.append([rank, list(step.plan.schedule), step.plan.microbatches_per_rank,
                         list(step.plan.rank_padded_tokens)])
    return _digest(rows)


class LengthsOnly:
    """A dataset the loader can plan from without reading examples (lengths and loss counts)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths
        self.loss_token_counts = lengths // 2

    def __len__(self) -> int:
        return len(self.lengths)


def config_path_digest(steps: int, keys: dict[str, Any]) -> str:
    """Plans of the sampler the loader builds from a `PackingConfig` (random order, seeded)."""
    from megatron_packing.config import PackingConfig
    from megatron_packing.packed.components import build_packing_sampler

    config = PackingConfig.from_dict(keys).validate(4)
    dataset = LengthsOnly(pool_stream(config.global_batch_size * steps, config.bin_capacity))
    sampler = build_packing_sampler(dataset, config, dp_rank=None, dp_size=4, total_steps=steps)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in sampler:
            plan = step.plan
            rows.append([list(plan.example_indices), [list(b) for b in plan.bins],
                         [list(r) for r in plan.rank_bins], plan.num_loss_tokens, plan.drift])
    return _digest(rows)


CONFIG_GEOMETRIES: list[tuple[str, int, dict[str, Any]]] = [
    ("config 64/8K/dp4 seed 99", 25, {"global_batch_size": 64, "bin_capacity": 8192,
                                      "align_packing_bins_to_dp": True, "seed": 99,
                                      "oversize_policy": "own_bin", "lookahead_steps": 2}),
]


def current_digests() -> dict[str, str]:
    digests = {name: packed_digest(b, c, dp, steps, options)
               for name, b, c, dp, steps, options in PACKED_GEOMETRIES}
    digests.update({name: padded_digest(b, dp, steps, budget, mbs)
                    for name, b, dp, steps, budget, mbs in PADDED_GEOMETRIES})
    digests.update({name: config_path_digest(steps, keys) for name, steps, keys in CONFIG_GEOMETRIES})
    return digests


if __name__ == "__main__":
    print(json.dumps(current_digests(), indent=4))
