"""Two references to measure the step planner against; pure numpy, no torch.

- `plan_exhaustively`: the straightforward online planner. Every step packs every size of its
  window (target, target+1, target-1, ...), takes the first whose bin count divides by dp, or
  else the fewest padding bins, then the size nearest the target. No lookahead.
- `contiguous_path_bounds`: offline, over every admissible path of contiguous step boundaries
  (boundary j within +-v of j x B, consecutive boundaries within v of each other, the last step
  repaying the drift), the most steps whose packed bin count divides by dp, and the fewest bins
  after rounding each step's count up to dp. No online planner that takes contiguous steps and
  uses the packer's natural counts can align more steps or use fewer bins.

Both consume exactly ``steps x B`` examples in ``steps`` steps, as a run with that horizon does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from megatron_packing.packing.dp_rounding import first_multiple, round_to_dp
from megatron_packing.packing.factory import make_seq_packer
from megatron_packing.packing.planner.window import StepContext


@dataclass
class ReferenceRun:
    """What a reference planner measured over a stream."""

    steps: int
    bins: int  # packed bins plus padding bins
    padding_bins: int
    aligned_steps: int
    sizes: list[int]
    step_tokens: list[int]
    plan_ms: np.ndarray
    packer_runs: list[int]  # packer runs counted per step
    step_bins: list[list[list[int]]] = field(default_factory=list)  # per step, each bin's lengths

    @property
    def aligned_fraction(self) -> float:
        return self.aligned_steps / self.steps if self.steps else 0.0


def _padding(count: int, dp: int) -> int:
    return first_multiple(count, dp) - count


def plan_exhaustively(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int,
                      v: int, steps: int, algorithm: str = "mffd") -> ReferenceRun:
    """Plan ``steps`` steps over ``lengths``, packing every size of each step's window."""
    packer = make_seq_packer(algorithm, bin_capacity=capacity, oversize_policy="truncate")
    if len(lengths) < steps * batch_size:
        raise ValueError(f"{steps} steps of {batch_size} need {steps * batch_size} lengths, "
                         f"got {len(lengths)}")
    lengths = np.asarray(packer.effective_lengths(lengths[:steps * batch_size]), dtype=np.int64)
    position, drift = 0, 0
    plan_ms, sizes, tokens, runs = [], [], [], []
    step_bins: list[list[list[int]]] = []
    bins = padding = aligned = 0
    for step in range(steps):
        started = time.perf_counter()
        context = StepContext(batch_size, v, drift, len(lengths) - position,
                              steps - step, steps - step)
        lowest, highest, target = context.window()
        order = [target] + [k for d in range(1, highest - lowest + 1)
                            for k in (target + d, target - d) if lowest <= k <= highest]
        results = []
        packings = {}
        for size in order:
            packings[size] = packer.pack(lengths[position:position + size])
            count = len(packings[size])
            results.append((_padding(count, dp_size), abs(size - target), size, count))
        chosen = next((r for r in results if r[0] == 0), None) or min(results)
        plan_ms.append((time.perf_counter() - started) * 1e3)
        pad, _, size, count = chosen
        segment = lengths[position:position + size]
        # The padding bins as a padded step of the planner makes them (the heaviest split), for
        # the modeled step time.
        padded, _ = round_to_dp(packings[size], segment, dp_size)
        step_bins.append([[int(segment[i]) for i in b] for b in padded])
        runs.append(len(order))
        bins += count + pad
        padding += pad
        aligned += int(pad == 0)
        sizes.append(size)
        tokens.append(int(lengths[position:position + size].sum()))
        position += size
        drift += size - batch_size
    return ReferenceRun(steps, bins, padding, aligned, sizes, tokens, np.asarray(plan_ms), runs,
                        step_bins)


def contiguous_path_bounds(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int,
                           v: int, steps: int, algorithm: str = "mffd") -> tuple[int, int]:
    """Over every admissible contiguous path: (most aligned steps, fewest bins after padding
    each step's natural count up to a multiple of dp). Two dynamic programmes, one packing of
    each segment."""
    packer = make_seq_packer(algorithm, bin_capacity=capacity, oversize_policy="truncate")
    lengths = np.asarray(packer.effective_lengths(lengths), dtype=np.int64)
    batch = batch_size
    most = {0: 0}  # offset of the previous boundary from its nominal place -> most aligned so far
    fewest = {0: 0}  # the same boundary -> fewest bins so far
    for j in range(1, steps + 1):
        offsets = [0] if j == steps else range(-v, v + 1)  # the last step repays the drift
        next_most: dict[int, int] = {}
        next_fewest: dict[int, int] = {}
        for d1 in offsets:
            for d0 in most:
                if abs(d1 - d0) > v:
                    continue
                count = len(packer.pack(lengths[(j - 1) * batch + d0: j * batch + d1]))
                aligned = int(count % dp_size == 0 and count >= dp_size)
                bins = count + _padding(count, dp_size)
                next_most[d1] = max(next_most.get(d1, -1), most[d0] + aligned)
                next_fewest[d1] = min(next_fewest.get(d1, 1 << 62), fewest[d0] + bins)
        most, fewest = next_most, next_fewest
    return max(most.values()), min(fewest.values())
