"""Simulate a training YAML on its own data: fixed batches against DP-aligned ones, step by step.

The YAML's ``data:`` section is loaded through the cached length index (the same call the
trainers make, so the index built here is the one training reuses), and its ``packing:``
section builds the real `DPAlignedPackingBatchSampler` with the configured base order, seed,
algorithm, alignment rules, rank assignment and lookahead. Two runs see the same example order:
"fixed B" (every step B examples, the bin count rounded up to dp with padding bins) and
"aligned" (the batch size varies within +-v so the bin count divides by dp). Each run goes through
the shared step engine (`steps.run_steps`), so the report shows per-step bins, padding bins,
fill, batch size and imbalance, and the same totals as the length-pool simulation. Beside them,
Megatron-LM's own ``dp_balanced`` packing over fixed B's steps (`dp_balanced_runs`), timed by
the same model: the YAML's ``attention_cost_constant`` and ``microbatch_cost_tokens``, and with
``pad_bins_to_capacity`` a full row per bin.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_packing.common.plan_types import StepPlan
from megatron_packing.common.validation import check_batch_window
from megatron_packing.config import (
    ConfigError,
    PackingConfig,
)
from megatron_packing.config.sections import read_sections
from megatron_packing.config.training import DataConfig
from megatron_packing.packed.components import packed_sampler_config
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.stream.base_order import make_base_order

from .dp_balanced_runs import dp_balanced_series
from .steps import StepObserver, StepSeries, run_steps


@dataclass
class ConfigInputs:
    """What a training YAML says about packing and data, plus the dp size and step count."""

    source: str
    packing: PackingConfig
    data: DataConfig
    dp_size: int
    steps: int | None  # None: one epoch of the dataset
    packing_keys: set[str] = field(default_factory=set)  # keys the YAML sets (others: defaults)

    def default_note(self, key: str) -> str:
        return "" if key in self.packing_keys else " (default: not set in the YAML)"


def read_config(path: str | Path, *, dp_size: int | None = None,
                steps: int | None = None) -> ConfigInputs:
    """Read and check the YAML's ``packing:`` and ``data:`` sections (and ``train:`` if present).

    A demo-trainer YAML (with ``model`` / ``train`` / ``logging``) is checked the way ``train``
    checks it; a Megatron-LM packing YAML (``packing`` and ``data`` only) is checked section by
    section. ``dp_size`` and ``steps`` default to ``train.dp_size`` and ``train.steps``.
    """
    source = str(path)
    sections = read_sections(path, command="megatron-packing simulate")
    if not sections.packing_values and sections.training is None:
        raise ConfigError(f"{source}: expected a training YAML with a 'packing:' section (and a "
                          "'data:' section naming the dataset and tokenizer)")
    train = sections.document.get("train") or {}
    section = sections.packing_values
    packing = (sections.training.packing if sections.training is not None
               else PackingConfig.from_dict(section, source=source))
    data = sections.data
    if dp_size is None:
        dp_size = train.get("dp_size") if isinstance(train, dict) else None
        if dp_size is None:
            raise ConfigError(f"{source}: no train.dp_size in the YAML; give the data-parallel "
                              "size with --dp-size N")
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ConfigError(f"--dp-size must be an integer >= 1, got {dp_size!r}")
    if steps is None and isinstance(train, dict) and "steps" in train:
        steps = train["steps"]
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"--steps must be an integer >= 1, got {steps!r}")
    try:
        packing.validate(dp_size)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if not packing.use_sequence_packing:
        raise ConfigError(f"{source}: packing.use_sequence_packing is false: there are no bins to "
                          "simulate (the padded mode plans token-budget micro-batches)")
    return ConfigInputs(source, packing, data, dp_size, steps, set(section))


@dataclass
class DatasetLengths:
    """The dataset's per-example token lengths, read from its length index."""

    lengths: np.ndarray
    skipped: dict[str, int]
    index_paths: list[str]
    load_seconds: float

    @property
    def num_examples(self) -> int:
        return len(self.lengths)


def load_lengths(inputs: ConfigInputs, *, show_progress: bool = False) -> DatasetLengths:
    """Load (or build, then cache) the length index of the YAML's data section."""
    from megatron_packing.data import load_sft_dataset

    data = inputs.data
    started = time.perf_counter()
    ds = load_sft_dataset(list(data.paths), data.tokenizer, loss_on=data.loss_on,
                          on_bad_record=data.on_bad_record, cache_dir=data.cache_dir,
                          show_progress=show_progress)
    lengths = np.asarray(ds.lengths, dtype=np.int64)
    return DatasetLengths(lengths, dict(ds.skipped), ds.index_paths,
                          time.perf_counter() - started)


def steps_for(lengths: np.ndarray, packing: PackingConfig, steps: int | None) -> int:
    """The given step count, or one epoch: ceil(N / B)."""
    return steps if steps is not None else max(1, math.ceil(len(lengths) / packing.global_batch_size))


def make_sampler(lengths: np.ndarray, packing: PackingConfig, dp_size: int, steps: int, *,
                 align: bool, bin_capacity: int | None = None,
                 variation: float | None = None) -> DPAlignedPackingBatchSampler:
    """The sampler training would build from this packing section (global view: all ranks),
    through training's own config path (`packed_sampler_config`); ``align``, ``bin_capacity``
    and ``variation`` change those keys for a comparison (fixed B, a tuning grid)."""
    keys: dict[str, Any] = {"align_packing_bins_to_dp": align}
    if not align:
        keys["max_deferred_examples"] = 0
    if bin_capacity is not None:
        keys["bin_capacity"] = bin_capacity
    if variation is not None:
        keys["packing_batch_size_allowed_variation"] = variation
    config = packed_sampler_config(packing.with_keys(**keys), dp_size)
    return config.build(make_base_order(packing.base_order, len(lengths), packing.seed), lengths,
                        total_steps=steps)


def simulate_steps(lengths: np.ndarray, packing: PackingConfig, dp_size: int, steps: int, *,
                   align: bool, bin_capacity: int | None = None, variation: float | None = None,
                   label: str | None = None, progress: bool = False,
                   observe: StepObserver | None = None) -> StepSeries:
    """Plan ``steps`` steps as training would and record each step's plan (``observe`` sees
    each plan too)."""
    capacity = packing.bin_capacity if bin_capacity is None else bin_capacity
    variation = packing.packing_batch_size_allowed_variation if variation is None else variation
    if align:
        check_batch_window(packing.global_batch_size, variation, dp_size)
    try:
        sampler = make_sampler(lengths, packing, dp_size, steps, align=align,
                               bin_capacity=capacity, variation=variation)
    except ValueError as exc:  # e.g. oversize_policy: error with examples longer than C
        raise ConfigError(f"cannot plan with bin_capacity={capacity}: {exc}") from None
    return run_steps(sampler, steps, label=label or ("aligned" if align else "fixed B"),
                     progress=progress, observe=observe)


def dp_balanced_steps(lengths: np.ndarray, packing: PackingConfig, dp_size: int,
                      order: list[tuple[int, ...]]) -> StepSeries:
    """Megatron-LM's ``dp_balanced`` over ``order`` (fixed B's steps: each step's examples in
    arrival order), with the truncation, alignment footprints and cost keys training uses."""
    sampler = make_sampler(lengths, packing, dp_size, max(len(order), 1), align=False)
    return dp_balanced_series(
        order, sampler.effective_lengths, sampler.padded_lengths, np.asarray(lengths),
        capacity=sampler.bin_capacity, usable_capacity=sampler.packer.usable_capacity,
        dp=dp_size, attention_constant=packing.attention_cost_constant,
        microbatch_cost=packing.microbatch_cost_tokens,
        row_tokens=packing.bin_capacity if packing.pad_bins_to_capacity else None,
        variation=packing.packing_batch_size_allowed_variation)


@dataclass
class ConfigSimulation:
    """Fixed B against aligned on one config's data."""

    inputs: ConfigInputs
    dataset: DatasetLengths
    fixed: StepSeries
    aligned: StepSeries
    dp_balanced: StepSeries  # Megatron-LM's own packing over fixed B's steps

    def to_json(self) -> dict[str, Any]:
        p = self.inputs.packing
        lengths = self.dataset.lengths
        return {
            "config": self.inputs.source,
            "dp_size": self.inputs.dp_size,
            "steps": self.fixed.steps,
            "packing": p.to_dict(),
            "dataset": {
                "paths": list(self.inputs.data.paths),
                "examples": int(len(lengths)),
                "tokens": int(lengths.sum()),
                "longer_than_capacity": int((lengths > p.bin_capacity).sum()),
                "skipped_records": self.dataset.skipped,
                "index_paths": self.dataset.index_paths,
                "load_seconds": self.dataset.load_seconds,
            },
            "fixed": self.fixed.to_json(),
            "aligned": self.aligned.to_json(),
            "dp_balanced": self.dp_balanced.to_json(),
        }


def simulate_config(inputs: ConfigInputs, dataset: DatasetLengths, *,
                    progress: bool = False) -> ConfigSimulation:
    """Fixed B and aligned runs of the config over its dataset, same order, same step count, and
    ``dp_balanced`` over fixed B's steps."""
    steps = steps_for(dataset.lengths, inputs.packing, inputs.steps)
    common: dict[str, Any] = dict(packing=inputs.packing, dp_size=inputs.dp_size, steps=steps, progress=progress)
    order: list[tuple[int, ...]] = []

    def record(plan: StepPlan) -> None:
        order.append(plan.example_indices)

    fixed = simulate_steps(dataset.lengths, align=False, observe=record, **common)
    aligned = simulate_steps(dataset.lengths, align=True, **common)
    reference = dp_balanced_steps(dataset.lengths, inputs.packing, inputs.dp_size, order)
    return ConfigSimulation(inputs, dataset, fixed, aligned, reference)


def format_simulation(result: ConfigSimulation) -> str:
    """A markdown table: one row per measure, fixed B, aligned and ``dp_balanced`` side by side."""
    inputs, p = result.inputs, result.inputs.packing
    lengths = result.dataset.lengths
    fixed, aligned = result.fixed.summary(), result.aligned.summary()
    reference = result.dp_balanced.summary()

    def saved(key: str) -> str:
        base = fixed[key]
        return f" ({(aligned[key] - base) / base:+.2%})" if base else ""

    rows = [
        ("bins", lambda s: f"{s['bins']:,}", saved("bins")),
        ("padding bins", lambda s: f"{s['padding_bins']:,}", ""),
        ("token fill", lambda s: f"{s['token_fill']:.2%}", ""),
        ("steps aligned to dp", lambda s: f"{s['aligned_steps']:,} ({s['aligned_fraction']:.1%})", ""),
        ("steps evened (aligning saved no bin)", lambda s: f"{s['evened_steps']:,}", ""),
        ("batch size range", lambda s: f"{s['batch_size_min']}-{s['batch_size_max']}", ""),
        ("micro-batches per rank", lambda s: (f"{s['micro_batches_per_rank_mean']:.2f} "
                                              f"({s['micro_batches_per_rank_min']}-"
                                              f"{s['micro_batches_per_rank_max']})"), ""),
        ("per-step token CV", lambda s: f"{s['token_cv']:.2%}", ""),
        ("rank imbalance (mean max/mean)", lambda s: f"{s['dp_imbalance_mean']:.4f}", ""),
        ("modeled step-time CV (slowest rank)", lambda s: f"{s['step_time_cv']:.2%}", ""),
        ("modeled step time: mean slowest / mean rank",
         lambda s: f"{s['step_time_imbalance']:.4f}", ""),
        ("its least with these bins (any hand-out)",
         lambda s: f"{s['step_time_imbalance_bound']:.4f}", ""),
        ("modeled run time vs fixed B (slowest ranks summed)",
         lambda s: f"{s['modeled_time'] / fixed['modeled_time']:.4f}" if fixed["modeled_time"]
         else "-", ""),
        ("modeled time per 1,000 examples (K tokens of work)",
         lambda s: f"{s['modeled_time'] / s['examples']:,.1f}" if s["examples"] else "-", ""),
        ("examples truncated", lambda s: f"{s['truncated_examples']:,}", ""),
        ("plan ms median / p99", lambda s: f"{s['plan_ms_median']:.2f} / {s['plan_ms_p99']:.2f}", ""),
    ]
    skipped = sum(result.dataset.skipped.values())
    lines = [
        f"### {inputs.source}: {len(lengths):,} examples, {int(lengths.sum()):,} tokens"
        + (f" ({skipped:,} bad records skipped)" if skipped else ""),
        "",
        f"B = {p.global_batch_size}{inputs.default_note('global_batch_size')}, "
        f"bin_capacity = {p.bin_capacity}{inputs.default_note('bin_capacity')}, "
        f"dp = {inputs.dp_size}, variation = {p.packing_batch_size_allowed_variation} "
        f"(v = {p.v}), {p.packing_algorithm}, {p.base_order} order, "
        f"{result.fixed.steps} steps; lengths p50 {np.percentile(lengths, 50):.0f}, "
        f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}, "
        f"{int((lengths > p.bin_capacity).sum()):,} longer than the capacity; modeled time: "
        f"s + s^2/{p.attention_cost_constant:g} per sequence, {p.microbatch_cost_tokens:g} "
        f"per micro-batch{inputs.default_note('microbatch_cost_tokens')}"
        + (", every bin a full row (pad_bins_to_capacity)" if p.pad_bins_to_capacity else ""),
        "",
        "| measure | fixed B | aligned | dp_balanced (Megatron-LM) |",
        "|---|---|---|---|",
    ]
    for name, cell, extra in rows:
        lines.append(f"| {name} | {cell(fixed)} | {cell(aligned)}{extra} | {cell(reference)} |")
    if aligned["hopeless_steps"]:
        lines += ["", f"{aligned['hopeless_steps']} steps pack into fewer bins than dp = "
                      f"{inputs.dp_size}: alignment cannot succeed there (raise B or lower dp)."]
    if p.pad_bins_to_capacity:
        change = (f"{(aligned['bins'] - fixed['bins']) / fixed['bins']:+.2%}" if fixed["bins"]
                  else "no change")
        lines += ["", "pad_bins_to_capacity is on: every row is padded to bin_capacity, so the "
                      "modeled step time charges every bin a full row of linear work (a "
                      "placeholder too); fewer bins are faster outright "
                      f"({change} in bins)."]
    lines += ["", "dp_balanced: Megatron-LM's own packing (--sequence-packing-scheduler "
                  "dp_balanced) over fixed B's steps: next-fit, single examples split off the "
                  "last bins to a multiple of dp, bin k to rank k mod dp (docs/simulate.md)."]
    return "\n".join(lines)
