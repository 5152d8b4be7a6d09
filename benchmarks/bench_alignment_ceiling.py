"""How many steps can align at all: the best boundary path, found offline, against our planner.

With the batch-size window, boundary j may sit anywhere within +-v of j x B, and consecutive
boundaries within v of each other. An exhaustive dynamic programme over every (step, offset)
pair, packing every segment with MFFD, finds the path that aligns the most steps. No online
planner that uses the packer's own bin counts can beat it, so it bounds what "steps aligned to
dp" can reach on a given pool and window. Prints a table; not a timed test.

    python benchmarks/bench_alignment_ceiling.py [--steps 200]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megatron_packing.config import allowed_batch_variation  # noqa: E402
from megatron_packing.packing.factory import make_seq_packer  # noqa: E402
from megatron_packing.simulation import find_pool_dir, load_pools, mixed_stream, simulate  # noqa: E402


def best_path_aligned(lengths, batch: int, capacity: int, dp: int, v: int, steps: int) -> int:
    """Most steps whose MFFD bin count divides by dp, over every admissible boundary path."""
    packer = make_seq_packer("mffd", bin_capacity=capacity, oversize_policy="truncate")
    best = {0: 0}  # offset of the previous boundary -> most aligned steps so far
    for j in range(1, steps + 1):
        offsets = [0] if j == steps else range(-v, v + 1)  # the last step repays the drift
        layer = {}
        for d1 in offsets:
            values = []
            for d0, value in best.items():
                if abs(d1 - d0) > v:
                    continue
                count = len(packer.pack(lengths[(j - 1) * batch + d0: j * batch + d1]))
                values.append(value + int(count % dp == 0 and count >= dp))
            if values:
                layer[d1] = max(values)
        best = layer
    return max(best.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pools = load_pools(find_pool_dir())
    print("| B / capacity / dp | steps | fixed batch | our planner | best path (offline) |")
    print("|---|---|---|---|---|")
    for batch, capacity, dp in ((128, 4096, 8), (128, 4096, 4)):
        lengths = mixed_stream(pools, batch * args.steps, capacity, seed=args.seed)
        v = allowed_batch_variation(batch, 0.05)
        common = dict(batch_size=batch, capacity=capacity, dp_size=dp, steps=args.steps)
        fixed = simulate(lengths, align=False, **common)
        ours = simulate(lengths, align=True, **common)
        ceiling = best_path_aligned(lengths, batch, capacity, dp, v, args.steps)
        print(f"| {batch} / {capacity} / {dp} | {args.steps} | {fixed.aligned_fraction:.1%} "
              f"| {ours.aligned_fraction:.1%} | {ceiling / args.steps:.1%} |", flush=True)


if __name__ == "__main__":
    main()
