"""How the planner's outcome moves when each tuned constant is halved and doubled.

Every field of `PlannerTunables` (megatron_packing/packing/tunables.py) is set to half
and to twice its default in turn (integers: half rounded down, at least 0 or 1 as the field
allows), on a few geometries of the shipped mixed pool, variation 0.05, MFFD. Per run: bins,
steps aligned, per-step token CV, modeled step-time CV, plan ms median, as the change from the
defaults. The pure caches (grid_cache_cells, grids_remembered, memo_examples) and the
threshold for judging grids row by row (range_judge_cells) must show no change at all: they
only change speed. ``repair_budget`` is read by the packers' fixed-count repacking, so it is
swapped in the module that reads it. Prints markdown; not a timed test.

    nice -n 10 python benchmarks/bench_planner_constants.py [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields, replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import Report  # noqa: E402

from megatron_packing.packing import rebin  # noqa: E402
from megatron_packing.packing.planner.sizer import (  # noqa: E402
    DEFAULT_LOOKAHEAD_STEPS,
    DEFAULT_MAX_PACKS,
)
from megatron_packing.packing.tunables import DEFAULT_TUNABLES, PlannerTunables  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402
from megatron_packing.reports.simulation import SimulationResult, simulate  # noqa: E402

# (B, capacity, dp, steps, max deferred): the exact lookahead (B = 128), the whole-window
# bounded search (B = 256), the budgeted search (B = 1024), and deferral.
GEOMETRIES = ((128, 4096, 8, 150, 0), (256, 16384, 8, 100, 0), (1024, 65536, 8, 40, 0),
              (128, 4096, 8, 150, 8))


def scaled(value: int | float | None, factor: float) -> int | float | None:
    if value is None:
        return None
    if isinstance(value, float):
        return value * factor
    return max(0, int(value * factor)) if factor < 1 else int(value * factor)


PLANNER_SETTINGS = {"lookahead_steps": DEFAULT_LOOKAHEAD_STEPS, "max_packs": DEFAULT_MAX_PACKS}
"""The planner's settings swept beside `PlannerTunables` (`PlannerConfig` fields)."""


def run(lengths, batch: int, capacity: int, dp: int, steps: int, deferred: int,
        tunables: PlannerTunables, **settings) -> SimulationResult:
    saved = rebin.DEFAULT_TUNABLES
    rebin.DEFAULT_TUNABLES = tunables  # the packers' repair budget
    try:
        return simulate(lengths, batch_size=batch, capacity=capacity, dp_size=dp, steps=steps,
                        align=True, max_deferred_examples=deferred, tunables=tunables,
                        **{**PLANNER_SETTINGS, **settings})
    finally:
        rebin.DEFAULT_TUNABLES = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also save the tables here")
    parser.add_argument("--fields", default=None, help="comma-separated fields (default: all)")
    args = parser.parse_args()
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    names = [*PLANNER_SETTINGS, *(f.name for f in fields(PlannerTunables))]
    if args.fields:
        names = [n for n in names if n in args.fields.split(",")]
    report.print("Change from the defaults when one constant is halved (x0.5) or doubled (x2). "
                 "bins and aligned: counts; token CV and step-time CV: percentage points.")
    for batch, capacity, dp, steps, deferred in GEOMETRIES:
        lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)
        base = run(lengths, batch, capacity, dp, steps, deferred, DEFAULT_TUNABLES)
        report.print()
        report.print(f"### B={batch}, capacity={capacity}, dp={dp}, {steps} steps"
                     + (f", defer <= {deferred}" if deferred else ""))
        report.print()
        report.print(f"defaults: {base.bins:,} bins, {base.aligned_steps} aligned "
                     f"({base.aligned_fraction:.1%}), token CV {base.token_cv:.2%}, step-time CV "
                     f"{base.step_time_cv:.2%}, plan ms median {base.plan_ms_median:.2f}")
        report.print()
        report.print("| constant | default | x0.5 | bins | aligned | token CV | step-time CV | ms "
                     "| x2 | bins | aligned | token CV | step-time CV | ms |")
        report.print("|---" * 15 + "|")
        for name in names:
            default = (PLANNER_SETTINGS[name] if name in PLANNER_SETTINGS
                       else getattr(DEFAULT_TUNABLES, name))
            if name == "defer_tries" and not deferred:
                continue  # only deferral reads it
            cells = [name, str(default)]
            for factor in (0.5, 2.0):
                value = scaled(default, factor)
                if name in ("lookahead_steps", "max_packs", "defer_tries") and value is not None:
                    value = max(1, int(value))
                if name in PLANNER_SETTINGS:
                    result = run(lengths, batch, capacity, dp, steps, deferred, DEFAULT_TUNABLES,
                                 **{name: value})
                else:
                    result = run(lengths, batch, capacity, dp, steps, deferred,
                                 replace(DEFAULT_TUNABLES, **{name: value}))
                cells += [f"{value:g}" if isinstance(value, float) else str(value),
                          f"{result.bins - base.bins:+d}",
                          f"{result.aligned_steps - base.aligned_steps:+d}",
                          f"{(result.token_cv - base.token_cv) * 100:+.2f}",
                          f"{(result.step_time_cv - base.step_time_cv) * 100:+.2f}",
                          f"{result.plan_ms_median:.2f}"]
            report.print("| " + " | ".join(cells) + " |")
    report.save()


if __name__ == "__main__":
    main()
