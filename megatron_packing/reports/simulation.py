"""Packing simulation on length pools: fixed batches, the exhaustive reference and DP-aligned.

Every run sees the same example stream. Fixed batches and the DP-aligned runs plan with the real
`DPAlignedPackingBatchSampler`, so the figures are what training would get: bins, token fill,
batch-size range, per-step token variation, aligned steps, rank imbalance, planning time and
packer runs. Beside them: the exhaustive reference planner (every size of every window packed)
and the offline best contiguous path (`megatron_packing.packing.reference`), and Megatron-LM's
own ``dp_balanced`` packing (`megatron_packing.packing.dp_balanced`, over fixed B's steps). The
planner runs go through the shared step engine (`steps.run_steps`); the streams come from
`pools`. Every run is timed by one cost model: ``s + s^2/k`` per sequence, plus
``microbatch_cost_tokens`` per bin, and with ``pad_bins_to_capacity`` every bin a full row. This
is the ``megatron-packing simulate`` command's table (its body: `commands.simulate_pools`) and
the benchmarks' measured tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import SequentialSampler

from megatron_packing.common.plan_types import StepPlan
from megatron_packing.common.validation import allowed_batch_variation
from megatron_packing.config.components import PlannerConfig
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.packing.balance import (
    DEFAULT_ATTENTION_COST_CONSTANT,
    assign_bins_to_ranks,
    bin_costs,
    imbalance,
)
from megatron_packing.packing.reference import (
    ReferenceRun,
    contiguous_path_bounds,
    plan_exhaustively,
)
from megatron_packing.packing.step_time import assign_work, step_times
from megatron_packing.packing.tunables import DEFAULT_TUNABLES, PlannerTunables

from .dp_balanced_runs import dp_balanced_series
from .steps import StepSeries, cv, run_steps


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
    # the least that imbalance could be with the same bins, whatever the hand-out (`rank_bound`)
    step_time_imbalance_bound: float | None = None
    modeled_time: float = 0.0  # the run's modeled time: the slowest rank's cost, summed over steps
    evened_steps: int = 0  # took the nominal tokens where aligning saved no bin (planner.floor)

    @property
    def aligned_fraction(self) -> float:
        return self.aligned_steps / self.steps if self.steps else 0.0

    @classmethod
    def from_series(cls, series: StepSeries, *, imbalance_round_robin: float | None = None,
                    imbalance_balanced: float | None = None) -> SimulationResult:
        """The totals of one engine run (`run_steps`) in this table's terms."""
        s = series.summary()
        return cls(
            label=series.label, steps=s["steps"], examples=s["examples"], bins=s["bins"],
            padding_bins=s["padding_bins"], aligned_steps=s["aligned_steps"],
            evened_steps=s["evened_steps"],
            token_fill=s["token_fill"], min_batch=s["batch_size_min"],
            max_batch=s["batch_size_max"], token_cv=s["token_cv"],
            imbalance_round_robin=imbalance_round_robin, imbalance_balanced=imbalance_balanced,
            plan_ms_median=s["plan_ms_median"], plan_ms_p99=s["plan_ms_p99"],
            packer_runs_mean=float(np.mean(series.packer_runs)) if series.steps else 0.0,
            deferred_examples=int(series.deferred.sum()), step_time_cv=s["step_time_cv"],
            step_time_imbalance=s["step_time_imbalance"], modeled_time=s["modeled_time"],
            step_time_imbalance_bound=s["step_time_imbalance_bound"],
        )


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
    rank_assignment: str = PlannerConfig.rank_assignment,
    attention_cost_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
    microbatch_cost_tokens: float = 0.0,
    pad_bins_to_capacity: bool = False,
) -> SimulationResult:
    """Run ``steps`` steps over ``lengths`` (taken in order) and measure them. ``tunables``
    replaces the planner's constants (`PlannerConfig.tunables`): for sweeping them, see
    ``benchmarks/bench_planner_constants.py``. The cost keys plan and time the steps as the YAML
    keys of the same names do."""
    sampler = DPAlignedPackingBatchSampler(
        SequentialSampler(range(len(lengths))), lengths, batch_size, dp_size,
        bin_capacity=capacity, allowed_variation=variation, total_steps=steps,
        algorithm=algorithm, align_to_dp=align, lookahead_steps=lookahead_steps,
        max_packs=max_packs, max_deferred_examples=max_deferred_examples,
        oversize_policy="truncate", rank_assignment=rank_assignment,
        attention_cost_constant=attention_cost_constant,
        microbatch_cost_tokens=microbatch_cost_tokens, pad_bins_to_capacity=pad_bins_to_capacity,
        tunables=DEFAULT_TUNABLES if tunables is None else tunables,
    )
    imbalance_rr: list[float] = []
    imbalance_kk: list[float] = []

    def both_assignments(plan: StepPlan) -> None:
        """Rank imbalance of round robin and of Karmarkar-Karp over the step's bins."""
        positions = {index: p for p, index in enumerate(plan.example_indices)}
        local_bins = [[positions[i] for i in b] for b in plan.bins]
        costs = bin_costs(local_bins, sampler.effective_lengths[list(plan.example_indices)],
                          sampler.attention_cost_constant, sampler.microbatch_cost_tokens)
        for method, sink in (("round_robin", imbalance_rr), ("karmarkar_karp", imbalance_kk)):
            sink.append(imbalance(costs, assign_bins_to_ranks(costs, dp_size, method=method)))

    series = run_steps(sampler, steps, label=label or ("aligned" if align else "fixed B"),
                       observe=both_assignments)
    return SimulationResult.from_series(series, imbalance_round_robin=float(np.mean(imbalance_rr)),
                                        imbalance_balanced=float(np.mean(imbalance_kk)))


def simulate_exhaustive(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int,
                        steps: int, variation: float = 0.05, algorithm: str = "mffd",
                        rank_assignment: str = PlannerConfig.rank_assignment,
                        attention_cost_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
                        microbatch_cost_tokens: float = 0.0,
                        pad_bins_to_capacity: bool = False) -> SimulationResult:
    """The exhaustive reference planner over the same stream, measured like `simulate` (its
    bins handed to ranks by ``rank_assignment``, as the sampler hands out its own)."""
    v = allowed_batch_variation(batch_size, variation)
    run: ReferenceRun = plan_exhaustively(lengths, batch_size=batch_size, capacity=capacity,
                                          dp_size=dp_size, v=v, steps=steps,
                                          algorithm=algorithm)
    k, m = attention_cost_constant, microbatch_cost_tokens
    times = step_times([assign_work(bins, dp_size, capacity, rank_assignment, k,
                                    microbatch_cost=m) for bins in run.step_bins], k,
                       capacity=capacity, microbatch_cost=m,
                       row_tokens=capacity if pad_bins_to_capacity else None)
    return SimulationResult(
        label="exhaustive", steps=run.steps, examples=int(sum(run.sizes)), bins=run.bins,
        padding_bins=run.padding_bins, aligned_steps=run.aligned_steps,
        token_fill=float(np.sum(run.step_tokens) / (run.bins * capacity)),
        min_batch=min(run.sizes), max_batch=max(run.sizes), token_cv=cv(run.step_tokens),
        imbalance_round_robin=None, imbalance_balanced=None,
        plan_ms_median=float(np.median(run.plan_ms)),
        plan_ms_p99=float(np.percentile(run.plan_ms, 99)),
        packer_runs_mean=float(np.mean(run.packer_runs)),
        step_time_cv=times.cv, step_time_imbalance=times.imbalance, modeled_time=times.total,
        step_time_imbalance_bound=times.imbalance_bound,
    )


def simulate_dp_balanced(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int,
                         steps: int, attention_cost_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
                         microbatch_cost_tokens: float = 0.0,
                         pad_bins_to_capacity: bool = False) -> SimulationResult:
    """Megatron-LM's ``dp_balanced`` over fixed B's steps of the same stream (B examples each,
    in order, truncated to the capacity as the others are), timed like `simulate`."""
    stream = np.asarray(lengths, dtype=np.int64)[:steps * batch_size]
    kept = np.minimum(stream, capacity)
    order = [range(s, min(s + batch_size, len(stream))) for s in range(0, len(stream), batch_size)]
    series = dp_balanced_series(order, kept, kept, stream, capacity=capacity,
                                usable_capacity=capacity, dp=dp_size,
                                attention_constant=attention_cost_constant,
                                microbatch_cost=microbatch_cost_tokens,
                                row_tokens=capacity if pad_bins_to_capacity else None)
    return SimulationResult.from_series(series)


@dataclass(frozen=True)
class BestPaths:
    """The offline best contiguous paths over a stream (`contiguous_path_bounds`): the most
    aligned steps on one path, and the fewest bins (natural counts rounded up to dp) on another.
    A planner that packs to a capped count can use fewer bins than ``fewest_bins``."""

    aligned_steps: int
    fewest_bins: int


def offline_best_paths(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int,
                       steps: int, variation: float = 0.05, algorithm: str = "mffd") -> BestPaths:
    """The most aligned steps and the fewest bins over every admissible contiguous path."""
    v = allowed_batch_variation(batch_size, variation)
    aligned, fewest = contiguous_path_bounds(lengths, batch_size=batch_size, capacity=capacity,
                                             dp_size=dp_size, v=v, steps=steps,
                                             algorithm=algorithm)
    return BestPaths(aligned, fewest)


def compare(lengths: np.ndarray, *, batch_size: int, capacity: int, dp_size: int, steps: int,
            variation: float = 0.05, algorithm: str = "mffd", exhaustive: bool = True,
            max_deferred_examples: int = 0,
            rank_assignment: str = PlannerConfig.rank_assignment, dp_balanced: bool = False,
            attention_cost_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
            microbatch_cost_tokens: float = 0.0,
            pad_bins_to_capacity: bool = False) -> list[SimulationResult]:
    """Fixed B (bins rounded up to dp), the exhaustive reference (optional), the project's
    planner, the planner with bounded deferral (when ``max_deferred_examples`` > 0) and, with
    ``dp_balanced``, Megatron-LM's own packing, last; every run but that one hands its bins to
    ranks by ``rank_assignment``, and every run is timed by the same cost keys."""
    model: dict[str, Any] = dict(attention_cost_constant=attention_cost_constant,
                                 microbatch_cost_tokens=microbatch_cost_tokens,
                                 pad_bins_to_capacity=pad_bins_to_capacity)
    common: dict[str, Any] = dict(batch_size=batch_size, capacity=capacity, dp_size=dp_size, steps=steps,
                  variation=variation, algorithm=algorithm, rank_assignment=rank_assignment,
                  **model)
    runs = [simulate(lengths, align=False, **common)]
    if exhaustive:
        runs.append(simulate_exhaustive(lengths, **common))
    runs.append(simulate(lengths, align=True, **common))
    if max_deferred_examples:
        runs.append(simulate(lengths, align=True, max_deferred_examples=max_deferred_examples,
                             label=f"aligned, defer <= {max_deferred_examples}", **common))
    if dp_balanced:
        runs.append(simulate_dp_balanced(lengths, batch_size=batch_size, capacity=capacity,
                                         dp_size=dp_size, steps=steps, **model))
    return runs


def format_comparison(runs: Sequence[SimulationResult], title: str,
                      best: BestPaths | None = None) -> str:
    """A markdown table: one row per measure, one column per run (plus the offline best paths:
    their fewest bins and most aligned steps)."""
    base = runs[0]

    def fewer_bins(bins: int) -> str:
        if not base.bins:
            return ""
        return f" ({(base.bins - bins) / base.bins * 100:+.3f}% vs {base.label})"

    def fewer(run: SimulationResult) -> str:
        return "" if run is base else fewer_bins(run.bins)

    def imb(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    measures = [
        ("bins", lambda r: f"{r.bins:,}{fewer(r)}"),
        ("padding bins", lambda r: f"{r.padding_bins:,}"),
        ("token fill", lambda r: f"{r.token_fill:.3%}"),
        ("steps aligned to dp", lambda r: f"{r.aligned_fraction:.1%}"),
        ("steps evened (aligning saved no bin)", lambda r: f"{r.evened_steps:,}"),
        ("batch size range", lambda r: f"{r.min_batch}-{r.max_batch}"),
        ("examples", lambda r: f"{r.examples:,}"),
        ("examples deferred", lambda r: f"{r.deferred_examples:,}"),
        ("per-step token CV", lambda r: f"{r.token_cv:.2%}"),
        ("dp imbalance, round robin", lambda r: imb(r.imbalance_round_robin)),
        ("dp imbalance, balanced", lambda r: imb(r.imbalance_balanced)),
        ("modeled step-time CV", lambda r: f"{r.step_time_cv:.2%}"),
        ("modeled step-time imbalance", lambda r: f"{r.step_time_imbalance:.4f}"),
        ("its least with these bins (any hand-out)", lambda r: imb(r.step_time_imbalance_bound)),
        (f"modeled run time vs {base.label}", lambda r: (
            f"{r.modeled_time / base.modeled_time:.4f}" if base.modeled_time else "-")),
        ("modeled time per 1,000 examples (K tokens of work)", lambda r: (
            f"{r.modeled_time / r.examples:,.1f}" if r.examples else "-")),
        ("plan ms median / p99", lambda r: f"{r.plan_ms_median:.2f} / {r.plan_ms_p99:.2f}"),
        ("packer runs / step", lambda r: f"{r.packer_runs_mean:.1f}"),
    ]
    header = [r.label for r in runs] + (["best contiguous paths (offline)"] if best is not None else [])
    lines = [f"### {title}", "", "| measure | " + " | ".join(header) + " |",
             "|---" * (len(header) + 1) + "|"]
    offline = {} if best is None else {
        "bins": f"{best.fewest_bins:,}{fewer_bins(best.fewest_bins)}",
        "steps aligned to dp": f"{best.aligned_steps / base.steps:.1%}"}
    for name, cell in measures:
        row = [cell(r) for r in runs]
        if best is not None:
            row.append(offline.get(name, ""))
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)
