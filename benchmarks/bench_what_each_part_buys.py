"""What each part of the project buys in modeled step time: the packer, the rank hand-out and the
DP alignment, under three cost models.

A ladder of planners over one example stream, each adding one part to the one before:

1. Megatron-LM's ``dp_balanced``: exactly B examples a step, next-fit, single examples split off
   the last bins to a multiple of dp, bin k to rank k mod dp (`packing.dp_balanced`);
2. + the packer: the same B examples packed by MFFD, the bins raised to a multiple of dp by
   splitting the heaviest (`dp_rounding.round_to_dp`), still bin k to rank k mod dp (the sampler
   with ``align_packing_bins_to_dp: false, rank_assignment: round_robin``);
3. + the rank hand-out: the same bins handed out by cost, whole bins then single examples moved
   (``rank_assignment: rebalanced``, the default);
4. + DP alignment: the step's size varies within B +- v so that its bin count divides by dp
   (``align_packing_bins_to_dp: true``): this planner.

Each rung's modeled time per 1,000 examples (`packing.step_time`: per rank the sum over its bins
of m + s + s^2/k, k = 24,576; a step lasts as long as its slowest rank) is compared with the
rung before, under: m = 0 (the default: a micro-batch costs nothing of its own); m = M, a
representative per-micro-batch cost; and rows padded to the capacity (``pad_bins_to_capacity``,
static shapes: every bin's linear work is the whole row), with m = 0 and with m = M. The planner
and the hand-out run with the m they are timed with (``microbatch_cost_tokens``); padding the
rows changes no plan.

M is ASSUMED, NOT CALIBRATED: no GPU was available here. The default M = 2,048 tokens comes from
a fixed cost of 0.5-2.3 ms per micro-batch per layer measured on one H200 (issue 40) against
about 0.4-0.5 us of linear work per token per layer at hidden 2048 (6 x 51M parameters' FLOPs
at about 700 TFLOP/s), that is about 1,100-5,000 tokens; ``megatron-packing calibrate`` measures
it on the user's GPU. A sweep of m at two geometries shows how the answer moves with it. Prints
markdown; not a timed test.

    nice -n 10 python benchmarks/bench_what_each_part_buys.py [--assumed-m 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Report  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402

from megatron_packing import DPAlignedPackingBatchSampler  # noqa: E402
from megatron_packing.packing.dp_balanced import plan_stream  # noqa: E402
from megatron_packing.packing.step_time import step_times  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402

K = 1024
GEOMETRIES = ((128, 4 * K, 8, 150), (1024, 64 * K, 8, 40), (512, 16 * K, 32, 60))
SWEEP_GEOMETRIES = ((128, 4 * K, 8, 150), (1024, 64 * K, 8, 40))
RUNGS = ("dp_balanced (Megatron-LM)", "+ packer (MFFD, fixed B)", "+ rank hand-out (rebalanced)",
         "+ DP alignment (this planner)")
PARTS = ("the packer's fill", "the rank hand-out", "the DP alignment", "all three")
Steps = list[tuple[list[list[int]], list[list[int]]]]


@dataclass
class Run:
    """One rung's plans: per step (each bin's lengths, each rank's bin ids), and its examples."""

    steps: Steps
    examples: int

    def per_1000(self, capacity: int, m: float, rows: bool) -> float:
        times = step_times(self.steps, microbatch_cost=m, row_tokens=capacity if rows else None)
        return times.total / self.examples * 1000

    def fill(self, capacity: int) -> float:
        bins = sum(len(b) for b, _ in self.steps)
        return sum(sum(map(sum, b)) for b, _ in self.steps) / (bins * capacity)

    def micro_batches(self) -> float:
        return float(np.mean([len(b) / len(r) for b, r in self.steps]))


def sampler_run(lengths: np.ndarray, batch: int, capacity: int, dp: int, steps: int, *,
                align: bool, method: str, m: float) -> Run:
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, batch, dp, bin_capacity=capacity,
        total_steps=steps, align_to_dp=align, oversize_policy="truncate", rank_assignment=method,
        microbatch_cost_tokens=m)
    out: Steps = []
    examples = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch_plan in sampler:
            plan = batch_plan.plan
            out.append(([sampler.effective_lengths[list(b)].tolist() for b in plan.bins],
                        [list(r) for r in plan.rank_bins]))
            examples += plan.num_examples
    return Run(out, examples)


def reference_run(lengths: np.ndarray, batch: int, capacity: int, dp: int, steps: int) -> Run:
    kept = np.minimum(lengths[:batch * steps], capacity)
    out: Steps = []
    for start, step in plan_stream(kept, batch, capacity, dp, steps):
        out.append(([[int(kept[start + p]) for p in b] for b in step.bins], step.rank_bins))
    return Run(out, len(kept))


def ladder(lengths: np.ndarray, batch: int, capacity: int, dp: int, steps: int,
           m: float) -> list[Run]:
    common = dict(batch=batch, capacity=capacity, dp=dp, steps=steps, m=m)
    return [reference_run(lengths, batch, capacity, dp, steps),
            sampler_run(lengths, align=False, method="round_robin", **common),
            sampler_run(lengths, align=False, method="rebalanced", **common),
            sampler_run(lengths, align=True, method="rebalanced", **common)]


def change(after: float, before: float) -> str:
    return f"{(after / before - 1) * 100:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--assumed-m", type=float, default=2048.0,
                        help="the representative per-micro-batch cost in tokens (ASSUMED, not "
                             "calibrated; default 2048)")
    parser.add_argument("--sweep", default="0,512,2048,8192,32768",
                        help="per-micro-batch costs for the sweep at 128 / 4K / dp 8 and "
                             "1024 / 64K / dp 8")
    parser.add_argument("--out", default=None, help="also save the tables here")
    args = parser.parse_args()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    assumed = args.assumed_m
    settings = ((0.0, False, "m = 0"), (assumed, False, f"m = {assumed:g}"),
                (0.0, True, "full rows, m = 0"), (assumed, True, f"full rows, m = {assumed:g}"))
    report.print(f"Mixed pool (seed {args.seed}), variation 0.05, MFFD, k = 24,576. "
                 f"m = {assumed:g} tokens per micro-batch is ASSUMED, NOT CALIBRATED (no GPU "
                 "here; see the docstring); `megatron-packing calibrate` measures it.")
    report.print()
    report.print("Change in modeled time per 1,000 examples that each part brings (negative: "
                 "faster), against the rung before it; 'all three': this planner against "
                 "dp_balanced.")
    report.print()
    report.print("| B / C / dp | part | " + " | ".join(s[2] for s in settings) + " |")
    report.print("|---|---|" + "---|" * len(settings))
    absolute: list[str] = []
    for batch, capacity, dp, steps in GEOMETRIES:
        lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)
        runs = {m: ladder(lengths, batch, capacity, dp, steps, m) for m in {0.0, assumed}}
        name = f"{batch} / {capacity // K}K / {dp}"
        times = {s: [run.per_1000(capacity, s[0], s[1]) for run in runs[s[0]]] for s in settings}
        for part, (before, after) in zip(PARTS, ((0, 1), (1, 2), (2, 3), (0, 3)), strict=True):
            report.print(f"| {name} | {part} | " + " | ".join(
                change(times[s][after], times[s][before]) for s in settings) + " |")
        for rung, (plain, charged) in enumerate(zip(runs[0.0], runs[assumed], strict=True)):
            absolute.append(
                f"| {name} | {RUNGS[rung]} | {plain.fill(capacity):.2%} "
                f"| {plain.micro_batches():.2f} / {charged.micro_batches():.2f} | "
                + " | ".join(f"{times[s][rung] / 1e3:,.1f}" for s in settings) + " |")
    report.print()
    report.print("Each rung's figures (micro-batches per rank: planned with m = 0 / with m = "
                 f"{assumed:g}; modeled time per 1,000 examples in thousands of tokens of work):")
    report.print()
    report.print("| B / C / dp | rung | fill | micro-batches / rank | "
                 + " | ".join(s[2] for s in settings) + " |")
    report.print("|---|---|---|---|" + "---|" * len(settings))
    for line in absolute:
        report.print(line)

    report.print()
    report.print("Sweep of m (rows as long as their tokens; each m planned and timed with itself; "
                 "m is what a micro-batch costs in tokens, so it weighs most beside a small "
                 "capacity):")
    report.print()
    report.print("| B / C / dp | m | " + " | ".join(PARTS)
                 + " | micro-batches / rank, this planner |")
    report.print("|---|---|" + "---|" * (len(PARTS) + 1))
    for batch, capacity, dp, steps in SWEEP_GEOMETRIES:
        lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)
        for m in (float(x) for x in args.sweep.split(",")):
            runs_m = ladder(lengths, batch, capacity, dp, steps, m)
            t = [run.per_1000(capacity, m, False) for run in runs_m]
            report.print(f"| {batch} / {capacity // K}K / {dp} | {m:g} | " + " | ".join(
                change(t[a], t[b]) for b, a in ((0, 1), (1, 2), (2, 3), (0, 3)))
                + f" | {runs_m[3].micro_batches():.2f} |")
    report.save()


if __name__ == "__main__":
    main()
