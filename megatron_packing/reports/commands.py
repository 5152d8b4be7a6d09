"""The bodies of ``megatron-packing simulate``, ``tune`` and ``inspect --with-data``.

Each takes the namespace of the command line's one parser tree (`megatron_packing.cli`; the
options are declared in `arguments`). The ``--config`` forms read a training YAML, load its data
through the cached length index, print a table and write a JSON and a PNG under
``--output-dir`` (default ``reports/<config name>/``); errors in the config or the data are
printed as one line naming the key, file or record, with exit status 2. The pool form of
``simulate`` prints the comparison table (or JSON) of `simulation.compare` on a length pool; a
bad combination of arguments or an unknown pool raises `arguments.UsageError`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from megatron_packing.common.validation import output_directory
from megatron_packing.config import ConfigError

from .arguments import UsageError, resolve_simulate_form
from .config_simulation import (
    ConfigInputs,
    DatasetLengths,
    format_simulation,
    load_lengths,
    read_config,
    simulate_config,
    simulate_steps,
    steps_for,
)
from .pools import find_pool_dir, load_pools, pool_stream
from .progress import Progress, progress_enabled
from .simulation import compare, format_comparison, offline_best_paths
from .tuning import (
    DEFAULT_CAPACITY_FACTORS,
    DEFAULT_VARIATIONS,
    TUNE_MAX_STEPS,
    TunePoint,
    capacity_grid,
    make_grid,
    recommend,
    truncates_most,
)


def default_output_dir(config: str | Path) -> Path:
    return Path("reports") / Path(config).stem


def _fail(command: str, exc: BaseException) -> int:
    print(f"megatron-packing {command}: error: {exc}", file=sys.stderr, flush=True)
    return 2


def _data_errors() -> tuple[type[BaseException], ...]:
    from megatron_packing.data import BadRecordError, CorruptStoreError

    return (ConfigError, BadRecordError, CorruptStoreError, FileNotFoundError, ValueError)


def _load(inputs: ConfigInputs, quiet: bool) -> DatasetLengths:
    dataset = load_lengths(inputs, show_progress=progress_enabled(quiet))
    if dataset.num_examples == 0:
        raise ConfigError(f"{inputs.source}: the data section gives 0 examples "
                          f"(skipped: {dataset.skipped or 'none'})")
    return dataset


def _write_json(path: Path, document: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def _plot(make: Callable[[], Path], command: str) -> str:
    from .plots import PlotsUnavailable

    try:
        return str(make())
    except PlotsUnavailable as exc:
        print(f"megatron-packing {command}: warning: {exc}; no PNG written", file=sys.stderr)
        return "(no PNG: matplotlib missing)"


# ---------------------------------------------------------------------------- simulate
def simulate_command(args: argparse.Namespace) -> int:
    """``megatron-packing simulate``: with ``--config`` on a training YAML's data, else on the
    length pools. Raises `UsageError` for arguments that do not make sense together."""
    resolve_simulate_form(args)
    return _simulate_on_config(args) if args.config is not None else _simulate_on_pools(args)


def _simulate_on_pools(args: argparse.Namespace) -> int:
    """Fixed B, the exhaustive reference, aligned (and deferred) and the offline best path."""
    try:
        pools = load_pools(find_pool_dir(args.pool_dir))
        lengths = pool_stream(pools, args.pool, args.steps * args.batch_size, args.capacity,
                              seed=args.seed)
    except (FileNotFoundError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    common: dict[str, Any] = dict(batch_size=args.batch_size, capacity=args.capacity,
                                  dp_size=args.dp_size, steps=args.steps,
                                  variation=args.variation, algorithm=args.algorithm)
    runs = compare(lengths, exhaustive=not args.no_exhaustive,
                   max_deferred_examples=args.max_deferred, dp_balanced=True,
                   microbatch_cost_tokens=args.microbatch_cost_tokens, **common)
    best = None if args.no_ceiling else offline_best_paths(lengths, **common)
    if args.json:
        document: dict[str, Any] = {r.label: asdict(r) for r in runs}
        if best is not None:
            document["best_contiguous_paths"] = asdict(best)
        print(json.dumps(document, indent=2))
    else:
        title = (f"{args.pool} pool, B={args.batch_size}, capacity={args.capacity}, "
                 f"dp={args.dp_size}, variation={args.variation}, {args.steps} steps"
                 + (f", microbatch_cost_tokens={args.microbatch_cost_tokens:g}"
                    if args.microbatch_cost_tokens else ""))
        print(format_comparison(runs, title, best))
    return 0


def _simulate_on_config(args: argparse.Namespace) -> int:
    """Fixed B against aligned on the YAML's data: table, ``simulate.json``, ``simulate.png``."""
    started = time.perf_counter()
    try:
        out = output_directory(args.output_dir or default_output_dir(args.config),
                               "--output-dir")
        inputs = read_config(args.config, dp_size=args.dp_size, steps=args.steps)
        dataset = _load(inputs, args.quiet)
        result = simulate_config(inputs, dataset, progress=progress_enabled(args.quiet))
    except _data_errors() as exc:
        return _fail("simulate", exc)
    document = result.to_json()
    document["wall_seconds"] = time.perf_counter() - started
    json_path = _write_json(out / "simulate.json", document)
    png = "(--no-plot)"
    if not args.no_plot:
        from .plots import plot_simulation

        p = inputs.packing
        title = (f"{Path(args.config).name}: {dataset.num_examples:,} examples, B={p.global_batch_size}, "
                 f"C={p.bin_capacity}, dp={inputs.dp_size}, variation "
                 f"{p.packing_batch_size_allowed_variation}, {result.fixed.steps} steps")
        png = _plot(lambda: plot_simulation([document["fixed"], document["aligned"]],
                                            out / "simulate.png", title), "simulate")
    if args.json:
        print(json.dumps(document, indent=1))
    else:
        print(format_simulation(result))
        print()
        print(f"wrote {json_path} and {png} ({time.perf_counter() - started:.1f} s; "
              f"length index {dataset.load_seconds:.1f} s)")
    return 0


# ---------------------------------------------------------------------------- tune
def tune_command(args: argparse.Namespace) -> int:
    """``megatron-packing tune``: the capacity x variation grid and a recommendation."""
    started = time.perf_counter()
    try:
        out = output_directory(args.output_dir or default_output_dir(args.config),
                               "--output-dir")
        inputs = read_config(args.config, dp_size=args.dp_size, steps=args.steps)
        dataset = _load(inputs, args.quiet)
        report = run_tuning(inputs, dataset, capacities=args.capacities,
                            variations=args.variations, steps=args.steps,
                            progress=progress_enabled(args.quiet))
    except _data_errors() as exc:
        return _fail("tune", exc)
    report["wall_seconds"] = time.perf_counter() - started
    json_path = _write_json(out / "tune.json", report)
    png = "(--no-plot)"
    if not args.no_plot:
        from .plots import plot_tuning

        p = inputs.packing
        title = (f"{Path(args.config).name}: {dataset.num_examples:,} examples, "
                 f"B={p.global_batch_size}, dp={inputs.dp_size}, {report['steps']} steps per point")
        fixed = {int(k): v for k, v in report["fixed"].items()}
        png = _plot(lambda: plot_tuning(report["points"], fixed, report["recommended"],
                                        out / "tune.png", title), "tune")
    print(format_tuning(report))
    print()
    print(f"wrote {json_path} and {png} ({time.perf_counter() - started:.1f} s)")
    return 0


def _per_1000(summary: dict[str, Any]) -> float:
    """A run's modeled time per 1,000 examples (tokens of work)."""
    return summary["modeled_time"] / summary["examples"] * 1000 if summary["examples"] else 0.0


def run_tuning(inputs: ConfigInputs, dataset: DatasetLengths, *,
               capacities: Sequence[int] | None = None, variations: Sequence[float] | None = None,
               steps: int | None = None, progress: bool = False) -> dict[str, Any]:
    """Simulate every runnable grid point (aligned) and each capacity's fixed-B run."""
    p = inputs.packing
    lengths = dataset.lengths
    steps = steps or min(steps_for(lengths, p, inputs.steps), TUNE_MAX_STEPS)
    bin_multiple = p.alignment.bin_multiple
    capacities = sorted(set(capacities)) if capacities else capacity_grid(
        p.bin_capacity, bin_multiple=bin_multiple, factors=DEFAULT_CAPACITY_FACTORS)
    variations = sorted(set(variations)) if variations else sorted(
        set(DEFAULT_VARIATIONS) | {p.packing_batch_size_allowed_variation})
    grid = make_grid(capacities, variations, batch_size=p.global_batch_size, dp_size=inputs.dp_size)
    common: dict[str, Any] = dict(packing=p, dp_size=inputs.dp_size, steps=steps)
    points: list[TunePoint] = []
    fixed: dict[str, dict[str, Any]] = {}
    runnable = sum(g.problem is None for g in grid) + len(capacities)
    with Progress(runnable, "tuning", progress, unit="run") as bar:
        for capacity in capacities:
            try:
                run = simulate_steps(lengths, align=False, bin_capacity=capacity, **common)
                s = run.summary()
                fixed[str(capacity)] = {
                    "token_fill": s["token_fill"], "aligned_fraction": s["aligned_fraction"],
                    "token_cv": s["token_cv"], "micro_batches_per_rank": s["micro_batches_per_rank_mean"],
                    "padding_bins": s["padding_bins"], "truncated_examples": s["truncated_examples"],
                    "modeled_per_1000": _per_1000(s)}
            except ConfigError as exc:
                fixed[str(capacity)] = {"problem": str(exc)}
            bar.update()
        for g in grid:
            problem = g.problem
            figures: dict[str, Any] = {}
            if problem is None:
                try:
                    run = simulate_steps(lengths, align=True, bin_capacity=g.bin_capacity,
                                         variation=g.variation, **common)
                    s = run.summary()
                    figures = dict(token_fill=s["token_fill"], aligned_fraction=s["aligned_fraction"],
                                   token_cv=s["token_cv"],
                                   micro_batches_per_rank=s["micro_batches_per_rank_mean"],
                                   padding_bins=s["padding_bins"],
                                   truncated_examples=s["truncated_examples"],
                                   batch_size_min=s["batch_size_min"],
                                   batch_size_max=s["batch_size_max"],
                                   examples=s["examples"], modeled_per_1000=_per_1000(s))
                except ConfigError as exc:
                    problem = str(exc)
                bar.update()
            if problem is not None:
                figures = dict(token_fill=0.0, aligned_fraction=0.0, token_cv=0.0,
                               micro_batches_per_rank=0.0, padding_bins=0, truncated_examples=0)
            points.append(TunePoint(g.bin_capacity, g.variation, g.v, problem=problem, **figures))
    choice = recommend(points, current_capacity=p.bin_capacity,
                       current_variation=p.packing_batch_size_allowed_variation)
    return {
        "config": inputs.source,
        "dp_size": inputs.dp_size,
        "global_batch_size": p.global_batch_size,
        "current": {"bin_capacity": p.bin_capacity,
                    "packing_batch_size_allowed_variation": p.packing_batch_size_allowed_variation,
                    "align_packing_bins_to_dp": p.align_packing_bins_to_dp},
        "examples": dataset.num_examples,
        "longer_than": {str(c): int((lengths > c).sum()) for c in capacities},
        "steps": steps,
        "points": [pt.to_json() for pt in points],
        "fixed": fixed,
        "recommended": choice.point.to_json() if choice.point else None,
        "reasons": choice.reasons,
    }


def format_tuning(report: dict[str, Any]) -> str:
    """The grid as a table, each capacity's fixed-B row, then the recommendation and why."""
    cur = report["current"]
    lines = [
        f"### {report['config']}: {report['examples']:,} examples, B = "
        f"{report['global_batch_size']}, dp = {report['dp_size']}, {report['steps']} steps per "
        f"point (current: C = {cur['bin_capacity']}, variation "
        f"{cur['packing_batch_size_allowed_variation']}, align "
        f"{str(cur['align_packing_bins_to_dp']).lower()})",
        "",
        "| C | variation (v) | fill | aligned steps | token CV | micro-batches / rank "
        "| modeled time / 1,000 examples (K) | padding bins | batch size | truncated |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    chosen = report["recommended"]
    for capacity, fixed in sorted(report["fixed"].items(), key=lambda kv: int(kv[0])):
        if "problem" in fixed:
            lines.append(f"| {int(capacity):,} | fixed B | - | - | - | - | - | - | - "
                         f"| {fixed['problem']} |")
        else:
            lines.append(
                f"| {int(capacity):,} | fixed B | {fixed['token_fill']:.2%} "
                f"| {fixed['aligned_fraction']:.1%} | {fixed['token_cv']:.2%} "
                f"| {fixed['micro_batches_per_rank']:.2f} "
                f"| {fixed.get('modeled_per_1000', 0.0) / 1e3:,.1f} | {fixed['padding_bins']:,} "
                f"| {report['global_batch_size']} | {fixed['truncated_examples']:,} |")
        for pt in (q for q in report["points"] if q["bin_capacity"] == int(capacity)):
            star = " **<- recommended**" if chosen and pt == chosen else ""
            if pt["problem"]:
                lines.append(f"| {pt['bin_capacity']:,} | {pt['variation']:g} ({pt['v']}) | - | - "
                             f"| - | - | - | - | - | not run: {pt['problem']} |")
                continue
            mark = " (most truncated: not ranked)" if truncates_most(
                pt["truncated_examples"], pt.get("examples", 0)) else ""
            lines.append(
                f"| {pt['bin_capacity']:,} | {pt['variation']:g} ({pt['v']}){star} "
                f"| {pt['token_fill']:.2%} | {pt['aligned_fraction']:.1%} | {pt['token_cv']:.2%} "
                f"| {pt['micro_batches_per_rank']:.2f} "
                f"| {pt.get('modeled_per_1000', 0.0) / 1e3:,.1f} | {pt['padding_bins']:,} "
                f"| {pt['batch_size_min']}-{pt['batch_size_max']} | "
                f"{pt['truncated_examples']:,}{mark} |")
    lines.append("")
    if chosen:
        cut = (f" (truncates {chosen['truncated_examples']:,} of {chosen['examples']:,} "
               "simulated examples to the capacity)" if chosen["truncated_examples"] else "")
        lines.append(f"Recommendation: align_packing_bins_to_dp: true, bin_capacity: "
                     f"{chosen['bin_capacity']}, packing_batch_size_allowed_variation: "
                     f"{chosen['variation']:g}{cut}")
    else:
        lines.append("Recommendation: none")
    for reason in report["reasons"]:
        lines.append(f"- {reason}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- inspect
def inspect_data(document: dict[str, Any], source: str, *, paths: Sequence[str] | None,
                 tokenizer: str | None, capacity: int, output_dir: str | None,
                 quiet: bool = False, plot: bool = True) -> int:
    """Length statistics of the data section (or ``--data``), loaded the way training loads
    it (its cache_dir, on_bad_record and loss_on), and a length histogram PNG."""
    from megatron_packing.config import dataclass_from_mapping
    from megatron_packing.config.training import DataConfig
    from megatron_packing.data import load_sft_dataset

    data = dataclass_from_mapping(DataConfig, document.get("data") or {}, source=source,
                                  what="data key")
    out = (output_directory(output_dir or default_output_dir(source), "--output-dir")
           if plot else None)
    paths = list(paths) if paths else list(data.paths)
    tokenizer = tokenizer or data.tokenizer
    if not paths:
        raise ConfigError(f"{source}: no data.paths in the YAML and no --data given")
    if not tokenizer:
        raise ConfigError(f"{source}: no data.tokenizer in the YAML and no --tokenizer given")
    ds = load_sft_dataset(paths, tokenizer, loss_on=data.loss_on, on_bad_record=data.on_bad_record,
                          cache_dir=data.cache_dir, show_progress=progress_enabled(quiet))
    lengths = np.asarray(ds.lengths, dtype=np.int64)
    skipped = dict(ds.skipped)
    print(f"dataset: {len(ds)} examples, {int(lengths.sum())} tokens, "
          f"{int(np.asarray(ds.loss_token_counts, dtype=np.int64).sum())} loss tokens")
    if skipped:
        print(f"  skipped bad records ({data.on_bad_record}): {sum(skipped.values())} ("
              + ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) + ")")
    print(f"  length index: {', '.join(ds.index_paths)}")
    if not len(lengths):
        return 0
    pct = np.percentile(lengths, [50, 90, 99])
    print(f"  length min {lengths.min()} mean {lengths.mean():.1f} p50 {pct[0]:.0f} "
          f"p90 {pct[1]:.0f} p99 {pct[2]:.0f} max {lengths.max()}")
    print(f"  longer than bin_capacity {capacity}: {int((lengths > capacity).sum())}")
    if plot:
        from .plots import plot_length_histogram

        assert out is not None
        png = _plot(lambda: plot_length_histogram(
            lengths, capacity, out / "lengths.png",
            f"{Path(source).name}: {len(lengths):,} examples"), "inspect")
        print(f"  histogram: {png}")
    return 0
