"""Megatron-LM's ``dp_balanced`` packing (`packing.dp_balanced`) run over a stream as a
`StepSeries`, so that ``simulate`` shows it beside fixed B and this planner in the same terms.

It takes fixed B's steps (exactly B examples each, in the same order, the same truncation and
alignment footprints), packs each next-fit, splits it to a multiple of dp and hands bin k to rank
k mod dp; each step is timed with the same cost model (`step_time`: ``s + s^2/k`` per sequence,
``microbatch_cost`` per bin, full rows where rows are padded to the capacity).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from megatron_packing.packing.balance import DEFAULT_ATTENTION_COST_CONSTANT, imbalance
from megatron_packing.packing.dp_balanced import plan_step
from megatron_packing.packing.rank_bound import slowest_rank_bound
from megatron_packing.packing.step_time import modeled_bin_costs

from .steps import StepSeries

LABEL = "dp_balanced"


def dp_balanced_series(steps: Sequence[Sequence[int]], kept: np.ndarray, sizes: np.ndarray,
                       raw: np.ndarray, *, capacity: int, usable_capacity: int, dp: int,
                       attention_constant: float = DEFAULT_ATTENTION_COST_CONSTANT,
                       microbatch_cost: float = 0.0, row_tokens: int | None = None,
                       variation: float = 0.0, label: str = LABEL) -> StepSeries:
    """``steps`` (each step's example indices, in arrival order) planned by ``dp_balanced``:
    ``kept`` are the lengths as trained (their cost), ``sizes`` their footprints in a bin (packed
    next-fit into ``usable_capacity``), ``raw`` the lengths before truncation."""
    started = time.perf_counter()
    columns: dict[str, list[float]] = {k: [] for k in (
        "batch_size", "tokens", "bins", "padding_bins", "token_fill", "dp_imbalance", "aligned",
        "truncated", "plan_ms", "slowest_rank", "mean_rank", "rank_bound")}
    for indices in steps:
        ids = np.asarray(indices, dtype=np.int64)
        began = time.perf_counter()
        plan = plan_step(sizes[ids], usable_capacity, dp)
        columns["plan_ms"].append((time.perf_counter() - began) * 1e3)
        lengths = kept[ids]
        bin_lengths = [[int(lengths[p]) for p in b] for b in plan.bins]
        costs = modeled_bin_costs(bin_lengths, attention_constant,
                                  microbatch_cost=microbatch_cost, row_tokens=row_tokens)
        times = np.array([float(costs[r].sum()) for r in plan.rank_bins])
        tokens = int(lengths.sum())
        columns["batch_size"].append(len(ids))
        columns["tokens"].append(tokens)
        columns["bins"].append(len(plan.bins))
        columns["padding_bins"].append(plan.extra_bins)
        columns["token_fill"].append(tokens / (len(plan.bins) * capacity))
        columns["dp_imbalance"].append(imbalance(costs, plan.rank_bins))
        columns["aligned"].append(plan.extra_bins == 0)
        columns["truncated"].append(int((lengths < raw[ids]).sum()))
        columns["slowest_rank"].append(float(times.max()))
        columns["mean_rank"].append(float(times.mean()))
        columns["rank_bound"].append(slowest_rank_bound(
            lengths, sizes[ids], len(plan.bins) // dp, dp, usable_capacity, attention_constant,
            microbatch_cost=microbatch_cost, row_tokens=row_tokens))
    count = len(columns["bins"])
    floats = ("token_fill", "dp_imbalance", "plan_ms", "slowest_rank", "mean_rank", "rank_bound")
    arrays = {k: np.asarray(v, dtype=np.float64 if k in floats else
                            bool if k == "aligned" else np.int64) for k, v in columns.items()}
    return StepSeries(
        label=label, bin_capacity=capacity, dp_size=dp, variation=variation,
        batch_size=arrays["batch_size"], tokens=arrays["tokens"], bins=arrays["bins"],
        padding_bins=arrays["padding_bins"], token_fill=arrays["token_fill"],
        dp_imbalance=arrays["dp_imbalance"], aligned=arrays["aligned"],
        evened=np.zeros(count, dtype=bool), truncated=arrays["truncated"],
        deferred=np.zeros(count, dtype=np.int64), packer_runs=np.ones(count, dtype=np.int64),
        plan_ms=arrays["plan_ms"], slowest_rank=arrays["slowest_rank"],
        mean_rank=arrays["mean_rank"], rank_bound=arrays["rank_bound"],
        seconds=time.perf_counter() - started)
