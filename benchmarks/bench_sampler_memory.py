"""Peak memory of the packing sampler over a large dataset: the epoch order as an array or a list.

Each setting runs in a fresh subprocess, which builds the lengths (mixed pool, int32), makes a
`DPAlignedPackingBatchSampler` over the seeded random order and plans a few steps; it reports its
peak RSS (``ru_maxrss``) and its RSS before the sampler was made. "array" is the shipped
`SeededRandomOrder` (the cursor slices ``epoch_permutation()``); "list" is the same order read
as an iterator over ``torch.randperm(n).tolist()``, the way every epoch used to be read.

    python benchmarks/bench_sampler_memory.py --examples 1000000 10000000 --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(examples: int, order: str, steps: int, batch: int, capacity: int, dp: int) -> dict:
    """One measurement (runs in its own process)."""
    import numpy as np
    import torch

    from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
    from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream
    from megatron_packing.stream.base_order import SeededRandomOrder

    class ListOrder(torch.utils.data.Sampler):
        """The seeded order, iterated from a Python list of the whole epoch."""

        def __init__(self, n: int, seed: int) -> None:
            self.n, self.seed, self.epoch = n, seed, 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __len__(self) -> int:
            return self.n

        def __iter__(self):
            generator = torch.Generator()
            generator.manual_seed(self.seed * 1_000_003 + self.epoch)
            yield from torch.randperm(self.n, generator=generator).tolist()

    lengths = mixed_stream(load_pools(find_pool_dir()), examples, capacity, seed=0).astype(np.int32)
    before = _rss_mb()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    base = SeededRandomOrder(examples, 1234) if order == "array" else ListOrder(examples, 1234)
    started = time.perf_counter()
    sampler = DPAlignedPackingBatchSampler(base, lengths, batch, dp, bin_capacity=capacity,
                                           allowed_variation=0.05, oversize_policy="truncate")
    firsts = []
    for k, step in enumerate(sampler):
        firsts.append(step.plan.example_indices[0])
        if k + 1 == steps:
            break
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"examples": examples, "order": order, "rss_before_mb": before, "peak_before_mb": peak_before,
            "peak_rss_mb": peak,
            "seconds": seconds, "first_indices": firsts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--orders", nargs="+", default=["list", "array"], choices=("list", "array"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        examples, order = args.child.split(":")
        print(json.dumps(child(int(examples), order, args.steps, args.batch_size, args.capacity,
                               args.dp)))
        return

    from report import Report

    report = Report(args.out)
    report.print(f"B={args.batch_size}, capacity={args.capacity}, dp={args.dp}, {args.steps} steps "
                 "planned, seeded random order; one fresh process per row")
    report.print()
    report.print("| examples | epoch order | RSS before the sampler (MB) | peak RSS before it (MB) "
                 "| peak RSS (MB) | sampler + steps (MB) | sampler + steps (s) |")
    report.print("|---:|---|---:|---:|---:|---:|---:|")
    for examples in args.examples:
        firsts = {}
        for order in args.orders:
            command = [sys.executable, __file__, "--child", f"{examples}:{order}",
                       "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                       "--capacity", str(args.capacity), "--dp", str(args.dp)]
            result = json.loads(subprocess.run(command, check=True, capture_output=True,
                                               text=True).stdout.strip().splitlines()[-1])
            firsts[order] = result["first_indices"]
            report.print(f"| {examples:,} | {order} | {result['rss_before_mb']:.0f} "
                         f"| {result['peak_before_mb']:.0f} "
                         f"| {result['peak_rss_mb']:.0f} "
                         f"| {result['peak_rss_mb'] - result['rss_before_mb']:.0f} "
                         f"| {result['seconds']:.2f} |")
        if len(set(map(tuple, firsts.values()))) > 1:
            raise SystemExit(f"the orders differ at {examples} examples: {firsts}")
    report.print()
    report.print("Both orders planned the same steps (the first example of every step compared). "
                 "'sampler + steps' is the peak RSS minus the RSS before the sampler was made.")
    report.save()


if __name__ == "__main__":
    main()
