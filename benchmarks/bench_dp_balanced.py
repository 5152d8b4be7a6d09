"""Megatron-LM's own online SFT packing (``dp_balanced``) against this planner, step by step.

Megatron-LM after core 0.19 packs SFT online with ``--sequence-packing-scheduler dp_balanced``:
each step takes exactly B samples, packs them next-fit in arrival order, splits single samples
off the last bins until the bin count divides by dp, and gives bin k to rank k mod dp
(`megatron_packing.packing.dp_balanced`, written from that behaviour). Here it runs over fixed
B's steps of one example stream, beside fixed B (this project's packer, bins rounded up to dp)
and this planner (the default sampler: aligned, rebalanced hand-out), all timed by one cost
model (`packing.step_time`: per rank, the sum over its bins of ``microbatch_cost_tokens`` plus
``s + s^2/k`` of each sequence, k = 24,576; a step lasts as long as its slowest rank).

Six geometries of the mixed pool (a source of the shipped length pools drawn uniformly, then a
length, clipped to the capacity) and three held-out pool mixes (short chat: alpaca + gsm8k; long
reasoning: long_cot_math + math_cot_instruct; long documents: leval_pairs + lima). Columns: bins,
extra bins (dp_balanced: the samples split off and placeholders; the others: padding bins), token
fill, modeled imbalance (mean slowest rank / mean rank), modeled time per 1,000 examples (in
thousands of tokens of linear work on the slowest rank) and its ratio to this planner's. Prints markdown; not a timed
test.

    nice -n 10 python benchmarks/bench_dp_balanced.py [--microbatch-cost-tokens M] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Report  # noqa: E402

from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402
from megatron_packing.reports.simulation import SimulationResult, compare  # noqa: E402

K = 1024
MIXED = "mixed (all six)"
MIXES = {
    MIXED: None,
    "short chat": ("alpaca_demo", "gsm8k"),
    "long reasoning": ("long_cot_math", "math_cot_instruct"),
    "long documents": ("leval_pairs", "lima"),
}
# (pool mix, B, capacity, dp, steps)
GEOMETRIES = (
    (MIXED, 128, 4 * K, 8, 150),
    (MIXED, 1024, 64 * K, 4, 40),
    (MIXED, 1024, 64 * K, 8, 40),
    (MIXED, 256, 8 * K, 16, 100),
    (MIXED, 512, 16 * K, 32, 60),
    (MIXED, 4096, 128 * K, 64, 12),
    ("short chat", 2048, 8 * K, 16, 30),
    ("long reasoning", 2048, 32 * K, 16, 30),
    ("long documents", 256, 32 * K, 16, 100),
)


def per_1000(run: SimulationResult) -> float:
    """Modeled time per 1,000 examples, in thousands of tokens of work."""
    return run.modeled_time / run.examples * 1000 / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--microbatch-cost-tokens", type=float, default=0.0,
                        help="the per-micro-batch cost the model charges (default 0)")
    parser.add_argument("--only", default=None, help="indices of GEOMETRIES to run, e.g. 0,3")
    parser.add_argument("--out", default=None, help="also save the table here")
    args = parser.parse_args()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    chosen = (GEOMETRIES if args.only is None
              else [GEOMETRIES[int(i)] for i in args.only.split(",")])
    report.print(f"variation 0.05, MFFD, rank_assignment rebalanced; modeled time: s + s^2/24576 "
                 f"per sequence, {args.microbatch_cost_tokens:g} per micro-batch; seed "
                 f"{args.seed}")
    report.print()
    report.print("| pool | B / C / dp | steps | planner | bins | extra bins | fill "
                 "| modeled imbalance | modeled time / 1,000 examples (K) | vs this planner |")
    report.print("|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for mix, batch, capacity, dp, steps in chosen:
        sources = MIXES[mix]
        chosen_pools = pools if sources is None else {n: pools[n] for n in sources}
        lengths = mixed_stream(chosen_pools, batch * steps, capacity, seed=args.seed)
        fixed, ours, reference = compare(
            lengths, batch_size=batch, capacity=capacity, dp_size=dp, steps=steps,
            exhaustive=False, dp_balanced=True,
            microbatch_cost_tokens=args.microbatch_cost_tokens)
        ratios.append(per_1000(reference) / per_1000(ours))
        for label, run in (("dp_balanced (Megatron-LM)", reference), ("fixed B", fixed),
                           ("this planner", ours)):
            report.print(
                f"| {mix} | {batch} / {capacity // K}K / {dp} | {steps} | {label} | {run.bins:,} "
                f"| {run.padding_bins:,} | {run.token_fill:.2%} | {run.step_time_imbalance:.4f} "
                f"| {per_1000(run):,.1f} | {per_1000(run) / per_1000(ours):.3f} |")
    report.print()
    report.print(f"dp_balanced takes {min(ratios):.3f}-{max(ratios):.3f}x this planner's modeled "
                 f"time per example (this planner {1 / max(ratios):.2f}-{1 / min(ratios):.2f}x "
                 "dp_balanced's).")
    report.save()


if __name__ == "__main__":
    main()
