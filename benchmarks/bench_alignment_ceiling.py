"""How many steps can align at all: the offline best contiguous path against the planners.

With the batch-size window, boundary j may sit anywhere within +-v of j x B, and consecutive
boundaries within v of each other. A dynamic programme over every (step, offset) pair, packing
every segment with MFFD, finds the path that aligns the most steps
(`megatron_packing.packing.reference.contiguous_path_bounds`). No online planner that takes
contiguous steps and uses the packer's natural counts can beat it; bounded deferral is not
contiguous and can. The same programme gives the fewest bins (padded to dp) of any contiguous
path. Prints a table; not a timed test.

    python benchmarks/bench_alignment_ceiling.py [--steps 200] [--geometries B/C/dp,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Report  # noqa: E402

from megatron_packing.common.validation import allowed_batch_variation  # noqa: E402
from megatron_packing.packing.reference import contiguous_path_bounds  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402
from megatron_packing.reports.simulation import compare  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-deferred", type=int, default=8)
    parser.add_argument("--geometries", default="128/4096/8,128/4096/4",
                        help="B/capacity/dp,... (the path packs about (2v+1)^2 segments a step)")
    parser.add_argument("--out", default=None, help="also save the table here")
    args = parser.parse_args()
    geometries = [tuple(int(x) for x in g.split("/")) for g in args.geometries.split(",")]
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    report.print("| B / capacity / dp | steps | aligned: fixed B | exhaustive | project "
                 f"| project + deferral (<= {args.max_deferred}) | best contiguous path (offline) "
                 "| bins: exhaustive | project | + deferral | fewest of any contiguous path (offline) |")
    report.print("|---" * 11 + "|")
    for batch, capacity, dp in geometries:
        lengths = mixed_stream(pools, batch * args.steps, capacity, seed=args.seed)
        common = dict(batch_size=batch, capacity=capacity, dp_size=dp, steps=args.steps)
        fixed, exhaustive, ours, deferred = compare(
            lengths, max_deferred_examples=args.max_deferred, **common)
        ceiling, fewest = contiguous_path_bounds(
            lengths, batch_size=batch, capacity=capacity, dp_size=dp,
            v=allowed_batch_variation(batch, 0.05), steps=args.steps)
        report.print(
            f"| {batch} / {capacity} / {dp} | {args.steps} | {fixed.aligned_fraction:.1%} "
            f"| {exhaustive.aligned_fraction:.1%} | {ours.aligned_fraction:.1%} "
            f"| {deferred.aligned_fraction:.1%} | {ceiling / args.steps:.1%} "
            f"| {exhaustive.bins:,} | {ours.bins:,} | {deferred.bins:,} | {fewest:,} |")
    report.save()


if __name__ == "__main__":
    main()
