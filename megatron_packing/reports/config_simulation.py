"""Simulate a training YAML on its own data: fixed batches against DP-aligned ones, step by step.

The YAML's ``data:`` section is loaded through the cached length index (the same call the
trainers make, so the index built here is the one training reuses), and its ``packing:``
section builds the real `DPAlignedPackingBatchSampler` with the configured base order, seed,
algorithm, alignment rules, rank assignment and lookahead. Two runs see the same example order:
"fixed B" (every step B examples, the bin count rounded up to dp with padding bins) and
"aligned" (the batch size varies within +-v so the bin count divides by dp). Each step's plan is
recorded, so the report can show per-step bins, padding bins, fill, batch size and imbalance.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from megatron_packing.common.validation import check_batch_window
from megatron_packing.config import (
    ConfigError,
    PackingConfig,
    dataclass_from_mapping,
    read_yaml_mapping,
)
from megatron_packing.config.training import DataConfig, training_config_from_dict
from megatron_packing.packed.sampler import DPAlignedPackingBatchSampler
from megatron_packing.packing.step_time import StepTimes, rank_times
from megatron_packing.stream.base_order import make_base_order

from .progress import Progress

_TRAINER_SECTIONS = ("model", "train", "logging")


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
    document = read_yaml_mapping(path)
    if not isinstance(document, dict) or "packing" not in document:
        raise ConfigError(f"{source}: expected a training YAML with a 'packing:' section (and a "
                          "'data:' section naming the dataset and tokenizer)")
    train = document.get("train") or {}
    if any(name in document for name in _TRAINER_SECTIONS):
        training_config_from_dict(document, source=source)
    section = document.get("packing") or {}
    packing = PackingConfig.from_dict(section, source=source)
    data = dataclass_from_mapping(DataConfig, document.get("data") or {}, source=source,
                                  what="data key")
    if not data.paths or not all(isinstance(p, str) and p for p in data.paths):
        raise ConfigError(f"{source}: data.paths must be a non-empty list of dataset files, got "
                          f"{data.paths!r}")
    if not isinstance(data.tokenizer, str) or not data.tokenizer:
        raise ConfigError(f"{source}: data.tokenizer must name a tokenizer directory, got "
                          f"{data.tokenizer!r}")
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
    dp_imbalance: np.ndarray
    aligned: np.ndarray
    truncated: np.ndarray
    plan_ms: np.ndarray
    slowest_rank: np.ndarray  # modeled step time: the slowest rank's summed s + s^2 / k
    mean_rank: np.ndarray  # the mean rank's
    hopeless_steps: int = 0
    seconds: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.bins)

    def summary(self) -> dict[str, Any]:
        """The run's totals: the figures the table, the tuning grid and the JSON report."""
        bins = int(self.bins.sum())
        tokens = int(self.tokens.sum())
        per_rank = self.bins / self.dp_size
        return {
            "steps": self.steps,
            "examples": int(self.batch_size.sum()),
            "tokens": tokens,
            "bins": bins,
            "padding_bins": int(self.padding_bins.sum()),
            "token_fill": tokens / (bins * self.bin_capacity) if bins else 0.0,
            "aligned_steps": int(self.aligned.sum()),
            "aligned_fraction": float(self.aligned.mean()) if self.steps else 0.0,
            "batch_size_min": int(self.batch_size.min()) if self.steps else 0,
            "batch_size_max": int(self.batch_size.max()) if self.steps else 0,
            "token_cv": _cv(self.tokens),
            "dp_imbalance_mean": float(self.dp_imbalance.mean()) if self.steps else 0.0,
            "step_time_cv": StepTimes(self.slowest_rank, self.mean_rank).cv,
            "step_time_imbalance": StepTimes(self.slowest_rank, self.mean_rank).imbalance,
            "micro_batches_per_rank_mean": float(per_rank.mean()) if self.steps else 0.0,
            "micro_batches_per_rank_min": int(per_rank.min()) if self.steps else 0,
            "micro_batches_per_rank_max": int(per_rank.max()) if self.steps else 0,
            "truncated_examples": int(self.truncated.sum()),
            "plan_ms_median": float(np.median(self.plan_ms)) if self.steps else 0.0,
            "plan_ms_p99": float(np.percentile(self.plan_ms, 99)) if self.steps else 0.0,
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
            },
        }


def _cv(values: np.ndarray) -> float:
    array = np.asarray(values, dtype=np.float64)
    return float(array.std() / array.mean()) if array.size and array.mean() else 0.0


def steps_for(lengths: np.ndarray, packing: PackingConfig, steps: int | None) -> int:
    """The given step count, or one epoch: ceil(N / B)."""
    return steps if steps is not None else max(1, math.ceil(len(lengths) / packing.global_batch_size))


def make_sampler(lengths: np.ndarray, packing: PackingConfig, dp_size: int, steps: int, *,
                 align: bool, bin_capacity: int | None = None,
                 variation: float | None = None) -> DPAlignedPackingBatchSampler:
    """The sampler training would build from this packing section (global view: all ranks)."""
    return DPAlignedPackingBatchSampler(
        make_base_order(packing.base_order, len(lengths), packing.seed),
        lengths,
        packing.global_batch_size,
        dp_size,
        bin_capacity=packing.bin_capacity if bin_capacity is None else bin_capacity,
        allowed_variation=(packing.packing_batch_size_allowed_variation if variation is None
                           else variation),
        tp_size=packing.tp_size,
        cp_size=packing.cp_size,
        fp8_enabled=packing.fp8_enabled,
        fp8_recipe=packing.fp8_recipe,
        total_steps=steps,
        algorithm=packing.packing_algorithm,
        oversize_policy=packing.oversize_policy,
        rank_assignment=packing.rank_assignment,
        attention_cost_constant=packing.attention_cost_constant,
        align_to_dp=align,
        lookahead_steps=packing.lookahead_steps,
        max_deferred_examples=packing.max_deferred_examples if align else 0,
        seed=packing.seed,
    )


def simulate_steps(lengths: np.ndarray, packing: PackingConfig, dp_size: int, steps: int, *,
                   align: bool, bin_capacity: int | None = None, variation: float | None = None,
                   label: str | None = None, progress: bool = False) -> StepSeries:
    """Plan ``steps`` steps as training would and record each step's plan."""
    capacity = packing.bin_capacity if bin_capacity is None else bin_capacity
    variation = packing.packing_batch_size_allowed_variation if variation is None else variation
    if align:
        check_batch_window(packing.global_batch_size, variation, dp_size)
    label = label or ("aligned" if align else "fixed B")
    started = time.perf_counter()
    try:
        sampler = make_sampler(lengths, packing, dp_size, steps, align=align,
                               bin_capacity=capacity, variation=variation)
    except ValueError as exc:  # e.g. oversize_policy: error with examples longer than C
        raise ConfigError(f"cannot plan with bin_capacity={capacity}: {exc}") from None
    columns: dict[str, list[Any]] = {k: [] for k in (
        "batch_size", "tokens", "bins", "padding_bins", "token_fill", "dp_imbalance", "aligned",
        "truncated", "plan_ms", "slowest_rank", "mean_rank")}
    hopeless = 0
    with Progress(steps, f"simulating {label} (C={capacity}, variation={variation:g})",
                  progress, unit="step") as bar, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a hopeless window is counted below instead
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
                columns["truncated"].append(len(plan.truncated))
                columns["plan_ms"].append(plan.plan_ms)
                times = rank_times([sampler.effective_lengths[list(b)].tolist() for b in plan.bins],
                                   plan.rank_bins, sampler.attention_cost_constant)
                columns["slowest_rank"].append(float(times.max()))
                columns["mean_rank"].append(float(times.mean()))
                hopeless += int(plan.hopeless)
                bar.update()
            if len(columns["bins"]) == before:
                break
    dtypes = {"token_fill": np.float64, "dp_imbalance": np.float64, "plan_ms": np.float64,
              "aligned": bool, "slowest_rank": np.float64, "mean_rank": np.float64}
    arrays = {k: np.asarray(v, dtype=dtypes.get(k, np.int64)) for k, v in columns.items()}
    return StepSeries(label=label, bin_capacity=capacity, dp_size=dp_size, variation=variation,
                      hopeless_steps=hopeless, seconds=time.perf_counter() - started, **arrays)


@dataclass
class ConfigSimulation:
    """Fixed B against aligned on one config's data."""

    inputs: ConfigInputs
    dataset: DatasetLengths
    fixed: StepSeries
    aligned: StepSeries

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
        }


def simulate_config(inputs: ConfigInputs, dataset: DatasetLengths, *,
                    progress: bool = False) -> ConfigSimulation:
    """Fixed B and aligned runs of the config over its dataset, same order, same step count."""
    steps = steps_for(dataset.lengths, inputs.packing, inputs.steps)
    common: dict[str, Any] = dict(packing=inputs.packing, dp_size=inputs.dp_size, steps=steps, progress=progress)
    fixed = simulate_steps(dataset.lengths, align=False, **common)
    aligned = simulate_steps(dataset.lengths, align=True, **common)
    return ConfigSimulation(inputs, dataset, fixed, aligned)


def format_simulation(result: ConfigSimulation) -> str:
    """A markdown table: one row per measure, fixed B and aligned side by side."""
    inputs, p = result.inputs, result.inputs.packing
    lengths = result.dataset.lengths
    fixed, aligned = result.fixed.summary(), result.aligned.summary()

    def saved(key: str) -> str:
        base = fixed[key]
        return f" ({(aligned[key] - base) / base:+.2%})" if base else ""

    rows = [
        ("bins", lambda s: f"{s['bins']:,}", saved("bins")),
        ("padding bins", lambda s: f"{s['padding_bins']:,}", ""),
        ("token fill", lambda s: f"{s['token_fill']:.2%}", ""),
        ("steps aligned to dp", lambda s: f"{s['aligned_steps']:,} ({s['aligned_fraction']:.1%})", ""),
        ("batch size range", lambda s: f"{s['batch_size_min']}-{s['batch_size_max']}", ""),
        ("micro-batches per rank", lambda s: (f"{s['micro_batches_per_rank_mean']:.2f} "
                                              f"({s['micro_batches_per_rank_min']}-"
                                              f"{s['micro_batches_per_rank_max']})"), ""),
        ("per-step token CV", lambda s: f"{s['token_cv']:.2%}", ""),
        ("rank imbalance (mean max/mean)", lambda s: f"{s['dp_imbalance_mean']:.4f}", ""),
        ("modeled step-time CV (slowest rank)", lambda s: f"{s['step_time_cv']:.2%}", ""),
        ("modeled step time: mean slowest / mean rank",
         lambda s: f"{s['step_time_imbalance']:.4f}", ""),
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
        f"{int((lengths > p.bin_capacity).sum()):,} longer than the capacity",
        "",
        "| measure | fixed B | aligned |",
        "|---|---|---|",
    ]
    for name, cell, extra in rows:
        lines.append(f"| {name} | {cell(fixed)} | {cell(aligned)}{extra} |")
    if aligned["hopeless_steps"]:
        lines += ["", f"{aligned['hopeless_steps']} steps pack into fewer bins than dp = "
                      f"{inputs.dp_size}: alignment cannot succeed there (raise B or lower dp)."]
    return "\n".join(lines)
