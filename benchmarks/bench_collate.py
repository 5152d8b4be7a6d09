"""The packed collator's time per step, the planning time, and what a step's plan costs to ship.

Lengths from the mixed real pool, `SyntheticTokens` examples (`bench_loader_step.py`), the loader's
own parts (`build_packed_components`). Each step's examples are fetched once beforehand; the
collator alone is then timed, every step several times (rounds interleave the steps, so all see
the same machine load). Also: the sampler's time per step (planning, the row layouts included),
the pickled `PlannedBatch` a loader worker receives per step, and the pickled sampler state.
Prints a markdown table; not a timed test.

    python benchmarks/bench_collate.py [--steps 60] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package

import numpy as np  # noqa: E402
from bench_loader_step import SyntheticTokens  # noqa: E402
from report import Report  # noqa: E402

from megatron_packing.config import PackingConfig  # noqa: E402
from megatron_packing.packed.components import build_packed_components  # noqa: E402
from megatron_packing.reports.simulation import find_pool_dir, load_pools, mixed_stream  # noqa: E402

# (B, capacity, dp, tp, cp): rank 0's share, and the whole batch on one rank (dp 1)
GEOMETRIES = ((128, 4096, 8, 1, 1), (128, 4096, 1, 1, 1), (128, 4096, 8, 2, 2),
              (1024, 65536, 4, 1, 1))


def measure(pools: dict, batch: int, capacity: int, dp: int, tp: int, cp: int, steps: int,
            rounds: int) -> dict[str, float]:
    lengths = mixed_stream(pools, batch * (steps + 4), capacity, seed=0)
    dataset = SyntheticTokens(lengths)
    config = PackingConfig(global_batch_size=batch, bin_capacity=capacity, tp_size=tp,
                           cp_size=cp, align_packing_bins_to_dp=True, oversize_policy="truncate")
    sampler, wrapper, collator = build_packed_components(dataset, config, dp_rank=0, dp_size=dp,
                                                         seed=0, total_steps=steps)
    planned, plan_ms = [], []
    iterator = iter(sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while True:
            started = time.perf_counter()
            step = next(iterator, None)
            if step is None:
                break
            plan_ms.append((time.perf_counter() - started) * 1e3)
            planned.append(step)
    fetched = [wrapper.__getitems__(step) for step in planned]
    collate_ms: list[float] = []
    for _ in range(rounds):
        for one in fetched:
            started = time.perf_counter()
            collator(one)
            collate_ms.append((time.perf_counter() - started) * 1e3)
    shipped = [len(pickle.dumps(step)) for step in planned]
    rows = np.mean([len(collator(one).micro_batches) for one in fetched])
    return {"median": float(np.median(collate_ms)), "p99": float(np.percentile(collate_ms, 99)),
            "plan": float(np.median(plan_ms)), "shipped": float(np.median(shipped)),
            "state": float(len(pickle.dumps(sampler.state_dict()))), "rows": float(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5, help="times each step is collated")
    parser.add_argument("--out", default=None, help="also save the table here")
    args = parser.parse_args()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    report.print(f"{args.steps} steps, each collated {args.rounds} times; rank 0's share")
    report.print()
    report.print("| B / capacity / dp / tp x cp | rows | collate median | p99 | plan median "
                 "| plan shipped per step | sampler state |")
    report.print("|---|---|---|---|---|---|---|")
    for batch, capacity, dp, tp, cp in GEOMETRIES:
        r = measure(pools, batch, capacity, dp, tp, cp, args.steps, args.rounds)
        report.print(f"| {batch} / {capacity:,} / {dp} / {tp}x{cp} | {r['rows']:.1f} "
                     f"| {r['median']:.3f} ms | {r['p99']:.3f} ms | {r['plan']:.2f} ms "
                     f"| {r['shipped']:,.0f} B | {r['state']:,.0f} B |")
    report.save()


if __name__ == "__main__":
    main()
