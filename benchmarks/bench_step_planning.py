"""Planning time per step of DPAlignedPackingBatchSampler against an exhaustive reference.

B=1024, capacity 65,536, variation 0.05, dp in {4, 8, 64}, on a mixed pool drawn from the
shipped real SFT length pools (a source drawn uniformly, then a length, clipped to capacity).
Both planners see the same example stream. Prints a markdown table; not a timed test.

    python benchmarks/bench_step_planning.py [--steps 100]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from exhaustive_planner import plan_exhaustively  # noqa: E402

from megatron_packing.config import allowed_batch_variation  # noqa: E402
from megatron_packing.simulation import find_pool_dir, load_pools, mixed_stream, simulate  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--dp", default="4,8,64")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pools = load_pools(find_pool_dir())
    batch, capacity, steps = args.batch_size, args.capacity, args.steps
    v = allowed_batch_variation(batch, 0.05)
    lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)
    print(f"mixed pool, B={batch}, capacity={capacity}, variation 0.05 (v={v}), {steps} steps\n")
    print("| dp | planner | plan ms median | plan ms p99 | speed-up (median) | aligned steps "
          "| padding bins | packer runs / step |")
    print("|---|---|---|---|---|---|---|---|")
    for dp in (int(x) for x in args.dp.split(",")):
        ours = simulate(lengths, batch_size=batch, capacity=capacity, dp_size=dp, steps=steps,
                        align=True)
        ref = plan_exhaustively(lengths, batch_size=batch, capacity=capacity, dp_size=dp,
                                variation=v, steps=steps)
        ref_median = float(np.median(ref["plan_ms"]))
        print(f"| {dp} | exhaustive | {ref_median:.2f} | {np.percentile(ref['plan_ms'], 99):.2f} "
              f"| 1.0x | {ref['aligned_steps'] / steps:.1%} | {ref['padding_bins']} "
              f"| {2 * v + 1} |")
        print(f"| {dp} | megatron_packing | {ours.plan_ms_median:.2f} | {ours.plan_ms_p99:.2f} "
              f"| {ref_median / ours.plan_ms_median:.1f}x | {ours.aligned_fraction:.1%} "
              f"| {ours.padding_bins} | {ours.packs_mean:.1f} |", flush=True)


if __name__ == "__main__":
    main()
