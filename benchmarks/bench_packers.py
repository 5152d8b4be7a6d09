"""Measure the packers on real SFT length pools, on one core.

Prints markdown tables (and writes them to ``--out``):

1. time to pack, median and p99 over repeated runs, for the planner-sized case (1,024
   lengths from the mixed pool at capacity 65,536) and for large inputs (100,000 and
   1,000,000 lengths at 4,096);
2. bins used versus the volume lower bound ceil(sum / capacity) on every pool (and the
   stronger L2 bound, for reference).

Times are CPU seconds of the packing thread (steady on a shared machine); wall medians too.

The mixed pool: for each example pick a pool uniformly, then a length from it (seeded, with
replacement), clipped to the capacity.

    python benchmarks/bench_packers.py --out benchmarks/results/bench_packers.md
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from megatron_packing.packing.factory import make_seq_packer  # noqa: E402

ALGORITHMS = ("mffd", "ffd", "bfd")
DEFAULT_POOLS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "lengths"


def load_pools(folder: Path) -> dict[str, np.ndarray]:
    pools = {p.stem: np.loadtxt(p, dtype=np.int64, ndmin=1) for p in sorted(folder.glob("*.txt"))}
    if not pools:
        raise SystemExit(f"no *.txt length pools in {folder}")
    return pools


def mixed_sample(pools: dict[str, np.ndarray], n: int, capacity: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    names = sorted(pools)
    which = rng.integers(0, len(names), size=n)
    out = np.empty(n, dtype=np.int64)
    for i, name in enumerate(names):
        mask = which == i
        out[mask] = rng.choice(pools[name], size=int(mask.sum()))
    return np.minimum(out, capacity)


def time_runs(
    algorithm: str, capacity: int, samples: list[np.ndarray]
) -> tuple[list[float], list[float]]:
    """CPU seconds (robust on a shared machine) and wall seconds per run."""
    packer = make_seq_packer(algorithm, capacity)
    cpu, wall = [], []
    for lengths in samples:
        packer._memo = None  # time real packing, not the memo
        start_cpu, start_wall = time.thread_time(), time.perf_counter()
        packer.pack(lengths)
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    return cpu, wall


def l2_bound(lengths: np.ndarray, capacity: int) -> int:
    """Martello-Toth L2 lower bound: counts items above C/2 exactly, unlike ceil(sum / C).

    For each threshold a <= C/2: items > C - a need their own bins; items in (C/2, C - a]
    each need a bin too, with spare room; items in [a, C/2] must fill that spare room or
    new bins.
    """
    a = np.sort(lengths.astype(np.int64))
    prefix = np.concatenate(([0], np.cumsum(a)))
    alphas = np.unique(np.concatenate(([0], a[2 * a <= capacity])))
    i_half = np.searchsorted(a, capacity // 2, side="right")
    i_big = np.searchsorted(a, capacity - alphas, side="right")
    n_big = len(a) - i_big
    n_mid = i_big - i_half
    room_mid = n_mid * capacity - (prefix[i_big] - prefix[i_half])
    small = prefix[i_half] - prefix[np.searchsorted(a, alphas, side="left")]
    extra = np.maximum(0, -(-(small - room_mid) // capacity))
    return int((n_big + n_mid + extra).max())


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.2f} ms" if ms < 100 else f"{ms:,.0f} ms"


def timing_table(pools: dict[str, np.ndarray], quick: bool) -> list[str]:
    cases = [(1024, 65536, 20 if quick else 200), (100_000, 4096, 3 if quick else 7)]
    cases.append((1_000_000, 4096, 1 if quick else 3))
    rows = [
        "| algorithm | lengths | capacity | runs | median (CPU) | p99 (CPU) | median (wall) "
        "| bins | lower bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(rows), flush=True)
    for n, capacity, runs in cases:
        samples = [mixed_sample(pools, n, capacity, seed) for seed in range(runs)]
        for algorithm in ALGORITHMS:
            cpu, wall = time_runs(algorithm, capacity, samples)
            packer = make_seq_packer(algorithm, capacity)
            bins = len(packer.pack(samples[0]))
            bound = packer.lower_bound(samples[0])
            rows.append(
                f"| {algorithm} | {n:,} | {capacity:,} | {runs} | "
                f"{fmt_ms(float(np.median(cpu)))} | {fmt_ms(float(np.percentile(cpu, 99)))} | "
                f"{fmt_ms(float(np.median(wall)))} | {bins:,} | {bound:,} |"
            )
            print(rows[-1], flush=True)
    return rows


def gap_table(pools: dict[str, np.ndarray]) -> list[str]:
    rows = [
        "| pool | n | capacity | bound ceil(sum/C) | L2 bound | "
        + " | ".join(f"{a} bins (gap)" for a in ALGORITHMS)
        + " |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(ALGORITHMS),
    ]
    print("\n".join(rows), flush=True)
    for capacity in (4096, 65536):
        for name, pool in [*pools.items(), ("mixed", None)]:
            lengths = (
                mixed_sample(pools, 10_000, capacity, 0)
                if pool is None
                else np.minimum(pool, capacity)
            )
            bound = make_seq_packer("mffd", capacity).lower_bound(lengths)
            cells = []
            for algorithm in ALGORITHMS:
                bins = len(make_seq_packer(algorithm, capacity).pack(lengths))
                cells.append(f"{bins:,} (+{bins - bound}, {100 * (bins - bound) / bound:.2f}%)")
            rows.append(
                f"| {name} | {len(lengths):,} | {capacity:,} | {bound:,} | "
                f"{l2_bound(lengths, capacity):,} | " + " | ".join(cells) + " |"
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pools", type=Path, default=DEFAULT_POOLS)
    parser.add_argument("--out", type=Path, default=None, help="also write the tables here")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    pools = load_pools(args.pools)
    header = [
        "# Packer benchmark",
        "",
        f"Python {platform.python_version()}, numpy {np.__version__}, one thread, "
        f"{platform.machine()}; `python benchmarks/bench_packers.py`.",
        "",
        "## Time to pack (mixed pool, clipped to capacity)",
        "",
    ]
    print("\n".join(header))
    timing = timing_table(pools, args.quick)
    middle = [
        "",
        "## Bins versus the volume lower bound ceil(sum / capacity)",
        "",
        "Whole pools in file order, lengths clipped to capacity; `mixed` is 10,000 draws. "
        "Gaps are to ceil(sum/C); the L2 bound (items above C/2 need a bin each) shows how "
        "much of a gap no packer can close.",
        "",
    ]
    print("\n".join(middle))
    gaps = gap_table(pools)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join([*header, *timing, *middle, *gaps, ""]))


if __name__ == "__main__":
    main()
