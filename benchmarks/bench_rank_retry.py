"""What handing a step out again costs and gains (`PlannerTunables.rebalance_retry_above`).

On the six study geometries of `bench_reference_study.py` (the mixed shipped pool, 677 steps
each by default) and `bench_step_planning.py`'s B 4096 / 128K / dp 64, the sampler plans every
step once (fixed B and this planner); each step's bins are then handed to ranks
(`hand_out.hand_out`) with the retry off and at each threshold (a step is handed out again
where its slowest rank is more than the threshold x the mean rank above the least any hand-out
of its bins could reach, `rank_bound`). Columns: mean(slowest rank) / mean(rank) under the
balance cost, beside its least with these bins, the share of steps retried, and the hand-out's CPU time per
step, median and p99 (the first pass included; each threshold timed over the same steps, the
order of thresholds alternating between two passes, the lower of the two per step kept), and
what the retry adds to it, step by step against the retry off (mean and p99). With
``--partners``, the threshold stays at its default and the retry's partners vary instead
(`PlannerTunables.rebalance_retry_partners`). Prints markdown; not a timed test.

    nice -n 10 python benchmarks/bench_rank_retry.py [--steps 677] [--partners] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from report import Report  # noqa: E402
from torch.utils.data import SequentialSampler  # noqa: E402

import megatron_packing.packed.sampler as sampler_module  # noqa: E402
import megatron_packing.packing.hand_out as hand_out_module  # noqa: E402
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler  # noqa: E402
from megatron_packing.packing.balance import sequence_cost  # noqa: E402
from megatron_packing.packing.hand_out import hand_out  # noqa: E402
from megatron_packing.packing.rank_bound import slowest_rank_bound  # noqa: E402
from megatron_packing.packing.tunables import DEFAULT_TUNABLES  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402

STUDY = ((1024, 65536, 4), (1024, 65536, 8), (256, 16384, 8), (512, 32768, 16),
         (128, 4096, 8), (128, 4096, 4))
THRESHOLDS = (None, 0.015, 0.03, 0.06)
PARTNERS = (3, 8, 16, 64)


def thresholds() -> dict[str, Any]:
    """The retry off and at each threshold (the default partners)."""
    return {("off" if t is None else f"{t:.1%}"): replace(DEFAULT_TUNABLES,
                                                         rebalance_retry_above=t)
            for t in THRESHOLDS}


def partner_counts() -> dict[str, Any]:
    """The retry off, and at the default threshold with each partner count (at most dp)."""
    out = {"off": replace(DEFAULT_TUNABLES, rebalance_retry_above=None)}
    out.update({f"{p} partners": replace(DEFAULT_TUNABLES, rebalance_retry_partners=p)
                for p in PARTNERS})
    return out


def step_inputs(lengths: np.ndarray, batch: int, capacity: int, dp: int, steps: int,
                align: bool) -> list[tuple[Any, ...]]:
    """The (bins, lengths, sizes, dp, capacity, method, attention constant) the sampler hands
    out, step by step."""
    seen: list[tuple[Any, ...]] = []

    def record(*args: Any) -> Any:
        seen.append((*args[:6], args[7]))
        return hand_out(*args)

    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, batch, dp, bin_capacity=capacity,
        allowed_variation=0.05, total_steps=steps, align_to_dp=align, oversize_policy="truncate")
    sampler_module.hand_out = record  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in sampler:
                pass
    finally:
        sampler_module.hand_out = hand_out
    return seen


def retries(inputs: list[tuple[Any, ...]], tunables: Any) -> float:
    """The share of steps handed out twice (the rebalance passes counted, not timed)."""
    passes = []
    real = hand_out_module.rebalance_examples

    def counted(*args: Any, **kwargs: Any) -> Any:
        passes[-1] += 1
        return real(*args, **kwargs)

    hand_out_module.rebalance_examples = counted  # type: ignore[assignment]
    try:
        for *args, constant in inputs:
            passes.append(0)
            hand_out(*args, tunables, constant)
    finally:
        hand_out_module.rebalance_examples = real
    return float(np.mean(np.asarray(passes) > 1))


def measure(inputs: list[tuple[Any, ...]], settings: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per setting (the first is the retry off): imbalance, share retried, CPU ms median and p99."""
    labels = list(settings)
    cpu = {t: np.full(len(inputs), np.inf) for t in labels}
    slowest = {t: np.zeros(len(inputs)) for t in labels}
    mean = np.zeros(len(inputs))
    bound = np.zeros(len(inputs))
    for i, (bins, lengths, sizes, dp, capacity, _, constant) in enumerate(inputs):
        used = [p for b in bins for p in b]
        bound[i] = slowest_rank_bound(np.asarray(lengths)[used], np.asarray(sizes)[used],
                                      len(bins) // dp, dp, capacity, constant)
    for order in (labels, labels[::-1]):
        for t in order:
            for i, (*args, constant) in enumerate(inputs):
                start = time.process_time()
                bins, ranks = hand_out(*args, settings[t], constant)
                cpu[t][i] = min(cpu[t][i], time.process_time() - start)
                costs = sequence_cost(args[1], constant)
                totals = [float(sum(costs[p] for b in r for p in bins[b])) for r in ranks]
                slowest[t][i], mean[i] = max(totals), sum(totals) / len(totals)
    out = {}
    off = labels[0]
    for t in labels:
        out[t] = dict(imbalance=float(slowest[t].mean() / mean.mean()),
                      bound=float(bound.mean() / mean.mean()),
                      retried=0.0 if t == off else retries(inputs, settings[t]),
                      median=float(np.median(cpu[t]) * 1e3),
                      p99=float(np.percentile(cpu[t], 99) * 1e3),
                      added=float(np.mean(cpu[t] - cpu[off]) * 1e3),
                      added_p99=float(np.percentile(cpu[t] - cpu[off], 99) * 1e3))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=677)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partners", action="store_true",
                        help="vary the retry's partners at the default threshold")
    parser.add_argument("--out", default=None, help="also save the tables here")
    args = parser.parse_args()
    settings = partner_counts() if args.partners else thresholds()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    geometries = [(b, c, d, args.steps) for b, c, d in STUDY] + [(4096, 131072, 64, 30)]
    report.print(f"mixed pool, variation 0.05, MFFD; {args.steps} steps per study geometry, "
                 "30 at 4096 / 128K / 64; hand-out CPU ms per step")
    report.print()
    report.print(f"| B / C / dp | planner | {'retry' if args.partners else 'retry above'} "
                 "| slowest / mean rank | least with these bins "
                 "| steps retried | hand-out ms median | hand-out ms p99 | added ms mean "
                 "| added ms p99 |")
    report.print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, capacity, dp, steps in geometries:
        lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)
        for align, label in ((False, "fixed B"), (True, "this planner")):
            results = measure(step_inputs(lengths, batch, capacity, dp, steps, align), settings)
            for t, r in results.items():
                report.print(f"| {batch} / {capacity // 1024}K / {dp} | {label} "
                             f"| {t} | {r['imbalance']:.4f} "
                             f"| {r['bound']:.4f} | {r['retried']:.1%} | {r['median']:.2f} | {r['p99']:.2f} "
                             f"| {r['added']:+.2f} | {r['added_p99']:+.2f} |")
    report.save()


if __name__ == "__main__":
    main()
