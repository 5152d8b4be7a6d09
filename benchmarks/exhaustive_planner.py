"""Reference planner for benchmarks: packs every size in the window, every step.

It is the straightforward way to choose DP-aligned step sizes: for each candidate size, in the
order target, target+1, target-1, ..., run the full packer and take the first whose bin count
divides by dp; if none does, take the fewest padding bins, then the size nearest the target. It
has no lookahead. Kept here to measure the project's planner against, in the same run.
"""

from __future__ import annotations

import time

import numpy as np

from megatron_packing.packing.factory import make_seq_packer
from megatron_packing.packing.step_sizing import StepContext


def plan_exhaustively(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int,
                      variation: int, steps: int, algorithm: str = "mffd") -> dict:
    """Plan ``steps`` steps over ``lengths`` (one epoch of exactly steps x B examples)."""
    packer = make_seq_packer(algorithm, bin_capacity=capacity, oversize_policy="truncate")
    position, drift = 0, 0
    plan_ms, sizes, padding, aligned = [], [], 0, 0
    for step in range(steps):
        started = time.perf_counter()
        context = StepContext(batch_size, variation, drift, len(lengths) - position,
                              steps - step, steps - step)
        lowest, highest, target = context.window()
        order = [target] + [k for d in range(1, highest - lowest + 1)
                            for k in (target + d, target - d) if lowest <= k <= highest]
        results = []
        for size in order:
            count = len(packer.pack(lengths[position:position + size]))
            pad = max(dp_size, -(-count // dp_size) * dp_size) - count
            results.append((pad, abs(size - target), size))
        chosen = next((r for r in results if r[0] == 0), None) or min(results)
        plan_ms.append((time.perf_counter() - started) * 1e3)
        pad, _, size = chosen
        padding += pad
        aligned += int(pad == 0)
        sizes.append(size)
        position += size
        drift += size - batch_size
    return {
        "plan_ms": np.asarray(plan_ms),
        "sizes": sizes,
        "padding_bins": padding,
        "aligned_steps": aligned,
    }
