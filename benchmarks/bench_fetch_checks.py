"""Cost of checking fetched examples against the length index, and of verifying a store on load.

A token store (the real on-disk format, memory-mapped) with lengths from the mixed real pool;
steps of B random examples fetched through `PlannedDataset` with the per-example checks on and
off (interleaved, so both see the same machine load), and the checks alone on already-fetched
examples. Then the time to open the store with and without its checksums. Prints markdown
tables; not a timed test.

    python benchmarks/bench_fetch_checks.py [--batch 1024] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from megatron_packing.data.dataset import SFTDataset  # noqa: E402
from megatron_packing.data.store import StoreWriter, TokenStore  # noqa: E402
from megatron_packing.reports.pools import find_pool_dir, load_pools, mixed_stream  # noqa: E402
from megatron_packing.stream.fetch import PlannedDataset, check_fetched  # noqa: E402


def write_store(path: Path, lengths: np.ndarray) -> TokenStore:
    """Pseudo-random ids and an assistant-half loss mask, in chunks of 4,096 examples."""
    rng = np.random.default_rng(0)
    writer = StoreWriter(path)
    for start in range(0, len(lengths), 4096):
        part = lengths[start:start + 4096]
        ids = rng.integers(1, 32000, size=int(part.sum()), dtype=np.int32)
        mask = np.concatenate([np.repeat(np.array([0, 1], np.uint8), [n // 2, n - n // 2]) for n in part])
        writer.append(ids, mask, part, np.arange(start, start + len(part)) + 1)
    return writer.commit({"kind": "cache", "key": "bench", "source": "synthetic"})


def percentiles(us: list[float]) -> str:
    arr = np.asarray(us)
    return f"{np.median(arr):,.0f} µs | {np.percentile(arr, 99):,.0f} µs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--examples", type=int, default=50_000)
    parser.add_argument("--capacity", type=int, default=16384)
    args = parser.parse_args()
    lengths = mixed_stream(load_pools(find_pool_dir()), args.examples, args.capacity, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        store = write_store(Path(tmp) / "store", lengths)
        ds = SFTDataset([store], options={}, fingerprint="bench")
        checked, unchecked = PlannedDataset(ds, verify=True), PlannedDataset(ds, verify=False)
        rng = np.random.default_rng(1)
        times: dict[str, list[float]] = {"off": [], "on": [], "check": []}
        for _ in range(args.steps):
            indices = rng.choice(len(ds), size=args.batch, replace=False).tolist()
            for name, wrapped in (("off", unchecked), ("on", checked)):
                started = time.perf_counter()
                examples = wrapped.__getitems__(indices)
                times[name].append((time.perf_counter() - started) * 1e6)
            started = time.perf_counter()
            check_fetched(ds, indices, examples, {})
            times["check"].append((time.perf_counter() - started) * 1e6)
        tokens = int(store.meta["num_tokens"])
        print(f"{len(ds):,} examples, {tokens:,} tokens (mean {tokens / len(ds):,.0f}), "
              f"B = {args.batch}, {args.steps} steps\n")
        print("| fetch of one step (B examples) | median | p99 |")
        print("|---|---|---|")
        print(f"| checks off | {percentiles(times['off'])} |")
        print(f"| checks on | {percentiles(times['on'])} |")
        print(f"| the checks alone | {percentiles(times['check'])} |")

        size = sum((store.path / f).stat().st_size for f in os.listdir(store.path))
        opens: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(5):
            for verify in (False, True):
                started = time.perf_counter()
                TokenStore(store.path, verify_checksums=verify)
                opens[verify].append(time.perf_counter() - started)
        print(f"\n| open the store ({size / 2**20:,.0f} MiB on disk) | median of 5 |")
        print("|---|---|")
        print(f"| sizes, offsets and sums only (workers) | {np.median(opens[False]) * 1e3:,.1f} ms |")
        print(f"| with checksums (first open) | {np.median(opens[True]) * 1e3:,.1f} ms |")


if __name__ == "__main__":
    main()
