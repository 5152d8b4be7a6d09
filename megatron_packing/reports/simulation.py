"""Packing simulation on length pools: fixed batches, the exhaustive reference and DP-aligned.

Every run sees the same example stream. Fixed batches and the DP-aligned runs plan with the real
`DPAlignedPackingBatchSampler`, so the figures are what training would get: bins, token fill,
batch-size range, per-step token variation, aligned steps, rank imbalance, planning time and
packer runs. Beside them: the exhaustive reference planner (every size of every window packed)
and the offline best contiguous path (`megatron_packing.packing.reference`). This is the
``megatron-packing simulate`` command and the benchmarks' measured tables.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import SequentialSampler

from megatron_packing.common.validation import allowed_batch_variation, require_int, require_number
from megatron_packing.config.components import PACKING_ALGORITHMS, PlannerConfig
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.packing.algorithms import PackingAlgorithm
from megatron_packing.packing.balance import assign_bins_to_ranks, bin_costs, imbalance
from megatron_packing.packing.planner.sizer import StepSizer
from megatron_packing.packing.planner.tunables import PlannerTunables
from megatron_packing.packing.reference import ReferenceRun, best_contiguous_path, plan_exhaustively
from megatron_packing.packing.step_time import balanced_rank_bins, step_times

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
    """Measured outcome of one simulated run (None: the planner does not measure it)."""

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
    imbalance_round_robin: float | None  # mean over steps of max-rank / mean-rank cost
    imbalance_balanced: float | None
    plan_ms_median: float
    plan_ms_p99: float
    packer_runs_mean: float  # packer runs per step (lookahead included)
    deferred_examples: int = 0  # examples that moved to the next step
    step_time_cv: float = 0.0  # modeled step time (slowest rank): std / mean across steps
    step_time_imbalance: float = 1.0  # mean(slowest rank) / mean(rank), modeled

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
    lookahead_steps: int = PlannerConfig.lookahead_steps,
    max_packs: int | None = 8,
    max_deferred_examples: int = 0,
    label: str | None = None,
    tunables: PlannerTunables | None = None,
) -> SimulationResult:
    """Run ``steps`` steps over ``lengths`` (taken in order) and measure them. ``tunables``
    replaces the planner's constants (``max_packs`` and ``lookahead_steps`` still come from
    the arguments): for sweeping them, see ``benchmarks/bench_planner_constants.py``."""
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, batch_size, dp_size,
        bin_capacity=capacity, allowed_variation=variation, total_steps=steps,
        algorithm=algorithm, align_to_dp=align, lookahead_steps=lookahead_steps,
        max_packs=max_packs, max_deferred_examples=max_deferred_examples,
        oversize_policy="truncate",
    )
    if tunables is not None:
        sampler.sizer = StepSizer(sampler.packer, dp_size, max_deferred=sampler.max_deferred_examples,
                                  tunables=replace(tunables, max_packs=max_packs,
                                                   lookahead_steps=lookahead_steps))
    sizes: list[int] = []
    tokens: list[int] = []
    plan_ms: list[float] = []
    runs: list[int] = []
    bins = padding = aligned = deferred = 0
    imbalance_rr: list[float] = []
    imbalance_kk: list[float] = []
    timed: list[tuple[list[list[int]], tuple[tuple[int, ...], ...]]] = []
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
                runs.append(plan.packer_runs)
                bins += plan.num_bins
                padding += plan.padding_bins
                aligned += int(plan.aligned)
                deferred += len(plan.deferred)
                positions = {index: p for p, index in enumerate(plan.example_indices)}
                local_bins = [[positions[i] for i in b] for b in plan.bins]
                step_lengths = sampler.effective_lengths[list(plan.example_indices)]
                costs = bin_costs(local_bins, step_lengths)
                for method, sink in (("round_robin", imbalance_rr), ("karmarkar_karp", imbalance_kk)):
                    sink.append(imbalance(costs, assign_bins_to_ranks(costs, dp_size, method=method)))
                timed.append(([[int(step_lengths[p]) for p in b] for b in local_bins], plan.rank_bins))
            if not progressed:
                break
    default = "aligned" if align else "fixed B"
    times = step_times(timed, sampler.attention_cost_constant)
    return SimulationResult(
        label=label or default,
        steps=len(sizes),
        examples=int(sum(sizes)),
        bins=bins,
        padding_bins=padding,
        aligned_steps=aligned,
        token_fill=float(np.sum(tokens) / (bins * capacity)),
        min_batch=int(min(sizes)),
        max_batch=int(max(sizes)),
        token_cv=_cv(tokens),
        imbalance_round_robin=float(np.mean(imbalance_rr)),
        imbalance_balanced=float(np.mean(imbalance_kk)),
        plan_ms_median=float(np.median(plan_ms)),
        plan_ms_p99=float(np.percentile(plan_ms, 99)),
        packer_runs_mean=float(np.mean(runs)),
        deferred_examples=deferred,
        step_time_cv=times.cv,
        step_time_imbalance=times.imbalance,
    )


def simulate_exhaustive(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int,
                        steps: int, variation: float = 0.05, algorithm: str = "mffd") -> SimulationResult:
    """The exhaustive reference planner over the same stream, measured like `simulate`."""
    v = allowed_batch_variation(batch_size, variation)
    run: ReferenceRun = plan_exhaustively(lengths, batch_size=batch_size, capacity=capacity,
                                          dp_size=dp_size, v=v, steps=steps,
                                          algorithm=algorithm)
    times = step_times([(bins, balanced_rank_bins(bins, dp_size)) for bins in run.step_bins])
    return SimulationResult(
        label="exhaustive", steps=run.steps, examples=int(sum(run.sizes)), bins=run.bins,
        padding_bins=run.padding_bins, aligned_steps=run.aligned_steps,
        token_fill=float(np.sum(run.step_tokens) / (run.bins * capacity)),
        min_batch=min(run.sizes), max_batch=max(run.sizes), token_cv=_cv(run.step_tokens),
        imbalance_round_robin=None, imbalance_balanced=None,
        plan_ms_median=float(np.median(run.plan_ms)),
        plan_ms_p99=float(np.percentile(run.plan_ms, 99)),
        packer_runs_mean=float(np.mean(run.packer_runs)),
        step_time_cv=times.cv, step_time_imbalance=times.imbalance,
    )


def ceiling_aligned_steps(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int,
                          steps: int, variation: float = 0.05, algorithm: str = "mffd") -> int:
    """Steps aligned on the offline best contiguous path (see `best_contiguous_path`)."""
    v = allowed_batch_variation(batch_size, variation)
    return best_contiguous_path(lengths, batch_size=batch_size, capacity=capacity, dp_size=dp_size,
                                v=v, steps=steps, algorithm=algorithm)


def _cv(values) -> float:
    array = np.asarray(values, dtype=np.float64)
    return float(array.std() / array.mean()) if array.size and array.mean() else 0.0


def compare(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int, steps: int,
            variation: float = 0.05, algorithm: str = "mffd", exhaustive: bool = True,
            max_deferred_examples: int = 0) -> list[SimulationResult]:
    """Fixed B (bins rounded up to dp), the exhaustive reference (optional), the project's
    planner, and the planner with bounded deferral (when ``max_deferred_examples`` > 0)."""
    common: dict[str, Any] = dict(batch_size=batch_size, capacity=capacity, dp_size=dp_size, steps=steps,
                  variation=variation, algorithm=algorithm)
    runs = [simulate(lengths, align=False, **common)]
    if exhaustive:
        runs.append(simulate_exhaustive(lengths, **common))
    runs.append(simulate(lengths, align=True, **common))
    if max_deferred_examples:
        runs.append(simulate(lengths, align=True, max_deferred_examples=max_deferred_examples,
                             label=f"aligned, defer <= {max_deferred_examples}", **common))
    return runs


def format_comparison(runs: Sequence[SimulationResult], title: str,
                      ceiling: int | None = None) -> str:
    """A markdown table: one row per measure, one column per run (plus the offline ceiling)."""
    base = runs[0]

    def fewer(run: SimulationResult) -> str:
        if run is base or not base.bins:
            return ""
        return f" ({(base.bins - run.bins) / base.bins * 100:+.3f}% vs {base.label})"

    def imb(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    measures = [
        ("bins", lambda r: f"{r.bins:,}{fewer(r)}"),
        ("padding bins", lambda r: f"{r.padding_bins:,}"),
        ("token fill", lambda r: f"{r.token_fill:.3%}"),
        ("steps aligned to dp", lambda r: f"{r.aligned_fraction:.1%}"),
        ("batch size range", lambda r: f"{r.min_batch}-{r.max_batch}"),
        ("examples", lambda r: f"{r.examples:,}"),
        ("examples deferred", lambda r: f"{r.deferred_examples:,}"),
        ("per-step token CV", lambda r: f"{r.token_cv:.2%}"),
        ("dp imbalance, round robin", lambda r: imb(r.imbalance_round_robin)),
        ("dp imbalance, balanced", lambda r: imb(r.imbalance_balanced)),
        ("modeled step-time CV", lambda r: f"{r.step_time_cv:.2%}"),
        ("modeled step-time imbalance", lambda r: f"{r.step_time_imbalance:.4f}"),
        ("plan ms median / p99", lambda r: f"{r.plan_ms_median:.2f} / {r.plan_ms_p99:.2f}"),
        ("packer runs / step", lambda r: f"{r.packer_runs_mean:.1f}"),
    ]
    header = [r.label for r in runs] + (["best contiguous path (offline)"] if ceiling is not None else [])
    lines = [f"### {title}", "", "| measure | " + " | ".join(header) + " |",
             "|---" * (len(header) + 1) + "|"]
    for name, cell in measures:
        row = [cell(r) for r in runs]
        if ceiling is not None:
            row.append(f"{ceiling / base.steps:.1%}" if name == "steps aligned to dp" else "")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def _integer(name: str, minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``, the error naming the option."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        return require_int(name, value, minimum=minimum, error=argparse.ArgumentTypeError)
    return parse


def _variation(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--variation must be a number in (0, 1), got {text!r}") from None
    return require_number("--variation", value, minimum=0, maximum=1, exclusive=True,
                          error=argparse.ArgumentTypeError)


MIN_CAPACITY = 16  # tokens per bin below which a simulation is not meaningful


def run_simulation(argv: Sequence[str] | None = None) -> int:
    """``megatron-packing simulate``: fixed B, the exhaustive reference and DP-aligned packing."""
    parser = argparse.ArgumentParser(
        prog="megatron-packing simulate", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="On your own data: megatron-packing simulate --config train.yaml [--dp-size N] "
               "[--steps K] [--output-dir D] (see megatron-packing simulate --config X --help)")
    parser.add_argument("--pool", default="mixed",
                        help="pool name (file stem) or 'mixed' (sources drawn uniformly)")
    parser.add_argument("--pool-dir", default=None, help="folder of *.txt length pools")
    parser.add_argument("--batch-size", type=_integer("--batch-size"), default=128)
    parser.add_argument("--capacity", type=_integer("--capacity", MIN_CAPACITY), default=4096,
                        help=f"tokens per bin (>= {MIN_CAPACITY}); lengths are clipped to it")
    parser.add_argument("--dp-size", type=_integer("--dp-size"), default=8)
    parser.add_argument("--variation", type=_variation, default=0.05,
                        help="batch-size window as a fraction of B, in (0, 1)")
    parser.add_argument("--steps", type=_integer("--steps"), default=200)
    parser.add_argument("--algorithm", default=PackingAlgorithm.MFFD.value, choices=PACKING_ALGORITHMS)
    parser.add_argument("--max-deferred", type=_integer("--max-deferred", 0), default=0,
                        help="also run with bounded deferral of up to this many examples per step")
    parser.add_argument("--no-exhaustive", action="store_true",
                        help="skip the exhaustive reference planner (it packs every size every step)")
    parser.add_argument("--no-ceiling", action="store_true",
                        help="skip the offline best contiguous path (about (2v+1)^2 packs per step)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if allowed_batch_variation(args.batch_size, args.variation) < 1:
        parser.error(f"--variation {args.variation} gives a window of floor({args.batch_size} x "
                     f"{args.variation}) = 0 examples; use at least {1 / args.batch_size:.4g}")

    pools = load_pools(find_pool_dir(args.pool_dir))
    count = args.steps * args.batch_size
    if args.pool == "mixed":
        lengths = mixed_stream(pools, count, args.capacity, seed=args.seed)
    elif args.pool in pools:
        rng = np.random.default_rng(args.seed)
        lengths = np.minimum(rng.choice(pools[args.pool], size=count), args.capacity)
    else:
        parser.error(f"unknown pool {args.pool!r}; choose 'mixed' or one of {', '.join(sorted(pools))}")
    common = dict(batch_size=args.batch_size, capacity=args.capacity, dp_size=args.dp_size,
                  steps=args.steps, variation=args.variation, algorithm=args.algorithm)
    runs = compare(lengths, exhaustive=not args.no_exhaustive,
                   max_deferred_examples=args.max_deferred, **common)
    ceiling = None if args.no_ceiling else ceiling_aligned_steps(lengths, **common)
    if args.json:
        document = {r.label: asdict(r) for r in runs}
        if ceiling is not None:
            document["best_contiguous_path"] = {"aligned_steps": ceiling}
        print(json.dumps(document, indent=2))
    else:
        title = (f"{args.pool} pool, B={args.batch_size}, capacity={args.capacity}, "
                 f"dp={args.dp_size}, variation={args.variation}, {args.steps} steps")
        print(format_comparison(runs, title, ceiling))
    return 0
