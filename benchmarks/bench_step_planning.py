"""Planning time per step of DPAlignedPackingBatchSampler against the exhaustive reference.

B=1024, capacity 65,536, variation 0.05, dp in {4, 8, 64}, on a mixed pool drawn from the
shipped real SFT length pools (a source drawn uniformly, then a length, clipped to capacity).
Both planners see the same example stream. Packer runs are counted, for both. Prints a markdown
table; not a timed test.

    python benchmarks/bench_step_planning.py [--steps 100] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Report  # noqa: E402

from megatron_packing.simulation import (  # noqa: E402
    find_pool_dir,
    load_pools,
    mixed_stream,
    simulate,
    simulate_exhaustive,
)
from megatron_packing.validation import allowed_batch_variation  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--dp", default="4,8,64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also save the table here")
    args = parser.parse_args()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    batch, capacity, steps = args.batch_size, args.capacity, args.steps
    v = allowed_batch_variation(batch, 0.05)
    lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)
    report.print(f"mixed pool, B={batch}, capacity={capacity}, variation 0.05 (v={v}), {steps} steps")
    report.print()
    report.print("| dp | planner | plan ms median | plan ms p99 | speed-up (median) | aligned steps "
                 "| bins | padding bins | packer runs / step |")
    report.print("|---|---|---|---|---|---|---|---|---|")
    for dp in (int(x) for x in args.dp.split(",")):
        common = dict(batch_size=batch, capacity=capacity, dp_size=dp, steps=steps)
        ref = simulate_exhaustive(lengths, **common)
        ours = simulate(lengths, align=True, **common)
        for name, run in (("exhaustive", ref), ("megatron_packing", ours)):
            report.print(
                f"| {dp} | {name} | {run.plan_ms_median:.2f} | {run.plan_ms_p99:.2f} "
                f"| {ref.plan_ms_median / run.plan_ms_median:.1f}x | {run.aligned_fraction:.1%} "
                f"| {run.bins:,} | {run.padding_bins:,} | {run.packer_runs_mean:.1f} |")
    report.save()


if __name__ == "__main__":
    main()
