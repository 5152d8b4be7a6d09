"""``megatron-packing calibrate``: measure the cost model's two keys on the GPU you train on.

On a GPU it builds one transformer layer of the model's shape (`timing_harness`), times forward
+ backward over the designed bin compositions at the capacity (`packing.cost_design`), fits
``ms = a + b T + c sum(s^2)`` (`packing.cost_fit`) and prints the fit: each composition measured
against modeled, the worst relative error, and the two YAML lines
``attention_cost_constant: <b/c>`` and ``microbatch_cost_tokens: <a/b>``. ``--write`` sets them
in the ``--config`` file's packing: section (`packing_keys`); ``--output-dir`` keeps the timings
(`timings_file`, JSON lines) and the printed report; ``--from-timings`` fits a saved file
without a GPU. Bad input is one line naming the flag, key, file or line, with exit status 2; so
is a fit whose constants come out negative (with the table: no key is written).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_packing.common.validation import ConfigError, output_directory, require_positive_int
from megatron_packing.packing.cost_design import design_compositions
from megatron_packing.packing.cost_fit import CostFit, FitError, Measured, fit_costs

from .timings_file import read_timings, write_timings

KEYS = ("attention_cost_constant", "microbatch_cost_tokens")
TIMINGS, REPORT = "timings.jsonl", "calibration.md"  # what --output-dir holds
DTYPE_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16",
               "fp32": "fp32", "float32": "fp32"}
"""The dtype names ``--dtype`` and ``model.dtype`` take, to the harness's."""
CPU_NOTE = ("CPU timings (--device cpu, a test of the harness): they do not predict a GPU's; "
            "calibrate on the GPU you train on")


@dataclass(frozen=True)
class Target:
    """What to time: the layer's shape and the capacity (from flags, else the YAML)."""

    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    dtype: str
    capacity: int


def _sections(config: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The YAML's model: and packing: sections ({} without --config)."""
    if config is None:
        return {}, {}
    from megatron_packing.config import read_yaml_mapping

    document = read_yaml_mapping(config)
    model, packing = document.get("model") or {}, document.get("packing") or {}
    for name, section in (("model", model), ("packing", packing)):
        if not isinstance(section, dict):
            raise ConfigError(f"{config}: the {name}: section must be a mapping of keys, got "
                              f"{type(section).__name__}")
    return model, packing


def _flag(args: argparse.Namespace, flag: str) -> Any:
    return getattr(args, flag.lstrip("-").replace("-", "_"))


def resolve_target(args: argparse.Namespace) -> Target:
    """The shape and capacity: each flag, else the --config YAML's key, else a clear refusal."""
    model, packing = _sections(args.config)
    source = args.config or "(no --config)"

    def setting(flag: str, key: str) -> tuple[Any, str]:
        """The flag's value, else the model: key's, with the name to blame (None: neither)."""
        if _flag(args, flag) is not None:
            return _flag(args, flag), flag
        return model.get(key), f"{source}: model.{key}"

    def positive(flag: str, key: str) -> int:
        found, name = setting(flag, key)
        if found is None:
            raise ConfigError(f"no {flag} given and no model.{key} in {source}: give {flag} N, "
                              f"or --config with a model: section that sets {key}")
        return int(require_positive_int(name, found))

    hidden = positive("--hidden-size", "hidden_size")
    heads = positive("--num-attention-heads", "num_attention_heads")
    if hidden % heads:
        raise ConfigError(f"the hidden size {hidden} is not a multiple of the {heads} attention "
                          "heads (--hidden-size, --num-attention-heads)")
    ffn = 4 * hidden if setting("--ffn-hidden-size", "ffn_hidden_size")[0] is None \
        else positive("--ffn-hidden-size", "ffn_hidden_size")
    dtype, name = setting("--dtype", "dtype")
    dtype = "bf16" if dtype is None else dtype
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"{name} {dtype!r} cannot be timed; use one of "
                          f"{', '.join(sorted(DTYPE_NAMES))}")
    if args.capacity is not None:
        capacity = args.capacity
    elif args.config is not None:
        from megatron_packing.config import PackingConfig

        capacity = PackingConfig.from_dict(packing, source=args.config).bin_capacity
    else:
        raise ConfigError("no --capacity given and no --config: give the bin capacity with "
                          "--capacity C, or --config with a packing: section")
    if capacity < 64:
        raise ConfigError(f"bin capacity {capacity}: calibrate needs at least 64 tokens to vary "
                          "the sequence mix")
    return Target(hidden, heads, ffn, DTYPE_NAMES[dtype], capacity)


def format_fit(fit: CostFit) -> list[str]:
    """The table of every composition, measured against modeled, and the fit's constants."""
    lines = ["| composition | sequences | tokens | sum of s^2 | measured ms | modeled ms | error |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in fit.rows:
        m = row.measured
        lines.append(f"| {m.describe()} | {len(m.lengths)} | {m.tokens:,} | {m.squares:,.0f} "
                     f"| {m.ms:.3f} | {row.modeled_ms:.3f} | {row.relative_error:+.1%} |")
    worst = fit.worst
    lines += ["", f"fit: ms = a + b x tokens + c x sum(s^2), a = {fit.a:.4g} ms per micro-batch, "
                  f"b = {fit.b:.4g} ms per token, c = {fit.c:.4g} ms per squared length; worst "
                  f"relative error {worst.relative_error:+.1%} ({worst.measured.describe()})"]
    return lines


def _measure(args: argparse.Namespace, target: Target) -> tuple[list[Measured], list[str]]:
    """Time the designed compositions on the device; the header lines say what was timed."""
    import torch

    from .timing_harness import LayerShape, time_layer

    device = args.device or "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("a GPU is needed to time the layer (no CUDA device is visible); fit "
                          "saved timings without one with --from-timings FILE")
    shape = LayerShape(target.hidden_size, target.num_attention_heads, target.ffn_hidden_size,
                       target.dtype)
    compositions = design_compositions(target.capacity)
    timings = time_layer(shape, compositions, device=device, repeats=args.repeats,
                         time_limit_s=args.time_limit_s)
    header = [f"timed: one layer ({shape.describe()}) at capacity {target.capacity:,}, forward "
              f"+ backward, median of {args.repeats}, on {timings.device}; {timings.backend}; "
              f"{len(timings.measured)} of {len(compositions)} compositions in "
              f"{timings.seconds:.1f} s"]
    header += timings.notes
    if timings.stopped_early:
        header.append(f"--time-limit-s {args.time_limit_s:g} reached: the fit uses the "
                      f"{len(timings.measured)} compositions timed")
    if device == "cpu":
        header.append(CPU_NOTE)
    return timings.measured, header


def run_calibration(args: argparse.Namespace) -> tuple[list[str], CostFit]:
    """The report's lines (what was timed or read, then the table) and the fit."""
    if args.write and args.config is None:
        raise ConfigError("--write sets the keys in the --config YAML: give --config FILE")
    if args.output_dir is not None:  # checked before anything is timed
        output_directory(args.output_dir, "--output-dir")
    if args.from_timings is not None:
        measured = read_timings(args.from_timings)
        header = [f"fitted: {args.from_timings} ({len(measured)} compositions)"]
    else:
        measured, header = _measure(args, resolve_target(args))
        if args.output_dir is not None:
            header.append(f"timings: {write_timings(Path(args.output_dir) / TIMINGS, measured)}")
    if args.output_dir is not None:
        header.append(f"report: {Path(args.output_dir) / REPORT}")
    try:
        fit = fit_costs(measured)
    except FitError as exc:
        limit = ("" if args.from_timings is not None or args.time_limit_s is None else
                 f" (--time-limit-s {args.time_limit_s:g} stopped the timing after "
                 f"{len(measured)} compositions: allow more time)")
        raise ConfigError(f"cannot fit the timings: {exc}{limit}") from None
    return header + [""] + format_fit(fit), fit


def _error(message: str) -> int:
    print(f"megatron-packing calibrate: error: {message}", file=sys.stderr, flush=True)
    return 2


def calibrate_command(args: argparse.Namespace) -> int:
    """The command: the report, then exactly the two YAML lines; exit status 2 (one line on
    stderr) on bad input, or on a fit whose constants come out negative (after the table)."""
    try:
        lines, fit = run_calibration(args)
    except ConfigError as exc:
        return _error(str(exc))
    problem = None
    if fit.negative:
        problem = ("the fit's constants come out negative (" + "; ".join(fit.negative) + "): "
                   "these timings do not follow a + b x tokens + c x sum(s^2) with positive "
                   "constants (too noisy, too few repeats, or a device busy with other work); no "
                   "key is given and none written")
        lines += ["", f"no keys: {problem}"]
    else:
        values = {KEYS[0]: fit.attention_cost_constant, KEYS[1]: fit.microbatch_cost_tokens}
        if args.write:
            from .packing_keys import write_packing_keys

            try:
                write_packing_keys(args.config, values)
            except ConfigError as exc:
                return _error(str(exc))
            lines += ["", f"wrote both keys into the packing: section of {args.config}"]
        lines += ["", "the keys, for the packing: section:"]
        lines += [f"{key}: {value:.6g}" for key, value in values.items()]
    text = "\n".join(lines)
    if args.output_dir is not None:
        report = Path(args.output_dir) / REPORT
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    return _error(problem) if problem is not None else 0
