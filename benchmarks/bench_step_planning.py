"""Planning time per step of DPAlignedPackingBatchSampler against the exhaustive reference.

By default B / capacity / dp = 1024 / 65,536 / 8 (100 steps) and 4096 / 131,072 / 64 (30 steps:
the exhaustive search packs 409 sizes of about 4,096 examples a step), variation 0.05, on a
mixed pool drawn from the shipped real SFT length pools (a source drawn uniformly, then a
length, clipped to capacity). Both planners run in this one process on the same example
stream, one after the other. Packer runs are counted, for both. Targets: median <= 3 ms and
p99 <= 10 ms at 1024 / dp 8, median <= 15 ms at 4096 / 128K / dp 64. The sampler runs once per
``--rank-assignments`` value (its plan time includes handing the work to ranks). Prints a
markdown table; not a timed test.

    nice -n 10 python benchmarks/bench_step_planning.py [--geometries 1024/65536/8/100,...]
        [--rank-assignments karmarkar_karp,rebalanced] [--cpu-time] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Report  # noqa: E402

from megatron_packing.common.validation import allowed_batch_variation  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402
from megatron_packing.reports.simulation import simulate, simulate_exhaustive  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--geometries", default="1024/65536/8/100,4096/131072/64/30",
                        help="B/capacity/dp/steps,...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank-assignments", default="karmarkar_karp,rebalanced",
                        help="the sampler's rank_assignment values to time, comma-separated")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each plan in this thread's CPU time instead of wall time (on "
                             "a machine shared with other jobs: time spent waiting for a core "
                             "is left out)")
    parser.add_argument("--out", default=None, help="also save the table here")
    args = parser.parse_args()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    if args.cpu_time:
        # Both planners time their steps with time.perf_counter; read the thread's CPU clock.
        time.perf_counter = time.thread_time
    clock = "thread CPU time" if args.cpu_time else "wall time"
    report.print(f"mixed pool, variation 0.05; plan ms per step ({clock})")
    report.print()
    report.print("| B / capacity / dp | steps | planner | plan ms median | plan ms p99 "
                 "| speed-up (median) | aligned steps | bins | padding bins | packer runs / step |")
    report.print("|---|---|---|---|---|---|---|---|---|---|")
    for geometry in args.geometries.split(","):
        batch, capacity, dp, steps = (int(x) for x in geometry.split("/"))
        lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)
        common = dict(batch_size=batch, capacity=capacity, dp_size=dp, steps=steps)
        ref = simulate_exhaustive(lengths, **common)
        ours = [(f"megatron_packing ({method})",
                 simulate(lengths, align=True, rank_assignment=method, **common))
                for method in args.rank_assignments.split(",")]
        v = allowed_batch_variation(batch, 0.05)
        for name, run in (("exhaustive", ref), *ours):
            report.print(
                f"| {batch} / {capacity} / {dp} (v={v}) | {steps} | {name} "
                f"| {run.plan_ms_median:.2f} | {run.plan_ms_p99:.2f} "
                f"| {ref.plan_ms_median / run.plan_ms_median:.1f}x | {run.aligned_fraction:.1%} "
                f"| {run.bins:,} | {run.padding_bins:,} | {run.packer_runs_mean:.1f} |")
    report.save()


if __name__ == "__main__":
    main()
