"""Whole bins to ranks (Karmarkar-Karp) against moving examples after it (`rebalanced`).

On the held-out geometries of `bench_held_out_geometries.py` (same pools, seeds and steps),
fixed B and this planner each run twice, with ``rank_assignment`` ``karmarkar_karp`` and
``rebalanced``; the plans (examples per step, bins per rank) are the same, only which bin an
example sits in changes. Columns: modeled step-time imbalance mean(slowest rank) / mean(rank),
step-time CV, the run's modeled time (the slowest rank's cost summed over steps, relative to fixed
B with whole bins), and the sampler's planning time per step, median and p99 (the rebalance
is inside it). Prints markdown; not a timed test.

    nice -n 10 python benchmarks/bench_rank_rebalance.py [--fill-rounds R] [--evens E] [--out FILE]

``--fill-rounds`` and ``--evens`` replace `PlannerTunables.rebalance_fill_rounds` and
``rebalance_evens_per_rank``. ``--sweep`` halves and doubles each of the three rebalance
constants instead (those two and ``rebalance_partners``; halves round down, 0 stands for half of
1) and prints the means over the nine geometries, then the same on `bench_step_planning.py`'s
B 4096 / 128K / dp 64 (mixed pool, 30 steps). The saved sweep also varied a fourth, the swap
neighbours, since fixed at one each side (`bench_hand_out_budget.py`).

    nice -n 10 python benchmarks/bench_rank_rebalance.py --sweep [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_held_out_geometries import GEOMETRIES, MIXES, STEPS  # noqa: E402
from report import Report  # noqa: E402

from megatron_packing.packing.tunables import DEFAULT_TUNABLES, PlannerTunables  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402
from megatron_packing.reports.simulation import SimulationResult, simulate  # noqa: E402

K = 1024
METHODS = ("karmarkar_karp", "rebalanced")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fill-rounds", type=int, default=DEFAULT_TUNABLES.rebalance_fill_rounds)
    parser.add_argument("--evens", type=int, default=DEFAULT_TUNABLES.rebalance_evens_per_rank)
    parser.add_argument("--only", default=None, help="indices of GEOMETRIES to run, e.g. 0,3")
    parser.add_argument("--sweep", action="store_true",
                        help="halve and double both constants (see the module docstring)")
    parser.add_argument("--out", default=None, help="also save the tables here")
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
        return
    tunables = replace(DEFAULT_TUNABLES, rebalance_fill_rounds=args.fill_rounds,
                       rebalance_evens_per_rank=args.evens)
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    chosen = (GEOMETRIES if args.only is None
              else [GEOMETRIES[int(i)] for i in args.only.split(",")])
    report.print(f"fill rounds {args.fill_rounds}, evens per rank {args.evens}; steps: "
                 + ", ".join(f"{s} at B = {b}" for b, s in STEPS.items())
                 + "; variation 0.05; MFFD; k = 24,576.")
    report.print()
    report.print("| mix | B / C / dp | planner | ranks get | slowest / mean rank | step-time CV "
                 "| modeled time vs fixed B, whole bins | plan ms median | plan ms p99 |")
    report.print("|---|---|---|---|---|---|---|---|---|")
    totals: dict[tuple[bool, str], list[float]] = {}
    for mix, batch, capacity, dp in chosen:
        steps = STEPS[batch]
        lengths = mixed_stream({n: pools[n] for n in MIXES[mix]}, batch * steps, capacity,
                               seed=args.seed)
        name = f"{batch} / {capacity // K}K / {dp}"
        base = None
        for align in (False, True):
            for method in METHODS:
                run = simulate(lengths, batch_size=batch, capacity=capacity, dp_size=dp,
                               steps=steps, align=align, rank_assignment=method,
                               tunables=tunables)
                base = run.modeled_time if base is None else base
                totals.setdefault((align, method), []).append(run.step_time_imbalance)
                label = "this planner" if align else "fixed B"
                kind = "whole bins" if method == "karmarkar_karp" else "rebalanced"
                report.print(f"| {mix} | {name} | {label} | {kind} "
                             f"| {run.step_time_imbalance:.4f} | {run.step_time_cv:.2%} "
                             f"| {run.modeled_time / base:.4f} | {run.plan_ms_median:.2f} "
                             f"| {run.plan_ms_p99:.2f} |")
    report.print()
    report.print("| planner | ranks get | mean slowest / mean rank over the geometries |")
    report.print("|---|---|---|")
    for (align, method), values in totals.items():
        label = "this planner" if align else "fixed B"
        kind = "whole bins" if method == "karmarkar_karp" else "rebalanced"
        report.print(f"| {label} | {kind} | {sum(values) / len(values):.4f} |")
    report.save()


Setting = tuple[int, int, int]  # fill rounds, evens per rank, partners


def sweep_settings() -> list[Setting]:
    """The defaults, then each of the three constants halved and doubled, the others kept."""
    d = DEFAULT_TUNABLES
    base = (d.rebalance_fill_rounds, d.rebalance_evens_per_rank, d.rebalance_partners)
    out = [base]
    for k in range(len(base)):
        for value in (base[k] // 2, base[k] * 2):
            changed = list(base)
            changed[k] = value
            out.append((changed[0], changed[1], changed[2]))
    return out


def with_setting(setting: Setting) -> PlannerTunables:
    rounds, evens, partners = setting
    return replace(DEFAULT_TUNABLES, rebalance_fill_rounds=rounds,
                   rebalance_evens_per_rank=evens, rebalance_partners=partners)


def sweep(args: argparse.Namespace) -> None:
    report = Report(args.out)
    pools = load_pools(find_pool_dir())
    settings = sweep_settings()
    report.print("Means over the nine held-out geometries of `bench_held_out_geometries.py`, "
                 "with `rank_assignment: rebalanced`; modeled time: the run's summed "
                 "slowest-rank cost against fixed B with whole bins on the same geometry; plan "
                 "ms: the per-geometry medians, their maximum and mean. Defaults in bold.")
    report.print()
    report.print("| fill rounds | evens per rank | partners | planner "
                 "| mean slowest / mean rank | mean modeled time vs fixed B, whole bins "
                 "| plan ms median: max / mean |")
    report.print("|---|---|---|---|---|---|---|")
    rows: dict[tuple[Setting, bool], list[tuple[float, float, float]]] = {}
    for mix, batch, capacity, dp in GEOMETRIES:
        steps = STEPS[batch]
        lengths = mixed_stream({n: pools[n] for n in MIXES[mix]}, batch * steps, capacity,
                               seed=args.seed)
        base = simulate(lengths, batch_size=batch, capacity=capacity, dp_size=dp, steps=steps,
                        align=False, rank_assignment="karmarkar_karp")
        for setting in settings:
            tunables = with_setting(setting)
            for align in (True, False):
                run = simulate(lengths, batch_size=batch, capacity=capacity, dp_size=dp,
                               steps=steps, align=align, rank_assignment="rebalanced",
                               tunables=tunables)
                rows.setdefault((setting, align), []).append(
                    (run.step_time_imbalance, run.modeled_time / base.modeled_time,
                     run.plan_ms_median))
    for setting in settings:
        bold = setting == settings[0]
        for align in (True, False):
            values = rows[(setting, align)]
            cells = [*(f"**{v}**" if bold else str(v) for v in setting),
                     "this planner" if align else "fixed B",
                     f"{sum(v[0] for v in values) / len(values):.4f}",
                     f"{sum(v[1] for v in values) / len(values):.4f}",
                     f"{max(v[2] for v in values):.2f} / {sum(v[2] for v in values) / len(values):.2f}"]
            report.print("| " + " | ".join(cells) + " |")
    report.print()
    batch, capacity, dp, steps = 4096, 128 * K, 64, 30
    lengths = mixed_stream(pools, batch * steps, capacity, seed=args.seed)

    def planned(method: str, tunables: PlannerTunables = DEFAULT_TUNABLES) -> SimulationResult:
        return simulate(lengths, batch_size=batch, capacity=capacity, dp_size=dp, steps=steps,
                        align=True, rank_assignment=method, tunables=tunables)

    report.print(f"B {batch} / {capacity // K}K / dp {dp}, mixed pool, {steps} steps, this "
                 "planner; modeled time against whole bins:")
    report.print()
    report.print("| fill rounds | evens per rank | partners | slowest / mean rank "
                 "| modeled time vs whole bins | plan ms median |")
    report.print("|---|---|---|---|---|---|")
    whole = planned("karmarkar_karp")
    report.print(f"| whole bins | - | - | {whole.step_time_imbalance:.4f} | 1.0000 "
                 f"| {whole.plan_ms_median:.2f} |")
    for setting in settings:
        run = planned("rebalanced", with_setting(setting))
        report.print(f"| {' | '.join(map(str, setting))} | {run.step_time_imbalance:.4f} "
                     f"| {run.modeled_time / whole.modeled_time:.4f} | {run.plan_ms_median:.2f} |")
    report.save()


if __name__ == "__main__":
    main()
