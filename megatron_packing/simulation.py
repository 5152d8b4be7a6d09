"""Packing simulation on length pools: fixed batches (bins rounded up to dp) against DP-aligned.

Both runs see the same example stream and plan with the real `DPAlignedPackingBatchSampler`, so
the figures are what training would get: bins, token fill, batch-size range, per-step token
count variation, aligned steps, rank imbalance and planning time. This is the ``megatron-packing
simulate`` command and the README's measured table.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import SequentialSampler

from megatron_packing.packing.balance import assign_bins_to_ranks, bin_costs, imbalance
from megatron_packing.sampler import DPAlignedPackingBatchSampler

DEFAULT_POOL_DIRS = ("benchmarks/data/lengths", "../shared/data/lengths")


def find_pool_dir(explicit: str | None = None) -> Path:
    """The folder of ``*.txt`` length pools: the given one, or the project's copy."""
    candidates = [Path(explicit)] if explicit else [Path(p) for p in DEFAULT_POOL_DIRS]
    package_root = Path(__file__).resolve().parent.parent
    if not explicit:
        candidates += [package_root / p for p in DEFAULT_POOL_DIRS]
    for candidate in candidates:
        if candidate.is_dir() and any(candidate.glob("*.txt")):
            return candidate
    tried = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(f"no length pools (*.txt, one length per line) found in: {tried}")


def load_pools(pool_dir: str | Path) -> dict[str, np.ndarray]:
    """Every ``*.txt`` pool in a folder, by name (file stem)."""
    pools = {}
    for path in sorted(Path(pool_dir).glob("*.txt")):
        values = np.loadtxt(path, dtype=np.int64, ndmin=1)
        if values.size == 0 or values.min() <= 0:
            raise ValueError(f"{path}: a pool needs positive integer lengths, one per line")
        pools[path.stem] = values
    if not pools:
        raise FileNotFoundError(f"{pool_dir}: no *.txt length pools")
    return pools


def mixed_stream(pools: dict[str, np.ndarray], count: int, capacity: int, seed: int = 0) -> np.ndarray:
    """Draw a source uniformly, then a length from it (with replacement); clip to the capacity."""
    rng = np.random.default_rng(seed)
    names = sorted(pools)
    sources = rng.integers(0, len(names), size=count)
    out = np.empty(count, dtype=np.int64)
    for s, name in enumerate(names):
        chosen = np.flatnonzero(sources == s)
        out[chosen] = pools[name][rng.integers(0, len(pools[name]), size=chosen.size)]
    return np.minimum(out, capacity)


@dataclass
class SimulationResult:
    """Measured outcome of one simulated run."""

    label: str
    steps: int
    examples: int
    bins: int
    padding_bins: int
    aligned_steps: int
    token_fill: float
    min_batch: int
    max_batch: int
    token_cv: float  # std / mean of real tokens per step
    imbalance_round_robin: float  # mean over steps of max-rank / mean-rank cost
    imbalance_balanced: float
    plan_ms_median: float
    plan_ms_p99: float
    packs_mean: float

    @property
    def aligned_fraction(self) -> float:
        return self.aligned_steps / self.steps if self.steps else 0.0


def simulate(
    lengths: np.ndarray,
    *,
    batch_size: int,
    capacity: int,
    dp_size: int,
    steps: int,
    align: bool,
    variation: float = 0.05,
    algorithm: str = "mffd",
    lookahead_steps: int = 3,
    max_packs: int | None = 8,
    label: str | None = None,
) -> SimulationResult:
    """Run ``steps`` steps over ``lengths`` (taken in order) and measure them."""
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, batch_size, dp_size,
        bin_capacity=capacity, allowed_variation=variation, total_steps=steps,
        algorithm=algorithm, align_to_dp=align, lookahead_steps=lookahead_steps,
        max_packs=max_packs,
        oversize_policy="truncate",
    )
    sizes, tokens, plan_ms, packs = [], [], [], []
    bins = padding = aligned = 0
    imbalance_rr, imbalance_kk = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while len(sizes) < steps:
            progressed = False
            for batch in sampler:
                plan = batch.plan
                progressed = True
                sizes.append(plan.num_examples)
                tokens.append(plan.num_tokens)
                plan_ms.append(plan.plan_ms)
                packs.append(plan.packs)
                bins += plan.num_bins
                padding += plan.padding_bins
                aligned += int(plan.aligned)
                positions = {index: p for p, index in enumerate(plan.example_indices)}
                local_bins = [[positions[i] for i in b] for b in plan.bins]
                step_lengths = sampler.effective_lengths[list(plan.example_indices)]
                costs = bin_costs(local_bins, step_lengths)
                for method, sink in (("round_robin", imbalance_rr), ("karmarkar_karp", imbalance_kk)):
                    sink.append(imbalance(costs, assign_bins_to_ranks(costs, dp_size, method=method)))
            if not progressed:
                break
    token_array = np.asarray(tokens, dtype=np.float64)
    return SimulationResult(
        label=label or ("aligned" if align else "baseline"),
        steps=len(sizes),
        examples=int(sum(sizes)),
        bins=bins,
        padding_bins=padding,
        aligned_steps=aligned,
        token_fill=float(token_array.sum() / (bins * capacity)),
        min_batch=int(min(sizes)),
        max_batch=int(max(sizes)),
        token_cv=float(token_array.std() / token_array.mean()),
        imbalance_round_robin=float(np.mean(imbalance_rr)),
        imbalance_balanced=float(np.mean(imbalance_kk)),
        plan_ms_median=float(np.median(plan_ms)),
        plan_ms_p99=float(np.percentile(plan_ms, 99)),
        packs_mean=float(np.mean(packs)),
    )


def compare(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int, steps: int,
            variation: float = 0.05, algorithm: str = "mffd") -> tuple[SimulationResult, SimulationResult]:
    """Baseline (fixed B, bins rounded up to dp) and aligned runs over the same stream."""
    common = dict(batch_size=batch_size, capacity=capacity, dp_size=dp_size, steps=steps,
                  variation=variation, algorithm=algorithm)
    return simulate(lengths, align=False, **common), simulate(lengths, align=True, **common)


def format_comparison(baseline: SimulationResult, aligned: SimulationResult, title: str) -> str:
    """A markdown table: one row per measure, baseline against aligned."""
    fewer = (baseline.bins - aligned.bins) / baseline.bins * 100 if baseline.bins else 0.0
    rows = [
        ("bins", f"{baseline.bins:,}", f"{aligned.bins:,} ({fewer:.3f}% fewer)"),
        ("padding bins", f"{baseline.padding_bins:,}", f"{aligned.padding_bins:,}"),
        ("token fill", f"{baseline.token_fill:.3%}", f"{aligned.token_fill:.3%}"),
        ("steps aligned to dp", f"{baseline.aligned_fraction:.1%}", f"{aligned.aligned_fraction:.1%}"),
        ("batch size range", f"{baseline.min_batch}-{baseline.max_batch}",
         f"{aligned.min_batch}-{aligned.max_batch}"),
        ("examples", f"{baseline.examples:,}", f"{aligned.examples:,}"),
        ("per-step token CV", f"{baseline.token_cv:.2%}", f"{aligned.token_cv:.2%}"),
        ("dp imbalance, round robin", f"{baseline.imbalance_round_robin:.4f}",
         f"{aligned.imbalance_round_robin:.4f}"),
        ("dp imbalance, balanced", f"{baseline.imbalance_balanced:.4f}",
         f"{aligned.imbalance_balanced:.4f}"),
        ("plan ms median / p99", f"{baseline.plan_ms_median:.2f} / {baseline.plan_ms_p99:.2f}",
         f"{aligned.plan_ms_median:.2f} / {aligned.plan_ms_p99:.2f}"),
    ]
    lines = [f"### {title}", "", "| measure | baseline | aligned |", "|---|---|---|"]
    lines += [f"| {name} | {a} | {b} |" for name, a, b in rows]
    return "\n".join(lines)


def run_simulation(argv: Sequence[str] | None = None) -> int:
    """``megatron-packing simulate``: compare baseline and aligned packing on a length pool."""
    parser = argparse.ArgumentParser(prog="megatron-packing simulate", description=__doc__)
    parser.add_argument("--pool", default="mixed",
                        help="pool name (file stem) or 'mixed' (sources drawn uniformly)")
    parser.add_argument("--pool-dir", default=None, help="folder of *.txt length pools")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--dp-size", type=int, default=8)
    parser.add_argument("--variation", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--algorithm", default="mffd", choices=("mffd", "ffd", "bfd"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    pools = load_pools(find_pool_dir(args.pool_dir))
    count = args.steps * args.batch_size
    if args.pool == "mixed":
        lengths = mixed_stream(pools, count, args.capacity, seed=args.seed)
    elif args.pool in pools:
        rng = np.random.default_rng(args.seed)
        lengths = np.minimum(rng.choice(pools[args.pool], size=count), args.capacity)
    else:
        parser.error(f"unknown pool {args.pool!r}; choose 'mixed' or one of {', '.join(sorted(pools))}")
    baseline, aligned = compare(lengths, batch_size=args.batch_size, capacity=args.capacity,
                                dp_size=args.dp_size, steps=args.steps, variation=args.variation,
                                algorithm=args.algorithm)
    if args.json:
        print(json.dumps({"baseline": asdict(baseline), "aligned": asdict(aligned)}, indent=2))
    else:
        title = (f"{args.pool} pool, B={args.batch_size}, capacity={args.capacity}, "
                 f"dp={args.dp_size}, variation={args.variation}, {args.steps} steps")
        print(format_comparison(baseline, aligned, title))
    return 0
