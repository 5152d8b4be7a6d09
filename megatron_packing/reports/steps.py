"""The step-simulation engine: run a packing sampler step by step and keep each step's figures.

Both simulations drive the sampler through `run_steps`: the length-pool comparison
(`simulation.simulate`, ``megatron-packing simulate``) and a training YAML's own data
(`config_simulation.simulate_steps`, ``simulate --config`` and ``tune``). It records one
`StepSeries` (batch size, tokens, bins, padding bins, fill, rank imbalance, aligned, truncated
and deferred examples, planning time, packer runs and the modeled step time of every step);
the run's totals (`StepSeries.summary`) and the per-step token CV (`cv`) are computed here once.
The modeled time charges the sampler's ``microbatch_cost_tokens`` per bin and, where its rows
are padded to the capacity (``pad_bins_to_capacity``), every bin's full row (`step_time`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_packing.common.plan_types import StepPlan
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.packing.rank_bound import slowest_rank_bound
from megatron_packing.packing.step_time import StepTimes, rank_times

from .progress import Progress

StepObserver = Callable[[StepPlan], None]
"""Called with each step's plan, for a measure the series does not keep."""


def cv(values: Sequence[float] | np.ndarray) -> float:
    """Coefficient of variation, std / mean (population std); 0.0 when empty or the mean is 0."""
    array = np.asarray(values, dtype=np.float64)
    return float(array.std() / array.mean()) if array.size and array.mean() else 0.0


@dataclass
class StepSeries:
    """Per-step facts of one simulated run (one entry per step)."""

    label: str
    bin_capacity: int
    dp_size: int
    variation: float
    batch_size: np.ndarray
    tokens: np.ndarray
    bins: np.ndarray
    padding_bins: np.ndarray
    token_fill: np.ndarray
    dp_imbalance: np.ndarray  # the configured rank assignment's max-rank / mean-rank cost
    aligned: np.ndarray
    evened: np.ndarray  # took the nominal tokens: no size of it or those ahead saved a bin
    truncated: np.ndarray
    deferred: np.ndarray  # examples of the step's window moved to the next step
    packer_runs: np.ndarray
    plan_ms: np.ndarray
    slowest_rank: np.ndarray  # modeled step time: the slowest rank's summed m + s + s^2 / k
    mean_rank: np.ndarray  # the mean rank's
    rank_bound: np.ndarray  # the least the slowest rank could cost with the step's bins
    hopeless_steps: int = 0
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.bins)

    @property
    def step_times(self) -> StepTimes:
        return StepTimes(self.slowest_rank, self.mean_rank, self.rank_bound)

    def summary(self) -> dict[str, Any]:
        """The run's totals: the figures the tables, the tuning grid and the JSON reports show."""
        bins = int(self.bins.sum())
        tokens = int(self.tokens.sum())
        per_rank = self.bins / self.dp_size
        ran = self.steps > 0
        return {
            "steps": self.steps,
            "examples": int(self.batch_size.sum()),
            "tokens": tokens,
            "bins": bins,
            "padding_bins": int(self.padding_bins.sum()),
            "token_fill": tokens / (bins * self.bin_capacity) if bins else 0.0,
            "aligned_steps": int(self.aligned.sum()),
            "aligned_fraction": float(self.aligned.mean()) if ran else 0.0,
            "evened_steps": int(self.evened.sum()),
            "batch_size_min": int(self.batch_size.min()) if ran else 0,
            "batch_size_max": int(self.batch_size.max()) if ran else 0,
            "token_cv": cv(self.tokens),
            "dp_imbalance_mean": float(self.dp_imbalance.mean()) if ran else 0.0,
            "step_time_cv": self.step_times.cv,
            "step_time_imbalance": self.step_times.imbalance,
            "step_time_imbalance_bound": self.step_times.imbalance_bound,
            "modeled_time": self.step_times.total,
            "micro_batches_per_rank_mean": float(per_rank.mean()) if ran else 0.0,
            "micro_batches_per_rank_min": int(per_rank.min()) if ran else 0,
            "micro_batches_per_rank_max": int(per_rank.max()) if ran else 0,
            "truncated_examples": int(self.truncated.sum()),
            "plan_ms_median": float(np.median(self.plan_ms)) if ran else 0.0,
            "plan_ms_p99": float(np.percentile(self.plan_ms, 99)) if ran else 0.0,
            "hopeless_steps": self.hopeless_steps,
            "seconds": self.seconds,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "bin_capacity": self.bin_capacity,
            "dp_size": self.dp_size,
            "variation": self.variation,
            "summary": self.summary(),
            "per_step": {
                "batch_size": self.batch_size.tolist(),
                "tokens": self.tokens.tolist(),
                "bins": self.bins.tolist(),
                "padding_bins": self.padding_bins.tolist(),
                "token_fill": [round(x, 6) for x in self.token_fill.tolist()],
                "dp_imbalance": [round(x, 6) for x in self.dp_imbalance.tolist()],
                "aligned": self.aligned.tolist(),
                "evened": self.evened.tolist(),
            },
        }


_FLOAT_COLUMNS = ("token_fill", "dp_imbalance", "plan_ms", "slowest_rank", "mean_rank",
                  "rank_bound")


def run_steps(sampler: DPAlignedPackingBatchSampler, steps: int, *, label: str,
              progress: bool = False, observe: StepObserver | None = None) -> StepSeries:
    """Plan up to ``steps`` steps with ``sampler`` (epoch after epoch) and record each plan.

    Stops early only when an epoch yields no step. The sampler's warnings (a window that cannot
    align) are silenced: the series counts those steps in ``hopeless_steps`` instead.
    """
    started = time.perf_counter()
    row_tokens = sampler.bin_capacity if sampler.config.packer.pad_bins_to_capacity else None
    model: dict[str, Any] = dict(microbatch_cost=sampler.microbatch_cost_tokens,
                                 row_tokens=row_tokens)
    columns: dict[str, list[Any]] = {k: [] for k in (
        "batch_size", "tokens", "bins", "padding_bins", "token_fill", "dp_imbalance", "aligned",
        "evened", "truncated", "deferred", "packer_runs", "plan_ms", "slowest_rank", "mean_rank",
        "rank_bound")}
    hopeless = 0
    description = (f"simulating {label} (C={sampler.bin_capacity}, "
                   f"variation={sampler.variation_fraction:g})")
    with Progress(steps, description, progress, unit="step") as bar, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while len(columns["bins"]) < steps:
            before = len(columns["bins"])
            for batch in sampler:
                plan = batch.plan
                columns["batch_size"].append(plan.num_examples)
                columns["tokens"].append(plan.num_tokens)
                columns["bins"].append(plan.num_bins)
                columns["padding_bins"].append(plan.padding_bins)
                columns["token_fill"].append(plan.token_fill)
                columns["dp_imbalance"].append(plan.dp_imbalance)
                columns["aligned"].append(plan.aligned)
                columns["evened"].append(plan.evened)
                columns["truncated"].append(len(plan.truncated))
                columns["deferred"].append(len(plan.deferred))
                columns["packer_runs"].append(plan.packer_runs)
                columns["plan_ms"].append(plan.plan_ms)
                times = rank_times([sampler.effective_lengths[list(b)].tolist() for b in plan.bins],
                                   plan.rank_bins, sampler.attention_cost_constant, **model)
                columns["slowest_rank"].append(float(times.max()))
                columns["mean_rank"].append(float(times.mean()))
                taken = list(plan.example_indices)
                columns["rank_bound"].append(slowest_rank_bound(
                    sampler.effective_lengths[taken], sampler.padded_lengths[taken],
                    plan.num_bins // sampler.dp_size, sampler.dp_size,
                    sampler.packer.usable_capacity, sampler.attention_cost_constant, **model))
                hopeless += int(plan.hopeless)
                if observe is not None:
                    observe(plan)
                bar.update()
            if len(columns["bins"]) == before:
                break
    arrays = {k: np.asarray(v, dtype=np.float64 if k in _FLOAT_COLUMNS else
                            bool if k in ("aligned", "evened") else np.int64) for k, v in columns.items()}
    return StepSeries(label=label, bin_capacity=sampler.bin_capacity, dp_size=sampler.dp_size,
                      variation=sampler.variation_fraction, hopeless_steps=hopeless,
                      seconds=time.perf_counter() - started, **arrays)
