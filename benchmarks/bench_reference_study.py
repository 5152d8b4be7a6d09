"""The planner against fixed batches, the exhaustive reference and the offline best path.

Six geometries (B / capacity / dp), 677 steps each, variation 0.05, on the shipped mixed pool (a
source drawn uniformly, then a length, clipped to capacity; one stream per geometry, the same for
every planner). Columns: fixed B (bins rounded up to dp), the exhaustive reference (every size of
every window packed, no lookahead), the project's default planner, the planner with bounded
deferral, and the offline best contiguous path (only where it is affordable: it packs about
(2v+1)^2 segments per step). Prints markdown tables; not a timed test.

    python benchmarks/bench_reference_study.py [--steps 677] [--out FILE]
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
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402
from megatron_packing.reports.simulation import (  # noqa: E402
    compare,
    format_comparison,
    offline_best_paths,
)

GEOMETRIES = ((1024, 65536, 4), (1024, 65536, 8), (256, 16384, 8), (512, 32768, 16),
              (128, 4096, 8), (128, 4096, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=677)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-deferred", type=int, default=8)
    parser.add_argument("--ceiling-max-window", type=int, default=25,
                        help="compute the offline best path only when 2v+1 is at most this")
    parser.add_argument("--geometries", default=None,
                        help="B/capacity/dp,... (default: the six of the study)")
    parser.add_argument("--out", default=None, help="also save the tables here")
    args = parser.parse_args()
    geometries = GEOMETRIES if not args.geometries else [
        tuple(int(x) for x in g.split("/")) for g in args.geometries.split(",")]
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    summary = []
    for batch, capacity, dp in geometries:
        lengths = mixed_stream(pools, batch * args.steps, capacity, seed=args.seed)
        common = dict(batch_size=batch, capacity=capacity, dp_size=dp, steps=args.steps)
        runs = compare(lengths, max_deferred_examples=args.max_deferred, **common)
        v = allowed_batch_variation(batch, 0.05)
        best = (offline_best_paths(lengths, **common)
                if 2 * v + 1 <= args.ceiling_max_window else None)
        title = f"B={batch}, capacity={capacity:,}, dp={dp}, {args.steps} steps"
        report.print(format_comparison(runs, title, best))
        report.print()
        summary.append((batch, capacity, dp, runs, best))

    report.print(f"### Summary ({args.steps} steps; deferral: at most {args.max_deferred} examples)")
    report.print()
    report.print("| B / capacity / dp | bins: fixed B | exhaustive | project | project + deferral "
                 "| padding bins: exhaustive | project | + deferral "
                 "| aligned: exhaustive | project | + deferral | best path (offline) "
                 "| token CV: fixed B | project | + deferral | plan ms median / p99: project "
                 "| + deferral | packer runs / step: exhaustive | project | + deferral |")
    report.print("|---" * 20 + "|")
    for batch, capacity, dp, (fixed, exhaustive, ours, deferred), paths in summary:
        best_share = "not run" if paths is None else f"{paths.aligned_steps / args.steps:.1%}"
        report.print(
            f"| {batch} / {capacity // 1024}K / {dp} | {fixed.bins:,} | {exhaustive.bins:,} "
            f"| {ours.bins:,} | {deferred.bins:,} | {exhaustive.padding_bins:,} "
            f"| {ours.padding_bins:,} | {deferred.padding_bins:,} | {exhaustive.aligned_fraction:.1%} "
            f"| {ours.aligned_fraction:.1%} | {deferred.aligned_fraction:.1%} | {best_share} "
            f"| {fixed.token_cv:.2%} | {ours.token_cv:.2%} | {deferred.token_cv:.2%} "
            f"| {ours.plan_ms_median:.2f} / {ours.plan_ms_p99:.1f} "
            f"| {deferred.plan_ms_median:.2f} / {deferred.plan_ms_p99:.1f} "
            f"| {exhaustive.packer_runs_mean:.1f} | {ours.packer_runs_mean:.1f} "
            f"| {deferred.packer_runs_mean:.1f} |")
    report.save()


if __name__ == "__main__":
    main()
