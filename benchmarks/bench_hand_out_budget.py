"""What each constant of the rank hand-out buys, on geometries it was not tuned on.

The hand-out (`packing.hand_out`: whole bins by Karmarkar-Karp, the fill and evening transfers of
`packing.rebalance`, a second pass where the ranks stay far above their bound) decides only which
rank trains which example: the steps' sizes and bins do not depend on it. So each geometry's
steps are planned once, recording what the sampler hands out, and every variant hands out the
same steps. A variant sets one constant of `PlannerTunables` to its simplest value (the
mechanism off, or one partner / neighbour). Column: the modeled run time (every step's slowest
rank, summed; per rank the sum over its bins of s + s^2/k) of the variant against the default,
as the default's saving in percent; a constant earns its place where the default saves at least
``--keep-above`` percent on some geometry.

The saved run (``benchmarks/results/bench_hand_out_budget.md``) also set the swap search's
neighbours (examples tried on each side of the ideal cost) from 2 to 1: at most 0.03% on every
geometry, so the search now tries the nearest on each side and that constant is gone.

Geometries: `bench_held_out_geometries.py`'s nine (three held-out pool mixes; B 64-2048,
capacity 2K-128K, dp 2-64) at its step counts, and its B 4096 / 128K / dp 64 on the mixed pool.
Prints markdown; not a timed test.

    nice -n 10 python benchmarks/bench_hand_out_budget.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench_held_out_geometries import GEOMETRIES, MIXES, STEPS  # noqa: E402
from report import Report  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402

import megatron_packing.packed.sampler as sampler_module  # noqa: E402
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler  # noqa: E402
from megatron_packing.packing.balance import bin_costs  # noqa: E402
from megatron_packing.packing.hand_out import hand_out  # noqa: E402
from megatron_packing.packing.tunables import DEFAULT_TUNABLES  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402

VARIANTS = {
    "rebalance_fill_rounds": 0,
    "rebalance_evens_per_rank": 0,
    "rebalance_partners": 1,
    "rebalance_retry_above": None,
    "rebalance_retry_partners": DEFAULT_TUNABLES.rebalance_partners,
}
"""Each hand-out constant and its simplest value (off, or the first pass's partners)."""


def step_inputs(lengths: np.ndarray, batch: int, capacity: int, dp: int,
                steps: int) -> list[tuple[Any, ...]]:
    """What the sampler hands out, step by step (its arguments to `hand_out`)."""
    seen: list[tuple[Any, ...]] = []

    def record(*args: Any) -> Any:
        seen.append(args)
        return hand_out(*args)

    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, batch, dp, bin_capacity=capacity,
        allowed_variation=0.05, total_steps=steps, oversize_policy="truncate")
    sampler_module.hand_out = record  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in sampler:
                pass
    finally:
        sampler_module.hand_out = hand_out
    return seen


def run_time(inputs: list[tuple[Any, ...]], tunables: Any) -> float:
    """The modeled run time of these steps handed out with ``tunables``."""
    total = 0.0
    for bins, lengths, sizes, dp, capacity, method, _, constant, *rest in inputs:
        out, ranks = hand_out(bins, lengths, sizes, dp, capacity, method, tunables, constant,
                              *rest)
        costs = bin_costs(out, lengths, constant, *rest)
        total += max(float(costs[list(rank)].sum()) for rank in ranks)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-above", type=float, default=0.5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    geometries = [(mix, b, c, dp, STEPS[b]) for mix, b, c, dp in GEOMETRIES]
    geometries.append(("mixed", 4096, 128 * 1024, 64, 12))
    report.print("Saving of the default over each constant at its simplest value, % of the "
                 "modeled run time (positive: the constant pays).")
    report.print()
    report.print("| pool | B / C / dp | steps | " + " | ".join(VARIANTS) + " |")
    report.print("|---|---|---|" + "---|" * len(VARIANTS))
    best = dict.fromkeys(VARIANTS, -np.inf)
    for mix, batch, capacity, dp, steps in geometries:
        chosen = pools if mix == "mixed" else {k: pools[k] for k in MIXES[mix]}
        lengths = mixed_stream(chosen, batch * steps, capacity, seed=args.seed)
        inputs = step_inputs(np.asarray(lengths), batch, capacity, dp, steps)
        default = run_time(inputs, DEFAULT_TUNABLES)
        cells = []
        for name, value in VARIANTS.items():
            saving = (run_time(inputs, replace(DEFAULT_TUNABLES, **{name: value})) / default
                      - 1) * 100
            best[name] = max(best[name], saving)
            cells.append(f"{saving:+.2f}")
        report.print(f"| {mix} | {batch} / {capacity // 1024}K / {dp} | {len(inputs)} | "
                     + " | ".join(cells) + " |")
    report.print()
    report.print("| constant | largest saving, % | keeps its place (>= "
                 f"{args.keep_above:g}%) |")
    report.print("|---|---|---|")
    for name, value in best.items():
        report.print(f"| {name} | {value:+.2f} | {'yes' if value >= args.keep_above else 'no'} |")
    report.save()


if __name__ == "__main__":
    main()
