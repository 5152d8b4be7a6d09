"""The planner on geometries its constants were not tuned on, judged by modeled step time too.

The constants of `PlannerTunables` were chosen on six geometries of one mixed pool (B 128-1024,
capacity 4K-64K, dp 4-16). Here: three pool mixes from the shipped length pools (short chat:
alpaca + gsm8k; long reasoning: long_cot_math + math_cot_instruct; long documents: leval_pairs
+ lima; a source drawn uniformly, then a length, clipped to the capacity), B in {64, 256, 2048},
capacity in {2K, 8K, 32K, 128K}, dp in {2, 16, 32, 64}. The full cross product is too large for
a 2-core machine; the nine geometries below cover every value at least once, each chosen so
that a step packs into at least about 1.5 bins per rank (fewer, and no planner can align).

Per geometry: fixed B (bins rounded up to dp), the exhaustive search (every size of every
window), this planner, Megatron-LM's own ``dp_balanced`` packing over fixed B's steps (next-fit,
single examples split off the last bins to a multiple of dp, bin k to rank k mod dp;
`packing.dp_balanced`), and the offline best contiguous paths where they are cheap (2v+1 at most
``--best-path-max-window``): the most aligned steps, and apart from it the fewest bins, over
every admissible path with the packer's natural counts rounded up to dp (a planner that packs
to a capped count can go below it). Columns: bins, aligned share, token CV, modeled step-time CV and
mean(slowest rank) / mean(rank) (per rank, the sum over its bins of s + s^2/k, k = 24,576; a
step lasts as long as its slowest rank), beside the least that ratio could be with the same
bins whatever the hand-out (`rank_bound`), and the modeled run time (every step's slowest rank,
summed) against fixed B's. Then which goals hold, and where the imbalance goal fails, whether
the planner's bins would allow fixed B's imbalance at all. Prints markdown; not a timed test.

    nice -n 10 python benchmarks/bench_held_out_geometries.py [--out FILE]
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
from megatron_packing.reports.simulation import compare, offline_best_paths  # noqa: E402

MIXES = {
    "short chat": ("alpaca_demo", "gsm8k"),
    "long reasoning": ("long_cot_math", "math_cot_instruct"),
    "long documents": ("leval_pairs", "lima"),
}
K = 1024
# (mix, B, capacity, dp)
GEOMETRIES = (
    ("short chat", 64, 2 * K, 2),
    ("short chat", 2048, 8 * K, 16),
    ("short chat", 2048, 2 * K, 64),
    ("long reasoning", 64, 8 * K, 2),
    ("long reasoning", 256, 2 * K, 32),
    ("long reasoning", 2048, 32 * K, 16),
    ("long documents", 64, 32 * K, 2),
    ("long documents", 256, 32 * K, 16),
    ("long documents", 2048, 128 * K, 32),
)
STEPS = {64: 200, 256: 120, 2048: 30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--best-path-max-window", type=int, default=25)
    parser.add_argument("--only", default=None, help="indices of GEOMETRIES to run, e.g. 0,3")
    parser.add_argument("--out", default=None, help="also save the tables here")
    args = parser.parse_args()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    chosen = (GEOMETRIES if args.only is None
              else [GEOMETRIES[int(i)] for i in args.only.split(",")])
    report.print("steps: " + ", ".join(f"{s} at B = {b}" for b, s in STEPS.items())
                 + "; variation 0.05; MFFD; oversize examples truncated to the capacity.")
    report.print()
    report.print("| mix | B / C / dp | planner | bins | aligned | token CV | step-time CV "
                 "| slowest / mean rank | least with these bins | modeled run time vs fixed B |")
    report.print("|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for mix, batch, capacity, dp in chosen:
        steps = STEPS[batch]
        lengths = mixed_stream({n: pools[n] for n in MIXES[mix]}, batch * steps, capacity,
                               seed=args.seed)
        fixed, exhaustive, ours, reference = compare(lengths, batch_size=batch,
                                                     capacity=capacity, dp_size=dp, steps=steps,
                                                     dp_balanced=True)
        v = allowed_batch_variation(batch, 0.05)
        best = None
        if 2 * v + 1 <= args.best_path_max_window:
            best = offline_best_paths(lengths, batch_size=batch, capacity=capacity, dp_size=dp,
                                      steps=steps)
        name = f"{batch} / {capacity // K}K / {dp}"
        for run in (fixed, exhaustive, ours, reference):
            label = ("this planner" if run is ours else
                     "dp_balanced (Megatron-LM)" if run is reference else run.label)
            report.print(f"| {mix} | {name} | {label} | {run.bins:,} | {run.aligned_fraction:.1%} "
                         f"| {run.token_cv:.2%} | {run.step_time_cv:.2%} "
                         f"| {run.step_time_imbalance:.4f} "
                         f"| {run.step_time_imbalance_bound:.4f} "
                         f"| {run.modeled_time / fixed.modeled_time:.4f} |")
        if best is not None:
            report.print(f"| {mix} | {name} | best path (offline) | {best.fewest_bins:,} "
                         f"| {best.aligned_steps / steps:.1%} | - | - | - | - | - |")
        assert ours.step_time_imbalance_bound is not None
        verdicts.append((mix, name, [
            ("bins <= exhaustive", ours.bins <= exhaustive.bins),
            ("token CV <= fixed B", ours.token_cv <= fixed.token_cv),
            ("step-time CV < fixed B", ours.step_time_cv < fixed.step_time_cv),
            ("imbalance < fixed B", ours.step_time_imbalance < fixed.step_time_imbalance),
            ("these bins allow fixed B's imbalance",
             ours.step_time_imbalance_bound < fixed.step_time_imbalance),
            ("aligned within 2 points of best path",
             None if best is None else ours.aligned_fraction >= best.aligned_steps / steps - 0.02),
        ]))
    report.print()
    report.print("| mix | B / C / dp | " + " | ".join(g for g, _ in verdicts[0][2]) + " |")
    report.print("|---|---|" + "---|" * len(verdicts[0][2]))
    for mix, name, goals in verdicts:
        cells = ["-" if ok is None else ("yes" if ok else "**no**") for _, ok in goals]
        report.print(f"| {mix} | {name} | " + " | ".join(cells) + " |")
    report.save()


if __name__ == "__main__":
    main()
