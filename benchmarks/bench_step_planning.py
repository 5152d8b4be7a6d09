"""Planning time per step of DPAlignedPackingBatchSampler against the exhaustive reference.

By default B / capacity / dp = 1024 / 65,536 / 8 (100 steps) and 4096 / 131,072 / 64 (30 steps:
the exhaustive search packs 409 sizes of about 4,096 examples a step), variation 0.05, on a
mixed pool drawn from the shipped real SFT length pools (a source drawn uniformly, then a
length, clipped to capacity). Both planners run in this one process on the same example
stream, one after the other. Packer runs are counted, for both. Targets: median <= 3 ms and
p99 <= 10 ms at 1024 / dp 8, median <= 15 ms at 4096 / 128K / dp 64. The sampler runs once per
``--rank-assignments`` value (its plan time includes handing the work to ranks), and once per
``--microbatch-costs`` value (``microbatch_cost_tokens``: the planner weighs its micro-batches,
the hand-out its ranks, with it), ``--rounds`` times alternating. ``--paired M`` instead plans
the same stream with ``microbatch_cost_tokens`` 0 and M side by side, step by step in one
thread (on a machine shared with other jobs, a slow moment then falls on both): each one's
median and p99, and the median of the per-step differences. Prints a markdown table; not a
timed test.

    nice -n 10 python benchmarks/bench_step_planning.py [--geometries 1024/65536/8/100,...]
        [--rank-assignments karmarkar_karp,rebalanced] [--microbatch-costs 0,2048]
        [--rounds N] [--no-exhaustive] [--paired M] [--cpu-time] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
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
    parser.add_argument("--microbatch-costs", default="0",
                        help="microbatch_cost_tokens values to time the sampler with, "
                             "comma-separated")
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds over every sampler setting, alternating (default 1)")
    parser.add_argument("--no-exhaustive", action="store_true",
                        help="time the sampler only (the speed-up column is then left out)")
    parser.add_argument("--paired", type=float, default=None, metavar="M",
                        help="plan with microbatch_cost_tokens 0 and M step by step side by side")
    parser.add_argument("--out", default=None, help="also save the table here")
    args = parser.parse_args()
    report = Report(args.out)
    if args.paired is not None:
        paired(args, report)
        return
    pools = load_pools(find_pool_dir())
    if args.cpu_time:
        # Both planners time their steps with time.perf_counter; read the thread's CPU clock.
        time.perf_counter = time.thread_time
    clock = "thread CPU time" if args.cpu_time else "wall time"
    report.print(f"mixed pool, variation 0.05; plan ms per step ({clock})")
    report.print()
    report.print("| B / capacity / dp | steps | planner | round | plan ms median | plan ms p99 "
                 "| speed-up (median) | aligned steps | bins | padding bins | packer runs / step |")
    report.print("|---|---|---|---|---|---|---|---|---|---|---|")
    costs = [float(m) for m in args.microbatch_costs.split(",")]
    for geometry in args.geometries.split(","):
        batch, capacity, dp, steps = (int(x) for x in geometry.split("/"))
        lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)
        common = dict(batch_size=batch, capacity=capacity, dp_size=dp, steps=steps)
        ref = None if args.no_exhaustive else simulate_exhaustive(lengths, **common)
        v = allowed_batch_variation(batch, 0.05)
        medians: dict[str, list[float]] = {}
        rows = [] if ref is None else [("exhaustive", "-", ref)]
        for round_ in range(1, args.rounds + 1):
            for m in costs:
                for method in args.rank_assignments.split(","):
                    name = f"megatron_packing ({method}" + (f", m = {m:g})" if m else ")")
                    run = simulate(lengths, align=True, rank_assignment=method,
                                   microbatch_cost_tokens=m, **common)
                    rows.append((name, str(round_), run))
                    medians.setdefault(name, []).append(run.plan_ms_median)
        for name, round_, run in rows:
            speed = "-" if ref is None else f"{ref.plan_ms_median / run.plan_ms_median:.1f}x"
            report.print(
                f"| {batch} / {capacity} / {dp} (v={v}) | {steps} | {name} | {round_} "
                f"| {run.plan_ms_median:.2f} | {run.plan_ms_p99:.2f} "
                f"| {speed} | {run.aligned_fraction:.1%} "
                f"| {run.bins:,} | {run.padding_bins:,} | {run.packer_runs_mean:.1f} |")
        if args.rounds > 1:
            report.print()
            for name, values in medians.items():
                report.print(f"{batch} / {capacity} / {dp}, {name}: plan ms median over the "
                             f"rounds {np.median(values):.2f} (rounds: "
                             + ", ".join(f"{x:.2f}" for x in values) + ")")
            report.print()
    report.save()


def paired(args: argparse.Namespace, report: Report) -> None:
    """Two samplers, microbatch_cost_tokens 0 and M, planned step by step in alternation."""
    import warnings

    from torch.utils.data import SequentialSampler

    from megatron_packing import DPAlignedPackingBatchSampler

    pools = load_pools(find_pool_dir())
    if args.cpu_time:
        time.perf_counter = time.thread_time
    clock = "thread CPU time" if args.cpu_time else "wall time"
    report.print(f"mixed pool, variation 0.05, rank_assignment rebalanced; plan ms per step "
                 f"({clock}), microbatch_cost_tokens 0 and {args.paired:g} planned side by side")
    report.print()
    report.print("| B / capacity / dp | steps | microbatch_cost_tokens | plan ms median | plan ms p99 "
                 "| same plan as m = 0 | median per-step difference (ms) |")
    report.print("|---|---|---|---|---|---|---|")
    for geometry in args.geometries.split(","):
        batch, capacity, dp, steps = (int(x) for x in geometry.split("/"))
        lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)
        samplers = [DPAlignedPackingBatchSampler(
            SequentialSampler(range(len(lengths))), lengths, batch, dp, bin_capacity=capacity,
            total_steps=steps, oversize_policy="truncate", microbatch_cost_tokens=m)
            for m in (0.0, args.paired)]
        times: list[list[float]] = [[], []]
        same = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for plain, charged in zip(*(iter(s) for s in samplers), strict=True):
                times[0].append(plain.plan.plan_ms)
                times[1].append(charged.plan.plan_ms)
                same += (plain.plan.bins, plain.plan.rank_bins) == (charged.plan.bins,
                                                                    charged.plan.rank_bins)
        difference = float(np.median(np.subtract(times[1], times[0])))
        for m, values in zip((0.0, args.paired), times, strict=True):
            report.print(f"| {batch} / {capacity} / {dp} | {len(values)} | {m:g} "
                         f"| {np.median(values):.2f} | {np.percentile(values, 99):.2f} "
                         f"| {'-' if m == 0 else f'{same} of {len(values)} steps'} "
                         f"| {'-' if m == 0 else f'{difference:+.3f}'} |")
    report.save()


if __name__ == "__main__":
    main()
